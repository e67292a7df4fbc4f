-- +goose Up
-- Evidence rows only for requests that have evidence. Most requests have no
-- sources and no verdict, and each still wrote an evidence row ('[]') with its
-- two index entries, deleted again by maintenance once its retention ended:
-- a third of a settlement's rows, and at a steady rate of requests as many
-- deletions as insertions. A request whose evidence is empty now notes how
-- long that (empty) evidence is held in its own row instead, in
-- empty_evidence_expires_at; the read of a request's evidence (GetEvidence)
-- answers from either. NULL is what every request stored before this
-- migration, and what a replica of the previous release still stores while
-- the release rolls out, holds: its evidence, if any, is a row of evidence.
ALTER TABLE requests ADD COLUMN empty_evidence_expires_at timestamptz;

-- The completion of batch items (as in 00016) stores the evidence of a
-- completed item the same way: empty when it has no sources (none, or an
-- empty list) and no verdict.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION complete_batch_items(p_owner uuid, p_results jsonb)
RETURNS TABLE (batch_id uuid, idx integer) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_batches uuid[];
    v_indexes integer[];
BEGIN
    -- The keys of the outcomes as arrays: the planner expects an array
    -- unnested to hold ten elements (a set-returning function, 100 rows),
    -- so it finds the items by primary key instead of scanning for them.
    SELECT array_agg(x.batch_id), array_agg(x.idx) INTO v_batches, v_indexes
      FROM jsonb_to_recordset(p_results) AS x(batch_id uuid, idx integer);
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
          FROM unnest(v_batches, v_indexes) AS k(batch_id, idx), r
         WHERE i.batch_id = k.batch_id AND i.idx = k.idx AND r.batch_id = k.batch_id AND r.idx = k.idx
           AND i.status = 'in_progress'
           AND i.lease_owner IS NOT DISTINCT FROM p_owner -- no index condition: see above
        RETURNING i.batch_id, i.idx, i.request_id, i.account_id, i.project_id, i.api_key_id, i.model, i.started_at,
                  r.status, r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs,
                  r.sources, r.verdict, r.evidence_expires_at
    ), requests_stored AS (
        INSERT INTO requests (
            id, account_id, project_id, api_key_id, model, entry_point, status,
            input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at,
            empty_evidence_expires_at)
        SELECT a.request_id, a.account_id, a.project_id, a.api_key_id, a.model, 'batch', 'completed',
               a.input_tokens, a.output_tokens, a.input_rungs, a.output_rungs, a.total_rungs, a.started_at, now(),
               CASE WHEN coalesce(a.sources, '[]'::jsonb) = '[]'::jsonb AND coalesce(a.verdict, '') = ''
                    THEN a.evidence_expires_at END
          FROM applied a WHERE a.status = 'completed'
    ), evidence_stored AS (
        INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
        SELECT a.request_id, a.account_id, coalesce(a.sources, '[]'::jsonb), a.verdict, a.evidence_expires_at
          FROM applied a WHERE a.status = 'completed' 
           AND (coalesce(a.sources, '[]'::jsonb) <> '[]'::jsonb OR coalesce(a.verdict, '') <> '')
    )
    SELECT a.batch_id, a.idx FROM applied a;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00016: requests stored since hold their empty evidence
-- in the column alone.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00031 cannot be reverted'; END $$;
-- +goose StatementEnd
