-- +goose Up
-- Several upstream targets per model: a batch item records the provider and
-- upstream model that ran it and how many targets were tried, and the claim
-- takes only items of the models given (those with a target taking calls), so
-- an outage of one model's targets leaves the other models draining.
ALTER TABLE batch_items
    ADD COLUMN provider       text,
    ADD COLUMN upstream_model text,
    ADD COLUMN attempts       smallint;

-- claim_batch_items: as in 00004, but only items whose model is in p_models
-- (every model when it is NULL).
-- +goose StatementBegin
DROP FUNCTION claim_batch_items(uuid, integer, integer, interval, uuid, uuid);
CREATE FUNCTION claim_batch_items(p_owner uuid, p_max integer, p_per_account integer, p_lease interval, p_pivot uuid, p_claim_id uuid, p_models text[])
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
            (SELECT i.account_id FROM batch_items i
              WHERE i.status = 'queued' AND (p_models IS NULL OR i.model = ANY (p_models))
              ORDER BY i.account_id LIMIT 1)
            UNION ALL
            SELECT (SELECT i.account_id FROM batch_items i
                     WHERE i.status = 'queued' AND i.account_id > a.account_id
                       AND (p_models IS NULL OR i.model = ANY (p_models))
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
               AND (p_models IS NULL OR i.model = ANY (p_models))
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

-- complete_batch_items: as in 00008, also storing the route of each outcome.
-- +goose StatementBegin
DROP FUNCTION complete_batch_items(uuid, jsonb);
CREATE FUNCTION complete_batch_items(p_owner uuid, p_results jsonb)
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
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL
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
    ), settled AS (
        UPDATE reservations rv
           SET settled_rungs = CASE WHEN a.status = 'completed' THEN a.total_rungs ELSE 0 END
          FROM applied a
         WHERE rv.request_id = a.request_id AND (a.status = 'completed' OR rv.settled_rungs IS NULL)
    )
    SELECT a.batch_id, a.idx FROM applied a;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00006.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00009 cannot be reverted'; END $$;
-- +goose StatementEnd
