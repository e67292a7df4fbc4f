-- +goose Up
-- complete_batch_items as PL/pgSQL: the same statement, but its plan is cached
-- for the session instead of made again on every call, as a SQL function's is
-- (planning the statement cost more than running it).
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
            error_code text, error_message text, sources jsonb, verdict text, evidence_expires_at timestamptz)
    ), applied AS (
        UPDATE batch_items i SET status = r.status, content = r.content,
               input_rungs = coalesce(r.input_rungs, 0), output_rungs = coalesce(r.output_rungs, 0),
               total_rungs = coalesce(r.total_rungs, 0),
               error_code = r.error_code, error_message = r.error_message,
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
DO $$ BEGIN RAISE EXCEPTION 'migration 00008 cannot be reverted'; END $$;
-- +goose StatementEnd
