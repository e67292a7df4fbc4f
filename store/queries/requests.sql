-- name: GetEvidence :one
-- Evidence of one request of the account, while it is held.
SELECT request_id, sources, verdict
FROM evidence
WHERE request_id = @request_id AND account_id = @account_id AND expires_at > now();

-- name: DeleteExpiredEvidence :execrows
-- Removes up to @max_rows evidence rows past retention.
DELETE FROM evidence
WHERE request_id IN (
    SELECT e.request_id FROM evidence e WHERE e.expires_at <= now() ORDER BY e.expires_at LIMIT @max_rows
);
