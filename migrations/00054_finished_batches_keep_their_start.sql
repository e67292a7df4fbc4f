-- +goose Up
-- A batch starts (in_progress, started_at) in the background once its first
-- item is sent; a batch whose items all finish before that start is recorded
-- went from queued to terminal, and kept no started_at, though its items ran
-- (seen in drains of fast items). set_batch_status, same signature (the
-- replicas of the previous release call it too), now gives a batch that ends
-- without a start the moment the first of its items that ran (completed or
-- failed) was claimed: a batch none of whose items ran keeps none.
-- A batch's end is now the moment of the move (clock_timestamp), not its
-- transaction's start: a finish that waited for the batch's lock while
-- another replica started it ended it before that start (a completed_at
-- 2.5 ms before the started_at, seen in a drain across three replicas).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION set_batch_status(p_id uuid, p_status text, p_error_code text, p_error_message text) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    UPDATE batches b SET status = p_status,
           started_at = CASE
               WHEN p_status = 'in_progress' THEN coalesce(b.started_at, now())
               WHEN b.started_at IS NULL AND p_status IN ('completed', 'failed', 'cancelled', 'expired')
                   THEN (SELECT min(i.started_at) FROM batch_items i
                          WHERE i.batch_id = b.id AND i.status IN ('completed', 'failed'))
               ELSE b.started_at END,
           completed_at = CASE WHEN p_status IN ('completed', 'failed', 'cancelled', 'expired') THEN clock_timestamp() ELSE b.completed_at END,
           error_code = p_error_code, error_message = p_error_message
     WHERE b.id = p_id;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION set_batch_status(p_id uuid, p_status text, p_error_code text, p_error_message text) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    UPDATE batches b SET status = p_status,
           started_at = CASE WHEN p_status = 'in_progress' THEN coalesce(b.started_at, now()) ELSE b.started_at END,
           completed_at = CASE WHEN p_status IN ('completed', 'failed', 'cancelled', 'expired') THEN now() ELSE b.completed_at END,
           error_code = p_error_code, error_message = p_error_message
     WHERE b.id = p_id;
END;
$$;
-- +goose StatementEnd
