-- +goose Up
-- A batch's start and finish, by key whatever the size and statistics of the
-- batch tables, with plans kept for the session. The drainer's choice of
-- batches to start, the lock of a batch with the facts of its items, and
-- the change of its status were prepared statements, planned for each call
-- through store.plannedPerCall with 00028: generic plans made while the
-- tables were tiny read them whole once a burst had grown them. A plan a call
-- costs a tenth of a millisecond or more, and a batch pays for six of these
-- statements: about 0.3 ms of PostgreSQL more an item in drains of one-item
-- batches (bench/drain -items 1). Functions planned with sequential scans off
-- read by key and keep their plans, as done_batches (00026) and the client's
-- reads (00028) do.
-- +goose StatementBegin
-- queued_batches: of the batches given, those still queued, read without
-- locks. The status check is one no index of open batches serves (IS NOT
-- DISTINCT FROM, see 00019).
CREATE FUNCTION queued_batches(p_ids uuid[]) RETURNS SETOF uuid
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    SELECT b.id FROM batches b WHERE b.id = ANY (p_ids) AND b.status IS NOT DISTINCT FROM 'queued';
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- lock_batch: the batch's status, locked for a transition, with the facts of
-- its items; of the account p_account_id only, when it is given.
CREATE FUNCTION lock_batch(p_id uuid, p_account_id uuid)
RETURNS TABLE (status text, unfinished integer, running integer, succeeded integer, expired_items integer, first_error text)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    SELECT b.status, f.unfinished, f.running, f.succeeded, f.expired_items, f.first_error
      FROM batches b
     CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE i.status IN ('queued', 'in_progress'))::integer AS unfinished,
               count(*) FILTER (WHERE i.status = 'in_progress')::integer AS running,
               count(*) FILTER (WHERE i.status = 'completed')::integer AS succeeded,
               count(*) FILTER (WHERE i.cancel_reason = 'expiry')::integer AS expired_items,
               coalesce((array_agg(i.error_code ORDER BY i.idx) FILTER (WHERE i.status = 'failed'))[1], '')::text AS first_error
          FROM batch_items i WHERE i.batch_id = b.id
     ) f
     WHERE b.id = p_id AND (p_account_id IS NULL OR b.account_id = p_account_id)
       FOR UPDATE OF b;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- set_batch_status: moves the batch p_id to p_status, stamping when it started
-- and ended, with its error when it has one.
CREATE FUNCTION set_batch_status(p_id uuid, p_status text, p_error_code text, p_error_message text) RETURNS void
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

-- +goose Down
DROP FUNCTION set_batch_status(uuid, text, text, text);
DROP FUNCTION lock_batch(uuid, uuid);
DROP FUNCTION queued_batches(uuid[]);
