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

-- name: DeleteExpiredEvidence :one
-- Removes up to @max_rows evidence rows past retention, the earliest expiry
-- first from @expired_from on, and returns how many and where the next run
-- reads from: the last expiry removed, or, when fewer than @max_rows were
-- left, now (none before it is left). Not from the start, through the index
-- entries of the rows removed, which stay until a vacuum.
WITH removed AS (
    DELETE FROM evidence
     WHERE request_id = ANY (ARRAY(
            SELECT e.request_id FROM evidence e
             WHERE e.expires_at <= now() AND e.expires_at >= @expired_from
             ORDER BY e.expires_at
             LIMIT @max_rows))
       AND expires_at <= now()
    RETURNING expires_at
)
SELECT count(*)::bigint AS removed,
       (CASE WHEN count(*) < @max_rows THEN now() ELSE max(expires_at) END)::timestamptz AS read_from
  FROM removed;
