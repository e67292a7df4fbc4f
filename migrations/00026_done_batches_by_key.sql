-- +goose Up
-- done_batches: of the batches given, those not yet terminal with no item
-- queued or running (the completer asks it of the batches of each group it
-- commits). As a statement of its own it was planned from statistics taken
-- while no batch was open (autovacuum's ANALYZE after a drain): the planner
-- took the batches for one row and their unfinished items for none, and
-- scanned the whole items table for each batch of a group, 10-20 ms a call
-- (seen with auto_explain in drains of 300 batches, 1.5-3.3 ms on average).
-- Both reads are by key, through the primary keys, whatever the statistics
-- say: a function planned with sequential scans off (its plans are kept for
-- the session). A batch's items are at most 100.
-- +goose StatementBegin
CREATE FUNCTION done_batches(p_ids uuid[]) RETURNS SETOF uuid
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    SELECT b.id FROM batches b
     WHERE b.id = ANY (p_ids)
       AND (b.status IS NOT DISTINCT FROM 'queued' OR b.status IS NOT DISTINCT FROM 'in_progress'
            OR b.status IS NOT DISTINCT FROM 'cancelling')
       AND NOT EXISTS (
         SELECT 1 FROM batch_items i WHERE i.batch_id = b.id AND i.status IN ('queued', 'in_progress'));
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION done_batches(uuid[]);
