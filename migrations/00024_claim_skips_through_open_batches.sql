-- +goose Up
-- claim_batch_items: as in 00022, without reading every open batch. Where
-- each account's queued items start (its oldest open batch) was an aggregate
-- over all open batches, read whole by every claim: 0.7-1.0 ms a claim with
-- 3,000 batches open, as a burst of creations leaves them, which the claim
-- paid however few items it took. The accounts are now found one after the
-- other from the pivot through the index of open batches (an index probe
-- an account), and only as many as the claim looks at. And whatever the
-- statistics, an account's first queued item is found through the claim
-- index, and each item's batch by key (see accounts_with_work, candidates).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid, p_models text[])
RETURNS TABLE (batch_id uuid, idx integer, account_id uuid, request jsonb, batch_status text, claimed boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v          record;
    v_tids     tid[];
    v_statuses text[];
    v_batches  uuid[];
    v_indexes  integer[];
    v_project  uuid;
    v_estimate bigint;
    v_ok       boolean;
BEGIN
    WITH RECURSIVE after_pivot AS (
        -- Where each account's queued items can start: its oldest open batch,
        -- found one account after the other from the pivot by the index of
        -- open batches (a skip scan), as far as the claim reads them.
        (SELECT b.account_id, b.created_at AS since FROM batches b
          WHERE b.status IN ('queued', 'in_progress') AND b.account_id > p_pivot
          ORDER BY b.account_id, b.created_at LIMIT 1)
        UNION ALL
        SELECT n.account_id, n.since FROM after_pivot a CROSS JOIN LATERAL (
            SELECT b.account_id, b.created_at AS since FROM batches b
             WHERE b.status IN ('queued', 'in_progress') AND b.account_id > a.account_id
             ORDER BY b.account_id, b.created_at LIMIT 1) n
    ), up_to_pivot AS (
        (SELECT b.account_id, b.created_at AS since FROM batches b
          WHERE b.status IN ('queued', 'in_progress') AND b.account_id <= p_pivot
          ORDER BY b.account_id, b.created_at LIMIT 1)
        UNION ALL
        SELECT n.account_id, n.since FROM up_to_pivot a CROSS JOIN LATERAL (
            SELECT b.account_id, b.created_at AS since FROM batches b
             WHERE b.status IN ('queued', 'in_progress') AND b.account_id > a.account_id
               AND b.account_id <= p_pivot
             ORDER BY b.account_id, b.created_at LIMIT 1) n
    ), open_since AS (
        SELECT * FROM after_pivot UNION ALL SELECT * FROM up_to_pivot
    ), accounts_with_work AS (
        -- The first p_max accounts with a queued item, in turn from the
        -- pivot: each account's first queued item is looked for from where
        -- its items start (a lateral subquery with a limit, which the planner
        -- runs for each account with the account's bounds: see 00019), and
        -- no further account is looked at once p_max have work.
        SELECT o.account_id, o.since
          FROM open_since o -- in turn from the pivot, as found
         CROSS JOIN LATERAL (
            -- In the claim index's order: without it, statistics taken while
            -- many items were queued made a sequential scan look quicker to
            -- find the first (12 ms a claim, in drains of 300 batches).
            SELECT 1 FROM batch_items i
             WHERE i.status = 'queued' AND i.account_id = o.account_id AND i.queued_at >= o.since
               AND (p_models IS NULL OR i.model = ANY (p_models))
             ORDER BY i.queued_at
             LIMIT 1) w
         LIMIT p_max
    ), chosen AS (
        -- Fewer than p_max found are all that have work; with p_max found,
        -- each gets p_per_account as it would among more.
        SELECT a.account_id, a.since, greatest(p_per_account, ceil(p_max::numeric / count(*) OVER ())::integer) AS share
          FROM accounts_with_work a
         ORDER BY (a.account_id <= p_pivot), a.account_id
    ), candidates AS (
        SELECT c.tid, c.batch_id, c.idx, c.batch_status FROM chosen ch
        CROSS JOIN LATERAL (
            SELECT i.ctid AS tid, i.batch_id, i.idx, ib.status AS batch_status FROM batch_items i
             -- Each item's batch by key, a lookup for each item taken: as a
             -- plain join, a generic plan of this statement merged the items
             -- with every batch in key order (28 ms a claim, in two drains of
             -- 300 batches of six); the limit keeps the subquery from being
             -- made a join.
             CROSS JOIN LATERAL (
                SELECT b.status FROM batches b WHERE b.id = i.batch_id
                   AND (b.status IS NOT DISTINCT FROM 'queued' OR b.status IS NOT DISTINCT FROM 'in_progress')
                 LIMIT 1) ib
             WHERE i.status = 'queued' AND i.account_id = ch.account_id AND i.queued_at >= ch.since
               AND i.expires_at > now()
               AND (p_models IS NULL OR i.model = ANY (p_models))
             ORDER BY i.queued_at, i.batch_id, i.idx
             LIMIT ch.share
             FOR UPDATE OF i SKIP LOCKED
        ) c
        LIMIT p_max
    )
    SELECT array_agg(c.tid), array_agg(c.batch_status), array_agg(c.batch_id), array_agg(c.idx)
      INTO v_tids, v_statuses, v_batches, v_indexes FROM candidates c;
    IF v_batches IS NULL THEN
        RETURN;
    END IF;

    -- Items of projects without a budget cap: nothing to reserve.
    RETURN QUERY
    WITH taken AS (
        UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
               lease_expires_at = now() + p_lease, started_at = now()
          FROM unnest(v_tids, v_statuses) AS c(tid, batch_status), projects p
         WHERE i.ctid = c.tid
           AND i.status IS NOT DISTINCT FROM 'queued' -- no index condition: see above
           AND p.id = i.project_id AND p.budget_cap_rungs IS NULL
        RETURNING i.batch_id, i.idx, i.account_id, i.request, c.batch_status
    )
    SELECT t.batch_id, t.idx, t.account_id, t.request, t.batch_status, true FROM taken t;

    -- Items of capped projects: each reserves its estimate, in claim order; an
    -- item the budget cannot cover fails with the rest of its batch's queue.
    FOR v IN
        SELECT c.batch_id, c.idx
          FROM unnest(v_batches, v_indexes) WITH ORDINALITY AS c(batch_id, idx, n)
          JOIN batch_items i ON i.batch_id = c.batch_id AND i.idx = c.idx
          JOIN projects p ON p.id = i.project_id
         WHERE p.budget_cap_rungs IS NOT NULL
         ORDER BY c.n
    LOOP
        SELECT i.batch_id, i.idx, i.account_id, i.request, i.project_id, i.estimate_rungs
          INTO batch_id, idx, account_id, request, v_project, v_estimate
          FROM batch_items i WHERE i.batch_id = v.batch_id AND i.idx = v.idx
           AND i.status IS NOT DISTINCT FROM 'queued'; -- by key: see above
        IF NOT FOUND THEN
            CONTINUE; -- failed meanwhile with an earlier candidate of its batch
        END IF;
        SELECT b.status INTO batch_status FROM batches b WHERE b.id = v.batch_id;

        SELECT p.budget_cap_rungs - p.spent_rungs - p.reserved_rungs >= v_estimate INTO v_ok
          FROM projects p WHERE p.id = v_project FOR NO KEY UPDATE;
        IF v_ok THEN
            UPDATE projects SET reserved_rungs = reserved_rungs + v_estimate WHERE id = v_project;
            UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
                   lease_expires_at = now() + p_lease, started_at = now(), reserved_rungs = v_estimate
             WHERE i.batch_id = v.batch_id AND i.idx = v.idx;
            claimed := true;
        ELSE
            WITH doomed AS (
                SELECT i.batch_id, i.idx FROM batch_items i
                 WHERE i.batch_id = v.batch_id AND (i.idx = v.idx OR i.status IS NOT DISTINCT FROM 'queued')
                 FOR UPDATE SKIP LOCKED
            )
            UPDATE batch_items i SET status = 'failed', error_code = 'BUDGET_EXCEEDED',
                   error_message = 'the project budget cap was reached before this item ran',
                   completed_at = now()
              FROM doomed d WHERE i.batch_id = d.batch_id AND i.idx = d.idx;
            claimed := false;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00019.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00024 cannot be reverted'; END $$;
-- +goose StatementEnd
