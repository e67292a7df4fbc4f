-- +goose Up
-- Fault isolation and at-most-once dispatch (decisions D11, D12).

-- The claim an item was leased by: a replica that lost a claim's reply hands
-- that claim's items back, since it never dispatched them.
ALTER TABLE batch_items ADD COLUMN claim_id uuid;

-- charge_daily charges p_amount to an account's day if it stays within the
-- account's ceiling (its own, or p_default_ceiling), locking the account-day
-- row. Returns 'ok'; 'daily' when the charge does not fit today; 'daily_never'
-- when it is larger than the whole ceiling, so waiting cannot help.
-- +goose StatementBegin
DROP FUNCTION admit_batch(uuid, date, bigint, bigint);
DROP FUNCTION admit_request(uuid, uuid, uuid, date, bigint, bigint, timestamptz);
DROP FUNCTION charge_daily(uuid, date, bigint, bigint);
CREATE FUNCTION charge_daily(p_account_id uuid, p_day date, p_default_ceiling bigint, p_amount bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_ceiling bigint;
    v_charged bigint;
BEGIN
    SELECT coalesce(a.daily_rung_ceiling, p_default_ceiling) INTO v_ceiling FROM accounts a WHERE a.id = p_account_id;
    IF p_amount > v_ceiling THEN
        RETURN 'daily_never';
    END IF;
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (p_account_id, p_day, 0)
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs
    RETURNING d.charged_rungs INTO v_charged;
    IF v_charged > v_ceiling - p_amount THEN
        RETURN 'daily';
    END IF;
    UPDATE daily_charges SET charged_rungs = charged_rungs + p_amount WHERE account_id = p_account_id AND day = p_day;
    RETURN 'ok';
END;
$$;
-- +goose StatementEnd

-- admit_batch charges a whole batch's estimate to the account's day, or
-- nothing; the outcome is charge_daily's.
-- +goose StatementBegin
CREATE FUNCTION admit_batch(p_account_id uuid, p_day date, p_default_ceiling bigint, p_estimate bigint)
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    RETURN charge_daily(p_account_id, p_day, p_default_ceiling, p_estimate);
END;
$$;
-- +goose StatementEnd

-- admit_request: as in 00002, and it tells a refusal that waiting cannot cure:
-- 'ok', 'daily', 'daily_never', 'budget', or 'budget_never' (the estimate is
-- larger than the project's whole cap).
-- +goose StatementBegin
CREATE FUNCTION admit_request(
    p_request_id uuid, p_account_id uuid, p_project_id uuid, p_day date,
    p_default_ceiling bigint, p_estimate bigint, p_expires_at timestamptz
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_outcome  text;
    v_cap      bigint;
    v_spent    bigint;
    v_reserved bigint;
    v_reserve  bigint := 0;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT p.budget_cap_rungs INTO v_cap FROM projects p WHERE p.id = p_project_id;
    IF v_cap IS NOT NULL AND p_estimate > v_cap THEN
        RETURN 'budget_never';
    END IF;
    v_outcome := charge_daily(p_account_id, p_day, p_default_ceiling, p_estimate);
    IF v_outcome <> 'ok' THEN
        RETURN v_outcome;
    END IF;
    IF v_cap IS NOT NULL THEN
        SELECT p.budget_cap_rungs, p.spent_rungs, p.reserved_rungs INTO v_cap, v_spent, v_reserved
          FROM projects p WHERE p.id = p_project_id FOR NO KEY UPDATE;
        IF v_cap IS NOT NULL THEN
            IF v_spent + v_reserved > v_cap - p_estimate THEN
                UPDATE daily_charges SET charged_rungs = charged_rungs - p_estimate
                 WHERE account_id = p_account_id AND day = p_day;
                RETURN 'budget';
            END IF;
            v_reserve := p_estimate;
            UPDATE projects SET reserved_rungs = reserved_rungs + v_reserve WHERE id = p_project_id;
        END IF;
    END IF;
    INSERT INTO reservations (request_id, account_id, project_id, day, charged_rungs, reserved_rungs, expires_at)
    VALUES (p_request_id, p_account_id, p_project_id, p_day, p_estimate, v_reserve, p_expires_at);
    RETURN 'ok';
END;
$$;
-- +goose StatementEnd

-- claim_batch_items: as in 00003, but only items of batches still queued or in
-- progress are claimed (never those of a cancelling or terminal batch), and
-- each claimed item records p_claim_id.
-- +goose StatementBegin
DROP FUNCTION claim_batch_items(uuid, integer, integer, interval, uuid);
CREATE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid)
RETURNS TABLE (batch_id uuid, idx integer, account_id uuid, request jsonb, batch_status text, claimed boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v          record;
    v_request  uuid;
    v_project  uuid;
    v_estimate bigint;
    v_cap      bigint;
    v_ok       boolean;
BEGIN
    FOR v IN
        WITH RECURSIVE accounts_with_work(account_id) AS (
            (SELECT i.account_id FROM batch_items i WHERE i.status = 'queued' ORDER BY i.account_id LIMIT 1)
            UNION ALL
            SELECT (SELECT i.account_id FROM batch_items i
                     WHERE i.status = 'queued' AND i.account_id > a.account_id
                     ORDER BY i.account_id LIMIT 1)
              FROM accounts_with_work a WHERE a.account_id IS NOT NULL
        ), chosen AS (
            SELECT a.account_id FROM accounts_with_work a
             WHERE a.account_id IS NOT NULL
             ORDER BY (a.account_id <= p_pivot), a.account_id
             LIMIT p_max
        )
        SELECT c.batch_id, c.idx FROM chosen ch
        CROSS JOIN LATERAL (
            SELECT i.batch_id, i.idx FROM batch_items i
             WHERE i.status = 'queued' AND i.account_id = ch.account_id AND i.expires_at > now()
               AND EXISTS (SELECT 1 FROM batches b WHERE b.id = i.batch_id AND b.status IN ('queued', 'in_progress'))
             ORDER BY i.queued_at, i.batch_id, i.idx
             LIMIT p_per_account
             FOR UPDATE OF i SKIP LOCKED
        ) c
        LIMIT p_max
    LOOP
        SELECT i.batch_id, i.idx, i.account_id, i.request, i.request_id, i.project_id, i.estimate_rungs
          INTO batch_id, idx, account_id, request, v_request, v_project, v_estimate
          FROM batch_items i WHERE i.batch_id = v.batch_id AND i.idx = v.idx AND i.status = 'queued';
        IF NOT FOUND THEN
            CONTINUE; -- failed meanwhile with an earlier candidate of its batch
        END IF;
        SELECT b.status INTO batch_status FROM batches b WHERE b.id = v.batch_id;

        v_ok := true;
        SELECT p.budget_cap_rungs INTO v_cap FROM projects p WHERE p.id = v_project;
        IF v_cap IS NOT NULL THEN
            SELECT p.budget_cap_rungs - p.spent_rungs - p.reserved_rungs >= v_estimate INTO v_ok
              FROM projects p WHERE p.id = v_project FOR NO KEY UPDATE;
            IF v_ok THEN
                UPDATE projects SET reserved_rungs = reserved_rungs + v_estimate WHERE id = v_project;
                UPDATE reservations SET reserved_rungs = v_estimate WHERE request_id = v_request;
            END IF;
        END IF;

        IF v_ok THEN
            UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner, claim_id = p_claim_id,
                   lease_expires_at = now() + p_lease, started_at = now()
             WHERE i.batch_id = v.batch_id AND i.idx = v.idx;
            claimed := true;
        ELSE
            WITH doomed AS (
                SELECT i.batch_id, i.idx, i.request_id FROM batch_items i
                 WHERE i.batch_id = v.batch_id AND (i.idx = v.idx OR i.status = 'queued')
                 FOR UPDATE SKIP LOCKED
            ), released AS (
                UPDATE reservations r SET settled_rungs = 0
                  FROM doomed d WHERE r.request_id = d.request_id AND r.settled_rungs IS NULL
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

-- requeue_batch_items hands items leased to p_owner back, unbilled, because
-- the upstream certainly never processed them: the given items, and every item
-- of claim p_claim_id (a claim whose reply was lost). An item of a batch that
-- is cancelling or terminal is not queued again but cancelled (a requeue
-- racing a cancel ends cancelled). Budget reservations are returned (a
-- cancelled item's charge too). Returns the items and where they went.
-- +goose StatementBegin
DROP FUNCTION requeue_batch_items(uuid, uuid[], integer[]);
CREATE FUNCTION requeue_batch_items(p_owner uuid, p_batch_ids uuid[], p_idxs integer[], p_claim_id uuid)
RETURNS TABLE (batch_id uuid, idx integer, status text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v record;
BEGIN
    FOR v IN
        SELECT i.batch_id, i.idx, b.status AS batch_status
          FROM batch_items i JOIN batches b ON b.id = i.batch_id
         WHERE i.status = 'in_progress' AND i.lease_owner = p_owner
           AND ((i.batch_id, i.idx) IN (SELECT k.batch_id, k.idx FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx))
                OR (p_claim_id IS NOT NULL AND i.claim_id = p_claim_id))
         ORDER BY i.batch_id, i.idx
         FOR UPDATE OF i
    LOOP
        UPDATE projects p SET reserved_rungs = p.reserved_rungs - r.reserved_rungs
          FROM reservations r, batch_items i
         WHERE i.batch_id = v.batch_id AND i.idx = v.idx AND r.request_id = i.request_id
           AND p.id = i.project_id AND r.reserved_rungs > 0;
        UPDATE reservations r SET reserved_rungs = 0
          FROM batch_items i WHERE i.batch_id = v.batch_id AND i.idx = v.idx AND r.request_id = i.request_id;
        IF v.batch_status IN ('queued', 'in_progress') THEN
            UPDATE batch_items i SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
                   started_at = NULL, claim_id = NULL
             WHERE i.batch_id = v.batch_id AND i.idx = v.idx;
            status := 'queued';
        ELSE
            UPDATE batch_items i SET status = 'cancelled', lease_owner = NULL, lease_expires_at = NULL,
                   cancel_reason = CASE WHEN v.batch_status = 'expired' THEN 'expiry' ELSE 'owner' END,
                   completed_at = now()
             WHERE i.batch_id = v.batch_id AND i.idx = v.idx;
            UPDATE reservations r SET settled_rungs = 0
              FROM batch_items i WHERE i.batch_id = v.batch_id AND i.idx = v.idx
               AND r.request_id = i.request_id AND r.settled_rungs IS NULL;
            status := 'cancelled';
        END IF;
        batch_id := v.batch_id;
        idx := v.idx;
        RETURN NEXT;
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- reconcile_settlements: as in 00002, restricted to one account when
-- p_account is set and never touching the accounts in p_skip, so that the
-- caller can fold account by account and set aside one whose rows fail.
-- +goose StatementBegin
DROP FUNCTION reconcile_settlements(integer);
CREATE FUNCTION reconcile_settlements(p_max integer, p_skip uuid[], p_account uuid) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_ids uuid[];
    v     record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT array_agg(s.request_id) INTO v_ids FROM (
        SELECT r.request_id FROM reservations r
         WHERE r.settled_rungs IS NOT NULL
           AND (p_account IS NULL OR r.account_id = p_account)
           AND NOT (r.account_id = ANY (coalesce(p_skip, '{}')))
         ORDER BY r.account_id, r.day, r.project_id
         LIMIT p_max
         FOR UPDATE SKIP LOCKED) s;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    FOR v IN SELECT r.account_id, r.day, sum(r.settled_rungs - r.charged_rungs) AS delta
               FROM reservations r WHERE r.request_id = ANY (v_ids)
              GROUP BY r.account_id, r.day ORDER BY r.account_id, r.day
    LOOP
        INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (v.account_id, v.day, v.delta)
        ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    END LOOP;
    FOR v IN SELECT r.project_id, sum(r.reserved_rungs) AS reserved, sum(r.settled_rungs) AS spent
               FROM reservations r WHERE r.request_id = ANY (v_ids)
              GROUP BY r.project_id ORDER BY r.project_id
    LOOP
        UPDATE projects SET reserved_rungs = reserved_rungs - v.reserved, spent_rungs = spent_rungs + v.spent
         WHERE id = v.project_id;
    END LOOP;
    DELETE FROM reservations r WHERE r.request_id = ANY (v_ids);
    RETURN cardinality(v_ids);
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only: 00004 replaces functions whose old bodies 00002 and 00003 hold;
-- restore a backup to go back.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00004 cannot be reverted'; END $$;
-- +goose StatementEnd
