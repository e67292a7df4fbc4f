-- +goose Up
-- Batch items are paid for without a reservation row each. What an item holds
-- lives on the item itself: its estimate (charged to the day of its batch's
-- creation, `queued_at`), and while it runs, the budget it reserved
-- (`reserved_rungs`, on capped projects). When an item reaches a final status,
-- the statement that puts it there records what it settles in
-- `batch_settlements`, one row per account, day and project of the statement
-- (a trigger, so that no path to a final status can forget it); the reconciler
-- folds those rows into the counters. Creating an item, running it and
-- settling it no longer insert, update and delete a row of its own.

ALTER TABLE batch_items
    ADD COLUMN reserved_rungs bigint NOT NULL DEFAULT 0 CHECK (reserved_rungs >= 0);
COMMENT ON COLUMN batch_items.queued_at IS
    'When the batch was created; its estimate is charged to this UTC day. Never changes.';
COMMENT ON COLUMN batch_items.reserved_rungs IS
    'What the item holds on its project''s budget while in_progress (its estimate on a capped project); 0 otherwise.';

-- Settled and not yet folded: day_rungs goes onto the day's charge (the actual
-- cost minus the estimate charged at creation: negative for a refund),
-- spent_rungs onto the project's spend, reserved_rungs off its reservations.
CREATE TABLE batch_settlements (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id     uuid NOT NULL,
    day            date NOT NULL,
    project_id     uuid NOT NULL,
    day_rungs      bigint NOT NULL,
    spent_rungs    bigint NOT NULL CHECK (spent_rungs >= 0),
    reserved_rungs bigint NOT NULL CHECK (reserved_rungs >= 0)
);
-- The reconciler's order and the usage view's per-day sums; the budget view
-- sums per project.
CREATE INDEX batch_settlements_account_idx ON batch_settlements (account_id, day, project_id);
CREATE INDEX batch_settlements_project_idx ON batch_settlements (project_id);

-- What the reservations held moves to the items and the settlements: a running
-- item keeps its budget reservation; settled rows, and rows no unfinished item
-- holds, become settlements (the latter refunded, as recovery would have).
UPDATE batch_items i SET reserved_rungs = r.reserved_rungs
  FROM reservations r
 WHERE r.request_id = i.request_id AND i.status = 'in_progress' AND r.settled_rungs IS NULL;
INSERT INTO batch_settlements (account_id, day, project_id, day_rungs, spent_rungs, reserved_rungs)
SELECT r.account_id, r.day, r.project_id,
       sum(coalesce(r.settled_rungs, 0) - r.charged_rungs), sum(coalesce(r.settled_rungs, 0)), sum(r.reserved_rungs)
  FROM reservations r
 WHERE r.settled_rungs IS NOT NULL
    OR NOT EXISTS (SELECT 1 FROM batch_items i WHERE i.request_id = r.request_id AND i.status IN ('queued', 'in_progress'))
 GROUP BY r.account_id, r.day, r.project_id;
DELETE FROM reservations;
DROP FUNCTION reconcile_settlements(integer, uuid[], uuid);

-- Replicas of earlier releases still running during a rolling upgrade write
-- a reservation per batch item they create, cancel through it, and run the
-- job that released lapsed ones. Their items settle through the trigger like
-- any other; the table stays, empty (what they write into it is dropped), and
-- the job finds nothing, until a later release removes both.
-- +goose StatementBegin
CREATE FUNCTION ignore_retired_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
CREATE TRIGGER reservations_retired BEFORE INSERT ON reservations
    FOR EACH ROW EXECUTE FUNCTION ignore_retired_write();
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION release_expired_reservations(p_max integer) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    RETURN 0;
END;
$$;
-- +goose StatementEnd

-- Only a running item holds a reservation: every statement that moves an item
-- out of in_progress gives it back by setting reserved_rungs to 0.
ALTER TABLE batch_items ADD CONSTRAINT batch_items_reserved_while_running
    CHECK (reserved_rungs = 0 OR status = 'in_progress');

-- settle_batch_items: for the items an UPDATE moved from queued or in_progress
-- to a final status, the actual cost (completed) or nothing (failed, cancelled)
-- against the estimate charged, and the reservation given back; for items put
-- back in the queue, the reservation given back. One row per account, day and
-- project of the statement.
-- +goose StatementBegin
CREATE FUNCTION settle_batch_items() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO batch_settlements (account_id, day, project_id, day_rungs, spent_rungs, reserved_rungs)
    SELECT n.account_id, (n.queued_at AT TIME ZONE 'UTC')::date, n.project_id,
           sum(CASE WHEN n.status = 'completed' THEN n.total_rungs ELSE 0 END
               - CASE WHEN n.status IN ('completed', 'failed', 'cancelled') THEN n.estimate_rungs ELSE 0 END),
           sum(CASE WHEN n.status = 'completed' THEN n.total_rungs ELSE 0 END),
           sum(o.reserved_rungs - n.reserved_rungs)
      FROM settled_old o
      JOIN settled_new n ON n.batch_id = o.batch_id AND n.idx = o.idx
     WHERE (o.status IN ('queued', 'in_progress') AND n.status IN ('completed', 'failed', 'cancelled'))
        OR n.reserved_rungs < o.reserved_rungs
     GROUP BY n.account_id, (n.queued_at AT TIME ZONE 'UTC')::date, n.project_id;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
CREATE TRIGGER batch_items_settle AFTER UPDATE ON batch_items
    REFERENCING OLD TABLE AS settled_old NEW TABLE AS settled_new
    FOR EACH STATEMENT EXECUTE FUNCTION settle_batch_items();

-- reconcile_settlements: as in 00004, over batch_settlements.
-- +goose StatementBegin
CREATE FUNCTION reconcile_settlements(p_max integer, p_skip uuid[], p_account uuid) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v     record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT array_agg(s.id) INTO v_ids FROM (
        SELECT s.id FROM batch_settlements s
         WHERE (p_account IS NULL OR s.account_id = p_account)
           AND NOT (s.account_id = ANY (coalesce(p_skip, '{}')))
         ORDER BY s.account_id, s.day, s.project_id
         LIMIT p_max
         FOR UPDATE SKIP LOCKED) s;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    FOR v IN SELECT s.account_id, s.day, sum(s.day_rungs) AS delta
               FROM batch_settlements s WHERE s.id = ANY (v_ids)
              GROUP BY s.account_id, s.day ORDER BY s.account_id, s.day
    LOOP
        INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (v.account_id, v.day, v.delta)
        ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    END LOOP;
    FOR v IN SELECT s.project_id, sum(s.reserved_rungs) AS reserved, sum(s.spent_rungs) AS spent
               FROM batch_settlements s WHERE s.id = ANY (v_ids)
              GROUP BY s.project_id ORDER BY s.project_id
    LOOP
        UPDATE projects SET reserved_rungs = reserved_rungs - v.reserved, spent_rungs = spent_rungs + v.spent
         WHERE id = v.project_id;
    END LOOP;
    DELETE FROM batch_settlements s WHERE s.id = ANY (v_ids);
    RETURN cardinality(v_ids);
END;
$$;
-- +goose StatementEnd

-- claim_batch_items: as in 00010, with two changes. An item of a capped
-- project holds its reservation itself (reserved_rungs), and failing items
-- settle by the trigger. Each account's scan of the claim index starts at its
-- oldest open batch (queued or in progress: the only batches with claimable
-- items; an item's queued_at is its batch's created_at) instead of at the
-- account's first entry, and the accounts with work are found from the open
-- batches, not by walking the index account by account: the entries of items
-- claimed in finished batches, which stay in the index until a vacuum, are no
-- longer read by every claim.
CREATE INDEX batches_drainable_idx ON batches (account_id, created_at) WHERE status IN ('queued', 'in_progress');
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid, p_models text[])
RETURNS TABLE (batch_id uuid, idx integer, account_id uuid, request jsonb, batch_status text, claimed boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v          record;
    v_batches  uuid[];
    v_indexes  integer[];
    v_project  uuid;
    v_estimate bigint;
    v_ok       boolean;
BEGIN
    WITH open_since AS (
        -- Where each account's queued items can start: its oldest open batch.
        SELECT b.account_id, min(b.created_at) AS since
          FROM batches b WHERE b.status IN ('queued', 'in_progress')
         GROUP BY b.account_id
    ), accounts_with_work AS (
        SELECT o.account_id, o.since FROM open_since o
         WHERE EXISTS (SELECT 1 FROM batch_items i
                        WHERE i.status = 'queued' AND i.account_id = o.account_id AND i.queued_at >= o.since
                          AND (p_models IS NULL OR i.model = ANY (p_models)))
    ), chosen AS (
        SELECT a.account_id, a.since, greatest(p_per_account, ceil(p_max::numeric / count(*) OVER ())::integer) AS share
          FROM accounts_with_work a
         ORDER BY (a.account_id <= p_pivot), a.account_id
         LIMIT p_max
    ), candidates AS (
        SELECT c.batch_id, c.idx FROM chosen ch
        CROSS JOIN LATERAL (
            SELECT i.batch_id, i.idx FROM batch_items i
             WHERE i.status = 'queued' AND i.account_id = ch.account_id AND i.queued_at >= ch.since
               AND i.expires_at > now()
               AND (p_models IS NULL OR i.model = ANY (p_models))
               AND EXISTS (SELECT 1 FROM batches b WHERE b.id = i.batch_id AND b.status IN ('queued', 'in_progress'))
             ORDER BY i.queued_at, i.batch_id, i.idx
             LIMIT ch.share
             FOR UPDATE OF i SKIP LOCKED
        ) c
        LIMIT p_max
    )
    SELECT array_agg(c.batch_id), array_agg(c.idx) INTO v_batches, v_indexes FROM candidates c;
    IF v_batches IS NULL THEN
        RETURN;
    END IF;

    -- Items of projects without a budget cap: nothing to reserve.
    RETURN QUERY
    WITH taken AS (
        UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
               lease_expires_at = now() + p_lease, started_at = now()
          FROM unnest(v_batches, v_indexes) AS c(batch_id, idx), projects p
         WHERE i.batch_id = c.batch_id AND i.idx = c.idx AND i.status = 'queued'
           AND p.id = i.project_id AND p.budget_cap_rungs IS NULL
        RETURNING i.batch_id, i.idx, i.account_id, i.request
    )
    SELECT c.batch_id, c.idx, c.account_id, c.request, b.status, true
      FROM taken c JOIN batches b ON b.id = c.batch_id;

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
          FROM batch_items i WHERE i.batch_id = v.batch_id AND i.idx = v.idx AND i.status = 'queued';
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
                 WHERE i.batch_id = v.batch_id AND (i.idx = v.idx OR i.status = 'queued')
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


-- complete_batch_items: as in 00009; the trigger settles what completes.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION complete_batch_items(p_owner uuid, p_results jsonb)
RETURNS TABLE (batch_id uuid, idx integer) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH r AS (
        SELECT * FROM jsonb_to_recordset(p_results) AS x(
            batch_id uuid, idx integer, status text, content text,
            input_tokens bigint, output_tokens bigint, input_rungs bigint, output_rungs bigint, total_rungs bigint,
            error_code text, error_message text, sources jsonb, verdict text, evidence_expires_at timestamptz,
            provider text, upstream_model text, attempts smallint)
    ), applied AS (
        UPDATE batch_items i SET status = r.status, content = r.content,
               input_rungs = coalesce(r.input_rungs, 0), output_rungs = coalesce(r.output_rungs, 0),
               total_rungs = coalesce(r.total_rungs, 0),
               error_code = r.error_code, error_message = r.error_message,
               provider = r.provider, upstream_model = r.upstream_model, attempts = r.attempts,
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL, reserved_rungs = 0
          FROM r
         WHERE i.batch_id = r.batch_id AND i.idx = r.idx AND i.status = 'in_progress' AND i.lease_owner = p_owner
        RETURNING i.batch_id, i.idx, i.request_id, i.account_id, i.project_id, i.api_key_id, i.model, i.started_at,
                  r.status, r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs,
                  r.sources, r.verdict, r.evidence_expires_at
    ), requests_stored AS (
        INSERT INTO requests (
            id, account_id, project_id, api_key_id, model, entry_point, status,
            input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
        SELECT a.request_id, a.account_id, a.project_id, a.api_key_id, a.model, 'batch', 'completed',
               a.input_tokens, a.output_tokens, a.input_rungs, a.output_rungs, a.total_rungs, a.started_at, now()
          FROM applied a WHERE a.status = 'completed'
    ), evidence_stored AS (
        INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
        SELECT a.request_id, a.account_id, coalesce(a.sources, '[]'::jsonb), a.verdict, a.evidence_expires_at
          FROM applied a WHERE a.status = 'completed'
    )
    SELECT a.batch_id, a.idx FROM applied a;
END;
$$;
-- +goose StatementEnd


-- requeue_batch_items: as in 00004; an item put back in the queue or cancelled
-- gives its reservation back through the trigger.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION requeue_batch_items(p_owner uuid, p_batch_ids uuid[], p_idxs integer[], p_claim_id uuid)
RETURNS TABLE (batch_id uuid, idx integer, status text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH mine AS (
        SELECT i.batch_id, i.idx, b.status IN ('queued', 'in_progress') AS requeue,
               CASE WHEN b.status = 'expired' THEN 'expiry' ELSE 'owner' END AS reason
          FROM batch_items i JOIN batches b ON b.id = i.batch_id
         WHERE i.status = 'in_progress' AND i.lease_owner = p_owner
           AND ((i.batch_id, i.idx) IN (SELECT k.batch_id, k.idx FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx))
                OR (p_claim_id IS NOT NULL AND i.claim_id = p_claim_id))
         ORDER BY i.batch_id, i.idx
         FOR UPDATE OF i
    )
    UPDATE batch_items i
       SET status = CASE WHEN m.requeue THEN 'queued' ELSE 'cancelled' END,
           lease_owner = NULL, lease_expires_at = NULL, reserved_rungs = 0,
           started_at = CASE WHEN m.requeue THEN NULL ELSE i.started_at END,
           claim_id = CASE WHEN m.requeue THEN NULL ELSE i.claim_id END,
           cancel_reason = CASE WHEN m.requeue THEN NULL ELSE m.reason END,
           completed_at = CASE WHEN m.requeue THEN NULL ELSE now() END
      FROM mine m
     WHERE i.batch_id = m.batch_id AND i.idx = m.idx
    RETURNING i.batch_id, i.idx, i.status;
END;
$$;
-- +goose StatementEnd

-- rescue_expired_leases: as in 00003; the trigger gives back what the
-- interrupted items held.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION rescue_expired_leases(p_max integer)
RETURNS TABLE (batch_id uuid) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH rescued AS (
        UPDATE batch_items i SET status = 'failed', error_code = 'INTERRUPTED',
               error_message = 'the item was interrupted by a platform restart and is not retried',
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL, reserved_rungs = 0
         WHERE (i.batch_id, i.idx) IN (
            SELECT x.batch_id, x.idx FROM batch_items x
             WHERE x.status = 'in_progress' AND x.lease_expires_at < now()
             ORDER BY x.lease_expires_at
             LIMIT p_max
             FOR UPDATE SKIP LOCKED)
        RETURNING i.batch_id
    )
    SELECT DISTINCT rescued.batch_id FROM rescued;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00006.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00011 cannot be reverted'; END $$;
-- +goose StatementEnd
