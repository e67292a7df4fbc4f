-- +goose Up
-- claim_batch_items: as in 00043, and it passes over the accounts named in
-- p_skip. A replica's drainer holds off an account whose items the upstream
-- targets fail while no other account's do (a prompt they choke on, an
-- output too long for the deadline): its items wait out the cool-down, and
-- the other accounts' items are claimed and run meanwhile. NULL skips none.
-- A parameter more is a new signature, beside the old one, which replicas of
-- the previous release call during a rolling upgrade: it becomes this one
-- skipping none (a later release drops it).
-- +goose StatementBegin
CREATE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid, p_models text[], p_skip uuid[])
RETURNS TABLE (batch_id uuid, idx integer, account_id uuid, request jsonb, batch_status text, claimed boolean)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    v_tids      tid[];
    v_statuses  text[];
    v_batches   uuid[];
    v_indexes   integer[];
    -- Each candidate's project and estimate, in claim order.
    v_all_projects  uuid[];
    v_all_estimates bigint[];
    -- The capped projects among the candidates' (NULL: none).
    v_capped_projects uuid[];
    -- The candidates of capped projects, in claim order: their places among
    -- the candidates, projects and estimates.
    v_capped    integer[];
    v_projects  uuid[];
    v_estimates bigint[];
    -- Each capped project, in key order, and the budget left to reserve.
    v_ids       uuid[];
    v_room      bigint[];
    v_k         integer;
    v_p         integer;
    -- What the choice made, as places in v_capped; the batches refused.
    v_taken     integer[] := '{}';
    v_refused   integer[] := '{}';
    v_doomed    uuid[] := '{}';
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
         -- Accounts the drainer holds off (their calls failing alone
         -- upstream) are passed over, and do not count among the p_max.
         WHERE p_skip IS NULL OR o.account_id <> ALL (p_skip)
         LIMIT p_max
    ), chosen AS (
        -- Fewer than p_max found are all that have work; with p_max found,
        -- each gets p_per_account as it would among more.
        SELECT a.account_id, a.since, greatest(p_per_account, ceil(p_max::numeric / count(*) OVER ())::integer) AS share
          FROM accounts_with_work a
         ORDER BY (a.account_id <= p_pivot), a.account_id
    ), candidates AS (
        SELECT c.tid, c.batch_id, c.idx, c.batch_status, c.project_id, c.estimate_rungs FROM chosen ch
        CROSS JOIN LATERAL (
            SELECT i.ctid AS tid, i.batch_id, i.idx, ib.status AS batch_status, i.project_id, i.estimate_rungs FROM batch_items i
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
    SELECT array_agg(c.tid), array_agg(c.batch_status), array_agg(c.batch_id), array_agg(c.idx),
           array_agg(c.project_id), array_agg(c.estimate_rungs)
      INTO v_tids, v_statuses, v_batches, v_indexes, v_all_projects, v_all_estimates FROM candidates c;
    IF v_batches IS NULL THEN
        RETURN;
    END IF;
    -- Which of the candidates' projects have a budget cap: each project read
    -- once, however many of its items the claim took.
    SELECT array_agg(p.id) INTO v_capped_projects FROM projects p
     WHERE p.id = ANY (v_all_projects) AND p.budget_cap_rungs IS NOT NULL;

    -- Items of projects without a budget cap: nothing to reserve.
    RETURN QUERY
    WITH taken AS (
        UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
               lease_expires_at = now() + p_lease, started_at = now()
          FROM unnest(v_tids, v_statuses, v_all_projects) AS c(tid, batch_status, project_id)
         WHERE i.ctid = c.tid
           AND i.status IS NOT DISTINCT FROM 'queued' -- no index condition: see above
           AND (v_capped_projects IS NULL OR c.project_id <> ALL (v_capped_projects))
        RETURNING i.batch_id, i.idx, i.account_id, i.request, c.batch_status
    )
    SELECT t.batch_id, t.idx, t.account_id, t.request, t.batch_status, true FROM taken t;

    -- Items of capped projects: each reserves its estimate, in claim order; an
    -- item the budget cannot cover fails with the rest of its batch's queue,
    -- and later items of other batches may still fit. Each project is locked
    -- once, in key order, and its room read once; the choice is made in
    -- memory and written in three statements whatever the number of items:
    -- one update a project for the reservations, the items taken, the
    -- batches refused.
    IF v_capped_projects IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(c.n ORDER BY c.n), array_agg(c.project_id ORDER BY c.n), array_agg(c.estimate ORDER BY c.n)
      INTO v_capped, v_projects, v_estimates
      FROM unnest(v_all_projects, v_all_estimates) WITH ORDINALITY AS c(project_id, estimate, n)
     WHERE c.project_id = ANY (v_capped_projects);
    SELECT array_agg(l.id ORDER BY l.id), array_agg(l.room ORDER BY l.id) INTO v_ids, v_room
      FROM (SELECT p.id, p.budget_cap_rungs - p.spent_rungs - p.reserved_rungs AS room FROM projects p
             WHERE p.id = ANY (v_projects) ORDER BY p.id FOR NO KEY UPDATE) l;
    FOR v_k IN 1 .. cardinality(v_capped) LOOP
        CONTINUE WHEN v_batches[v_capped[v_k]] = ANY (v_doomed);
        v_p := array_position(v_ids, v_projects[v_k]);
        -- A cap lifted since the items were read: nothing to count against.
        IF v_room[v_p] IS NULL OR v_room[v_p] >= v_estimates[v_k] THEN
            v_room[v_p] := v_room[v_p] - v_estimates[v_k];
            v_taken := v_taken || v_k;
        ELSE
            v_refused := v_refused || v_k;
            v_doomed := v_doomed || v_batches[v_capped[v_k]];
        END IF;
    END LOOP;

    UPDATE projects p SET reserved_rungs = p.reserved_rungs + r.rungs
      FROM (SELECT v_projects[t.k] AS id, sum(v_estimates[t.k]) AS rungs FROM unnest(v_taken) AS t(k) GROUP BY 1) r
     WHERE p.id = r.id;

    RETURN QUERY
    WITH chosen AS (
        SELECT v_tids[v_capped[t.k]] AS tid, v_statuses[v_capped[t.k]] AS batch_status, v_estimates[t.k] AS estimate
          FROM unnest(v_taken) AS t(k)
    ), taken AS (
        UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
               lease_expires_at = now() + p_lease, started_at = now(), reserved_rungs = c.estimate
          FROM chosen c
         WHERE i.ctid = c.tid
           AND i.status IS NOT DISTINCT FROM 'queued' -- no index condition: see above
        RETURNING i.batch_id, i.idx, i.account_id, i.request, c.batch_status
    )
    SELECT t.batch_id, t.idx, t.account_id, t.request, t.batch_status, true FROM taken t;

    IF cardinality(v_refused) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH doomed AS (
        SELECT i.batch_id, i.idx FROM batch_items i
         WHERE i.batch_id = ANY (v_doomed) AND i.status IS NOT DISTINCT FROM 'queued' -- by key: see above
         FOR UPDATE SKIP LOCKED
    ), failed AS (
        UPDATE batch_items i SET status = 'failed', error_code = 'BUDGET_EXCEEDED',
               error_message = 'the project budget cap was reached before this item ran',
               completed_at = now()
          FROM doomed d WHERE i.batch_id = d.batch_id AND i.idx = d.idx
        RETURNING i.batch_id, i.idx, i.account_id, i.request
    ), refused AS (
        SELECT v_batches[v_capped[r.k]] AS batch_id, v_indexes[v_capped[r.k]] AS idx, v_statuses[v_capped[r.k]] AS batch_status
          FROM unnest(v_refused) AS r(k)
    )
    -- Of the items failed, those refused: the others had not been claimed.
    SELECT f.batch_id, f.idx, f.account_id, f.request, r.batch_status, false
      FROM failed f JOIN refused r ON r.batch_id = f.batch_id AND r.idx = f.idx;
END;
$$;
-- +goose StatementEnd

CREATE OR REPLACE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid, p_models text[])
RETURNS TABLE (batch_id uuid, idx integer, account_id uuid, request jsonb, batch_status text, claimed boolean)
LANGUAGE sql AS $$
    SELECT * FROM claim_batch_items(p_owner, p_max, p_per_account, p_lease, p_pivot, p_claim_id, p_models, NULL::uuid[])
$$;

-- +goose Down
-- Forward only, like 00043.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00044 cannot be reverted'; END $$;
-- +goose StatementEnd
