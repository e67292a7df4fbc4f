-- +goose Up
-- complete_batch_items as in 00031, with the outcomes as one array a column,
-- sent in binary, as a settlement of requests sends its group (migration
-- 00032's statement): the replica no longer encodes a group as one JSON
-- document (by reflection, escaping every item's output), and PostgreSQL no
-- longer parses it and takes it apart twice, field by field; only each
-- item's sources are JSON. An empty text (content, error, verdict, route)
-- is stored as NULL and attempts of 0 as NULL, as the JSON document left
-- them out. A signature of its own, beside the old one, which replicas of
-- the previous release call during a rolling upgrade (a later release drops
-- it, as 00038 did others).
-- +goose StatementBegin
CREATE FUNCTION complete_batch_items(
    p_owner uuid, p_batch_ids uuid[], p_idxs integer[], p_statuses text[], p_contents text[],
    p_input_tokens bigint[], p_output_tokens bigint[], p_input_rungs bigint[], p_output_rungs bigint[],
    p_total_rungs bigint[], p_error_codes text[], p_error_messages text[], p_sources jsonb[], p_verdicts text[],
    p_evidence_expires_ats timestamptz[], p_providers text[], p_upstream_models text[], p_attempts smallint[])
RETURNS TABLE (batch_id uuid, idx integer) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH r AS (
        SELECT * FROM unnest(p_batch_ids, p_idxs, p_statuses, p_contents, p_input_tokens, p_output_tokens,
                             p_input_rungs, p_output_rungs, p_total_rungs, p_error_codes, p_error_messages,
                             p_sources, p_verdicts, p_evidence_expires_ats, p_providers, p_upstream_models, p_attempts)
            AS x(batch_id, idx, status, content, input_tokens, output_tokens, input_rungs, output_rungs, total_rungs,
                 error_code, error_message, sources, verdict, evidence_expires_at, provider, upstream_model, attempts)
    ), applied AS (
        -- The keys as arrays unnested on their own, as in 00016: the planner
        -- expects them to hold ten elements, so it finds the items by
        -- primary key instead of scanning for them.
        UPDATE batch_items i SET status = r.status, content = nullif(r.content, ''),
               input_rungs = r.input_rungs, output_rungs = r.output_rungs, total_rungs = r.total_rungs,
               error_code = nullif(r.error_code, ''), error_message = nullif(r.error_message, ''),
               provider = nullif(r.provider, ''), upstream_model = nullif(r.upstream_model, ''),
               attempts = nullif(r.attempts, 0),
               completed_at = now(), lease_owner = NULL, lease_expires_at = NULL, reserved_rungs = 0
          FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx), r
         WHERE i.batch_id = k.batch_id AND i.idx = k.idx AND r.batch_id = k.batch_id AND r.idx = k.idx
           AND i.status = 'in_progress'
           AND i.lease_owner IS NOT DISTINCT FROM p_owner -- no index condition: see 00016
        RETURNING i.batch_id, i.idx, i.request_id, i.account_id, i.project_id, i.api_key_id, i.model, i.started_at,
                  r.status, r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs,
                  r.sources, nullif(r.verdict, '') AS verdict, r.evidence_expires_at
    ), requests_stored AS (
        INSERT INTO requests (
            id, account_id, project_id, api_key_id, model, entry_point, status,
            input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at,
            empty_evidence_expires_at)
        SELECT a.request_id, a.account_id, a.project_id, a.api_key_id, a.model, 'batch', 'completed',
               a.input_tokens, a.output_tokens, a.input_rungs, a.output_rungs, a.total_rungs, a.started_at, now(),
               CASE WHEN coalesce(a.sources, '[]'::jsonb) = '[]'::jsonb AND a.verdict IS NULL
                    THEN a.evidence_expires_at END
          FROM applied a WHERE a.status = 'completed'
    ), evidence_stored AS (
        INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
        SELECT a.request_id, a.account_id, coalesce(a.sources, '[]'::jsonb), a.verdict, a.evidence_expires_at
          FROM applied a WHERE a.status = 'completed'
           AND (coalesce(a.sources, '[]'::jsonb) <> '[]'::jsonb OR a.verdict IS NOT NULL)
    )
    SELECT a.batch_id, a.idx FROM applied a;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION complete_batch_items(uuid, uuid[], integer[], text[], text[], bigint[], bigint[], bigint[], bigint[],
    bigint[], text[], text[], jsonb[], text[], timestamptz[], text[], text[], smallint[]);
