-- name: GetEvidence :one
-- Evidence of one request of the account, while it is held: its row of
-- evidence, or, for a request whose evidence is empty (no sources, no
-- verdict; migration 00031), its row of requests.
SELECT e.request_id, e.sources, e.verdict
FROM evidence e
WHERE e.request_id = @request_id AND e.account_id = @account_id AND e.expires_at > now()
UNION ALL
SELECT r.id, '[]'::jsonb, NULL::text
FROM requests r
WHERE r.id = @request_id AND r.account_id = @account_id AND r.empty_evidence_expires_at > now()
LIMIT 1;

-- name: DeleteExpiredEvidence :execrows
-- Removes up to @max_rows evidence rows past retention.
DELETE FROM evidence
WHERE request_id IN (
    SELECT e.request_id FROM evidence e WHERE e.expires_at <= now() ORDER BY e.expires_at LIMIT @max_rows
);
