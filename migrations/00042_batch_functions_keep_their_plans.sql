-- +goose Up
-- Four of the functions that read the batch tables by key (00026, 00028,
-- 00030) were planned again on most calls: a connection keeps a function's
-- statements for the session, but after their first five calls PostgreSQL
-- goes on planning them for each call's arguments whenever that plan looks
-- cheaper than the generic one, and for a key or a few it mostly does (the
-- generic plan prices ten ids where a call gives one or two). Counted with
-- pg_stat_statements (track = all, track_planning) over a drain of 12,000
-- items in batches of 100: queued_batches planned 553 times in 547 calls,
-- 0.15 ms a plan against 0.016 ms to run; done_batches 194 in 240, lock_batch
-- 106 in 240, the client's poll of a batch (batch_item_totals) 314 in 340:
-- 217-235 ms of planning, 7 % of PostgreSQL's time in statements in that
-- drain. The generic plans read by key as the plans made for a call do
-- (sequential scans are off in these functions), so they are kept: planned
-- once a session (and again after an ANALYZE of their tables), whatever the
-- arguments.
ALTER FUNCTION queued_batches(uuid[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION lock_batch(uuid, uuid) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION batch_item_totals(uuid) SET plan_cache_mode = force_generic_plan;

-- done_batches, likewise, with its check for unfinished items kept a subplan
-- run for each batch with the batch's key (OFFSET 0: PostgreSQL does not
-- make such a subquery a join). As an anti-join, its generic plan made while
-- the tables were tiny read the whole primary key of the items for each
-- batch, as a join filter (13 ms and 9,400 buffers a call of 64 batches,
-- in a drain of one-item batches), where a plan made for the call had read
-- each batch's items by key.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION done_batches(p_ids uuid[]) RETURNS SETOF uuid
LANGUAGE plpgsql STABLE SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    SELECT b.id FROM batches b
     WHERE b.id = ANY (p_ids)
       AND (b.status IS NOT DISTINCT FROM 'queued' OR b.status IS NOT DISTINCT FROM 'in_progress'
            OR b.status IS NOT DISTINCT FROM 'cancelling')
       AND NOT EXISTS (
         SELECT 1 FROM batch_items i WHERE i.batch_id = b.id AND i.status IN ('queued', 'in_progress') OFFSET 0);
END;
$$;
-- +goose StatementEnd

-- +goose Down
ALTER FUNCTION batch_item_totals(uuid) RESET plan_cache_mode;
ALTER FUNCTION lock_batch(uuid, uuid) RESET plan_cache_mode;
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION done_batches(p_ids uuid[]) RETURNS SETOF uuid
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
ALTER FUNCTION queued_batches(uuid[]) RESET plan_cache_mode;
