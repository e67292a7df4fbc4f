-- name: RecordRequest :exec
-- Commits a request's usage and its evidence in one statement.
WITH req AS (
    INSERT INTO requests (
        id, account_id, project_id, api_key_id, model, entry_point, status,
        input_tokens, output_tokens, input_rungs, output_rungs, total_rungs,
        created_at, completed_at
    ) VALUES (
        @id, @account_id, @project_id, @api_key_id, @model, @entry_point, @status,
        @input_tokens, @output_tokens, @input_rungs, @output_rungs, @total_rungs,
        @created_at, @completed_at
    )
    RETURNING id, account_id
)
INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
SELECT req.id, req.account_id, @sources, sqlc.narg(verdict), @evidence_expires_at
FROM req;

-- name: GetEvidence :one
-- Evidence of one request of the account, while it is held.
SELECT request_id, sources, verdict
FROM evidence
WHERE request_id = @request_id AND account_id = @account_id AND expires_at > now();
