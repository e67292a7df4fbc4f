-- +goose Up
CREATE TABLE batches (
    id              uuid PRIMARY KEY,
    account_id      uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    project_id      uuid NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    status          text NOT NULL CHECK (status IN ('queued', 'in_progress', 'cancelling', 'completed', 'failed', 'cancelled', 'expired')),
    total_requests  integer NOT NULL CHECK (total_requests BETWEEN 1 AND 100),
    -- Idempotency-Key of the create, cleared once the completion window passed.
    idempotency_key text,
    -- SHA-256 of the canonical request body, to tell a replay from a reuse.
    request_hash    bytea NOT NULL,
    error_code      text,
    error_message   text,
    created_at      timestamptz NOT NULL,
    started_at      timestamptz,
    completed_at    timestamptz,
    expires_at      timestamptz NOT NULL
);
CREATE UNIQUE INDEX batches_idempotency_idx ON batches (account_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX batches_account_created_idx ON batches (account_id, created_at DESC);
CREATE INDEX batches_open_expires_idx ON batches (expires_at) WHERE status IN ('queued', 'in_progress', 'cancelling');
CREATE INDEX batches_completed_idx ON batches (completed_at) WHERE completed_at IS NOT NULL;
CREATE INDEX batches_idempotency_created_idx ON batches (created_at) WHERE idempotency_key IS NOT NULL;

-- The items are the queue: claimed with FOR UPDATE SKIP LOCKED, leased to a
-- replica while they run, committed one by one.
CREATE TABLE batch_items (
    batch_id         uuid NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    idx              integer NOT NULL CHECK (idx BETWEEN 0 AND 99),
    account_id       uuid NOT NULL,
    project_id       uuid NOT NULL,
    api_key_id       uuid NOT NULL,
    -- Assigned at creation: the id of the item's reservation and, once it
    -- completes, of its request (usable with the sources endpoint).
    request_id       uuid NOT NULL UNIQUE,
    status           text NOT NULL CHECK (status IN ('queued', 'in_progress', 'completed', 'failed', 'cancelled')),
    -- The validated request (prompt, model, output ceiling, hints).
    request          jsonb NOT NULL,
    model            text NOT NULL,
    estimate_rungs   bigint NOT NULL CHECK (estimate_rungs >= 0),
    -- Claim order within an account: oldest batch first.
    queued_at        timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    content          text,
    input_rungs      bigint NOT NULL DEFAULT 0,
    output_rungs     bigint NOT NULL DEFAULT 0,
    total_rungs      bigint NOT NULL DEFAULT 0,
    error_code       text,
    error_message    text,
    cancel_reason    text CHECK (cancel_reason IN ('owner', 'expiry')),
    lease_owner      uuid,
    lease_expires_at timestamptz,
    started_at       timestamptz,
    completed_at     timestamptz,
    PRIMARY KEY (batch_id, idx)
);
-- The claim reads only queued items, in claim order per account: finished
-- items never slow it down.
CREATE INDEX batch_items_claim_idx ON batch_items (account_id, queued_at, batch_id, idx) WHERE status = 'queued';
CREATE INDEX batch_items_lease_idx ON batch_items (lease_expires_at) WHERE status = 'in_progress';
CREATE INDEX batch_items_owner_idx ON batch_items (lease_owner) WHERE status = 'in_progress';

-- admit_batch charges a whole batch's estimate to the account's day, or
-- nothing. Part of the creation transaction, which commits durably.
-- +goose StatementBegin
CREATE FUNCTION admit_batch(p_account_id uuid, p_day date, p_default_ceiling bigint, p_estimate bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    RETURN charge_daily(p_account_id, p_day, p_default_ceiling, p_estimate);
END;
$$;
-- +goose StatementEnd

-- claim_batch_items claims up to p_max queued items for p_owner: fairly across
-- accounts (every account with queued work, from a rotating pivot, gets up to
-- p_per_account items, oldest batch first), skipping items other claimers hold,
-- leasing each for p_lease and reserving its estimate on a capped project
-- budget. An item the budget cannot cover fails with BUDGET_EXCEEDED together
-- with its batch's other queued items; it is returned with claimed = false.
-- +goose StatementBegin
CREATE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid)
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
             ORDER BY i.queued_at, i.batch_id, i.idx
             LIMIT p_per_account
             FOR UPDATE SKIP LOCKED
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
            UPDATE batch_items i SET status = 'in_progress', lease_owner = p_owner,
                   lease_expires_at = now() + p_lease, started_at = now()
             WHERE i.batch_id = v.batch_id AND i.idx = v.idx;
            claimed := true;
        ELSE
            -- This item and every item of the batch not yet started fail; their
            -- estimates go back to the day through the reconciler. Items another
            -- claimer holds are skipped: it meets the same cap itself.
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

-- complete_batch_items commits the outcomes of leased items in one transaction
-- (a batch completer): each item's result, and for a completed item its request
-- and evidence; its actual cost settles its reservation (0 for a failed item).
-- An item no longer leased to p_owner (its lease ran out and it was rescued) is
-- skipped: a zombie's late write is refused. Returns the items applied.
-- +goose StatementBegin
CREATE FUNCTION complete_batch_items(p_owner uuid, p_results jsonb)
RETURNS TABLE (batch_id uuid, idx integer) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r      record;
    v_item record;
BEGIN
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_results) AS x(
            batch_id uuid, idx integer, status text, content text,
            input_tokens bigint, output_tokens bigint, input_rungs bigint, output_rungs bigint, total_rungs bigint,
            error_code text, error_message text, sources jsonb, verdict text, evidence_expires_at timestamptz)
        ORDER BY x.batch_id, x.idx
    LOOP
        UPDATE batch_items i SET status = r.status, content = r.content,
               input_rungs = coalesce(r.input_rungs, 0), output_rungs = coalesce(r.output_rungs, 0),
               total_rungs = coalesce(r.total_rungs, 0),
               error_code = r.error_code, error_message = r.error_message,
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL
         WHERE i.batch_id = r.batch_id AND i.idx = r.idx AND i.status = 'in_progress' AND i.lease_owner = p_owner
        RETURNING i.request_id, i.account_id, i.project_id, i.api_key_id, i.model, i.started_at INTO v_item;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        IF r.status = 'completed' THEN
            INSERT INTO requests (
                id, account_id, project_id, api_key_id, model, entry_point, status,
                input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at
            ) VALUES (
                v_item.request_id, v_item.account_id, v_item.project_id, v_item.api_key_id, v_item.model, 'batch', 'completed',
                r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs, v_item.started_at, now()
            );
            INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
            VALUES (v_item.request_id, v_item.account_id, coalesce(r.sources, '[]'::jsonb), r.verdict, r.evidence_expires_at);
            UPDATE reservations SET settled_rungs = r.total_rungs WHERE request_id = v_item.request_id;
        ELSE
            UPDATE reservations SET settled_rungs = 0 WHERE request_id = v_item.request_id AND settled_rungs IS NULL;
        END IF;
        batch_id := r.batch_id;
        idx := r.idx;
        RETURN NEXT;
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- requeue_batch_items hands leased items back to the queue unbilled (the
-- upstream was unavailable, or the replica is shutting down before dispatching
-- them), returning their budget reservations.
-- +goose StatementBegin
CREATE FUNCTION requeue_batch_items(p_owner uuid, p_batch_ids uuid[], p_idxs integer[])
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v   record;
    v_n bigint := 0;
BEGIN
    FOR v IN
        UPDATE batch_items i SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, started_at = NULL
          FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx)
         WHERE i.batch_id = k.batch_id AND i.idx = k.idx AND i.status = 'in_progress' AND i.lease_owner = p_owner
        RETURNING i.request_id, i.project_id
    LOOP
        UPDATE projects p SET reserved_rungs = p.reserved_rungs - r.reserved_rungs
          FROM reservations r WHERE r.request_id = v.request_id AND p.id = v.project_id AND r.reserved_rungs > 0;
        UPDATE reservations SET reserved_rungs = 0 WHERE request_id = v.request_id;
        v_n := v_n + 1;
    END LOOP;
    RETURN v_n;
END;
$$;
-- +goose StatementEnd

-- rescue_expired_leases fails items whose lease ran out (the replica running
-- them died) with INTERRUPTED; they are never run again. Their reservations are
-- released. Returns the batches touched, to be finalized.
-- +goose StatementBegin
CREATE FUNCTION rescue_expired_leases(p_max integer)
RETURNS TABLE (batch_id uuid) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH rescued AS (
        UPDATE batch_items i SET status = 'failed', error_code = 'INTERRUPTED',
               error_message = 'the item was interrupted by a platform restart and is not retried',
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL
         WHERE (i.batch_id, i.idx) IN (
            SELECT x.batch_id, x.idx FROM batch_items x
             WHERE x.status = 'in_progress' AND x.lease_expires_at < now()
             ORDER BY x.lease_expires_at
             LIMIT p_max
             FOR UPDATE SKIP LOCKED)
        RETURNING i.batch_id, i.request_id
    ), released AS (
        UPDATE reservations r SET settled_rungs = 0
          FROM rescued WHERE r.request_id = rescued.request_id AND r.settled_rungs IS NULL
    )
    SELECT DISTINCT rescued.batch_id FROM rescued;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION rescue_expired_leases(integer);
DROP FUNCTION requeue_batch_items(uuid, uuid[], integer[]);
DROP FUNCTION complete_batch_items(uuid, jsonb);
DROP FUNCTION claim_batch_items(uuid, integer, integer, interval, uuid);
DROP FUNCTION admit_batch(uuid, date, bigint, bigint);
DROP TABLE batch_items;
DROP TABLE batches;
