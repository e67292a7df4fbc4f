-- name: LookupKey :one
-- The principal of an active key (prefix and hash), with when it expires; no
-- row: unknown, revoked or expired.
SELECT k.id AS key_id, k.scopes, k.expires_at, p.id AS project_id, p.name AS project_name,
       a.id AS account_id, a.name AS account_name, a.tier
FROM api_keys k
JOIN projects p ON p.id = k.project_id
JOIN accounts a ON a.id = p.account_id
WHERE k.prefix = @prefix AND k.hash = @hash AND k.revoked_at IS NULL
  AND (k.expires_at IS NULL OR k.expires_at > now());

-- name: ListenPrincipals :exec
LISTEN gateway_principals;

-- name: LeaseRate :one
SELECT l.granted::integer AS granted, l.used::double precision AS used,
       l.previous_count::integer AS previous_count, l.current_count::integer AS current_count
FROM lease_rate_counts(@key_id::uuid, @now::timestamptz, @rate_limit::integer, @share::integer) AS l;

-- name: LeaseRateAhead :one
-- A slice of the minute starting at @window_start, leased before it starts: what
-- the limit leaves after the minute before it and its own count, as the
-- sliding window weighs them at its start.
SELECT l.granted::integer AS granted, l.used::double precision AS used,
       l.previous_count::integer AS previous_count, l.current_count::integer AS current_count
FROM lease_rate_ahead(@key_id::uuid, @window_start::timestamptz, @rate_limit::integer, @share::integer) AS l;

-- name: ReturnRate :exec
SELECT return_rate(@key_ids::uuid[], @windows::timestamptz[], @counts::integer[]);

-- name: GrantQuota :one
-- The lease runs out a lease after now(), by the clock of the database, which
-- the folds of expired leases read: the clocks of replicas are never compared.
SELECT g.outcome::text AS outcome, g.daily_granted::bigint AS daily_granted, g.budget_granted::bigint AS budget_granted,
       coalesce(g.capped, false)::boolean AS capped, g.ceiling::bigint AS ceiling, g.daily_left::bigint AS daily_left,
       coalesce(g.cap, 0)::bigint AS cap, coalesce(g.budget_left, 0)::bigint AS budget_left
FROM grant_quota(@id::uuid, @owner::uuid, @account_id::uuid, @project_id::uuid, @day::date,
                 @default_ceiling::bigint, @need::bigint, @share::integer,
                 now() + @lease::interval) AS g;

-- name: FoldQuotaLeases :one
SELECT fold_quota_leases(@owner::uuid, @ids::uuid[], @expired::integer, @skip::uuid[])::bigint AS folded;

-- name: ExpiredQuotaLeases :many
-- Leases whose time ran out, apart from @skip.
SELECT q.id, q.owner FROM quota_leases q
WHERE q.expires_at < now() AND NOT (q.id = ANY (@skip::uuid[]))
ORDER BY q.expires_at
LIMIT @max_rows;

-- name: RenewQuotaLeases :many
-- As GrantQuota, by the clock of the database.
SELECT renew_quota_leases(@owner::uuid, @ids::uuid[], now() + @lease::interval)::uuid AS id;

-- name: LockQuotaLeases :exec
-- Locks the quota leases named, in key order: a locking SELECT sorts before
-- it locks. Sent before a settlement group that charges two leases or more,
-- in the group's transaction, so that its update, which locks them in the
-- order of its plan (over few leases, a scan of the heap, whose order each
-- update changes), finds them locked: otherwise it could hold one and wait
-- for another that the replica's renewal of its leases (migration 00052,
-- key order) held while it waited for the first, and PostgreSQL failed one
-- of the two after a second. A group under one lease, the common case, is
-- sent alone: a statement that waits for one row while holding none cannot
-- deadlock on it. Its own statement rather than a part of the settlement's,
-- which PostgreSQL set up at each execution, taking the lock or not: a
-- settlement under one lease costs it 25-60 µs less, one under two about 70
-- more (docs/benchmarks.md, "Settlements that lock their leases in key
-- order").
SELECT 1 FROM quota_leases WHERE id = ANY (@ids::uuid[]) ORDER BY id FOR NO KEY UPDATE;

-- name: SettleRequests :exec
-- Settles a group of finished requests (as the function settle_requests of
-- migration 00007 did, which 00038 dropped a release after this replaced it):
-- their usage and evidence, once each (a request settled already is left as
-- it is), and their cost on their quota leases, or, for a request whose lease
-- is gone, on its account-day and project directly. A prepared statement
-- rather than a function call: PostgreSQL runs it without a PL/pgSQL frame
-- and without materialising its result. The group comes as one array a
-- column, in binary, so nothing of it is parsed but each request's sources
-- (no sources are NULL, an empty verdict is none, a nil lease id no lease). A
-- request with neither sources nor verdict writes no evidence row: its row of
-- requests says until when its empty evidence is held (migration 00031). The
-- leases it charges are named by key (= ANY (ARRAY(...))): joined to the group
-- alone, which the planner takes for a hundred rows, they were read whole (2
-- ms a settlement at 20,000 leases). Named by the parameter @lease_ids, an
-- array the generic plan takes for ten, they made the generic plan look
-- dearer than a plan for the group's own leases, and every settlement was
-- planned again (TestSettlementKeepsItsPlan). The statement updates the
-- leases in the order of its plan (over few leases, a scan of the heap): a
-- group that charges two leases or more is sent after LockQuotaLeases, in
-- one transaction (see Store.SettleRequests). The requests charged directly
-- (no lease, or one gone) are charged by the function charge_directly
-- (migration 00032), called only when there are some: the statement does not
-- prepare that rarer work on every execution. Its result (nearly always no
-- row) is not read.
WITH u AS (
    SELECT unnest(@ids::uuid[]) AS id, unnest(@account_ids::uuid[]) AS account_id,
           unnest(@project_ids::uuid[]) AS project_id, unnest(@api_key_ids::uuid[]) AS api_key_id,
           unnest(@models::text[]) AS model, unnest(@entry_points::text[]) AS entry_point,
           unnest(@statuses::text[]) AS status, unnest(@input_tokens::bigint[]) AS input_tokens,
           unnest(@output_tokens::bigint[]) AS output_tokens, unnest(@input_rungs::bigint[]) AS input_rungs,
           unnest(@output_rungs::bigint[]) AS output_rungs, unnest(@total_rungs::bigint[]) AS total_rungs,
           unnest(@created_ats::timestamptz[]) AS created_at, unnest(@completed_ats::timestamptz[]) AS completed_at,
           unnest(@sources::jsonb[]) AS sources, unnest(@verdicts::text[]) AS verdict,
           unnest(@evidence_expires_ats::timestamptz[]) AS evidence_expires_at,
           unnest(@lease_ids::uuid[]) AS lease_id
), r AS (
    SELECT u.id, u.account_id, u.project_id, u.api_key_id, u.model, u.entry_point, u.status,
           u.input_tokens, u.output_tokens, u.input_rungs, u.output_rungs, u.total_rungs,
           u.created_at, u.completed_at, u.sources, nullif(u.verdict, '') AS verdict,
           u.evidence_expires_at, nullif(u.lease_id, '00000000-0000-0000-0000-000000000000'::uuid) AS lease_id,
           (u.created_at AT TIME ZONE 'UTC')::date AS day,
           coalesce(u.sources, '[]'::jsonb) = '[]'::jsonb AND u.verdict = '' AS empty_evidence
      FROM u
), stored AS (
    INSERT INTO requests (
        id, account_id, project_id, api_key_id, model, entry_point, status,
        input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at,
        empty_evidence_expires_at)
    SELECT r.id, r.account_id, r.project_id, r.api_key_id, r.model, r.entry_point, r.status,
           r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs, r.created_at, r.completed_at,
           CASE WHEN r.empty_evidence THEN r.evidence_expires_at END
      FROM r
    ON CONFLICT (id) DO NOTHING
    RETURNING requests.id
), ev AS (
    INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
    SELECT r.id, r.account_id, coalesce(r.sources, '[]'::jsonb), r.verdict, r.evidence_expires_at
      FROM r JOIN stored USING (id) WHERE NOT r.empty_evidence
), leased AS (
    UPDATE quota_leases q SET used_rungs = q.used_rungs + c.cost
      FROM (SELECT r.lease_id, sum(r.total_rungs) AS cost FROM r JOIN stored USING (id)
             WHERE r.lease_id IS NOT NULL GROUP BY r.lease_id) c
     WHERE q.id = c.lease_id AND q.id = ANY (ARRAY(SELECT r.lease_id FROM r))
    RETURNING q.id
), direct AS (
    SELECT r.account_id, r.day, r.project_id, r.total_rungs FROM r JOIN stored USING (id)
     WHERE r.lease_id IS NULL OR r.lease_id NOT IN (SELECT id FROM leased)
)
SELECT charge_directly(array_agg(account_id), array_agg(day), array_agg(project_id), array_agg(total_rungs))
  FROM direct HAVING count(*) > 0;

-- name: ReconcileSettlements :one
SELECT reconcile_settlements(@max_rows, @skip::uuid[], sqlc.narg(account_id)::uuid)::bigint AS reconciled;

-- name: SettledAccounts :many
-- Accounts with settlements to fold, apart from @skip.
SELECT DISTINCT s.account_id FROM batch_settlements s
WHERE NOT (s.account_id = ANY (@skip::uuid[]))
LIMIT @max_rows;

-- name: DeleteOldRateWindows :execrows
DELETE FROM rate_windows WHERE window_start < @before;

-- name: UsageByModel :many
-- Committed usage of an account in [@start, @end_time), per model: the
-- hours [@hour_lo, @hour_hi) whole inside the period from usage_hours with
-- the rows of their minutes not yet folded into them, the other minutes
-- [@lo, @hi) whole inside it from usage_minutes (migration 00039), and the
-- parts of a minute before @lo and from @hi from the requests themselves
-- (@start <= @lo <= @hour_lo <= @hour_hi <= @hi <= @end_time).
SELECT u.model,
       sum(u.requests)::bigint AS requests,
       sum(u.input_rungs)::bigint AS input_rungs,
       sum(u.output_rungs)::bigint AS output_rungs,
       sum(u.total_rungs)::bigint AS total_rungs
FROM (
    SELECT h.model, h.requests, h.input_rungs, h.output_rungs, h.total_rungs FROM usage_hours h
     WHERE h.account_id = @account_id AND h.hour >= @hour_lo AND h.hour < @hour_hi
    UNION ALL
    SELECT m.model, m.requests, m.input_rungs, m.output_rungs, m.total_rungs FROM usage_minutes m
     WHERE m.account_id = @account_id AND m.backend <> 0 AND m.minute >= @hour_lo AND m.minute < @hour_hi
    UNION ALL
    SELECT m.model, m.requests, m.input_rungs, m.output_rungs, m.total_rungs FROM usage_minutes m
     WHERE m.account_id = @account_id AND m.minute >= @lo AND m.minute < @hour_lo
    UNION ALL
    SELECT m.model, m.requests, m.input_rungs, m.output_rungs, m.total_rungs FROM usage_minutes m
     WHERE m.account_id = @account_id AND m.minute >= @hour_hi AND m.minute < @hi
    UNION ALL
    SELECT r.model, 1, r.input_rungs, r.output_rungs, r.total_rungs FROM requests r
     WHERE r.account_id = @account_id AND r.completed_at >= @start AND r.completed_at < @lo
    UNION ALL
    SELECT r.model, 1, r.input_rungs, r.output_rungs, r.total_rungs FROM requests r
     WHERE r.account_id = @account_id AND r.completed_at >= @hi AND r.completed_at < @end_time
) u
GROUP BY u.model
ORDER BY u.model;

-- name: FoldUsageMinutes :one
-- Folds up to @max_rows rows of usage_minutes of minutes before @before, each
-- written by one server process (backend), into the one row of their minute
-- and model (backend 0), adds them to their hour's row of usage_hours, and
-- counts the rows folded: the rows of the account @account_id when it is
-- given, and none of the accounts @skip. Rows a settlement is adding to are
-- skipped, for a later run.
WITH moved AS (
    DELETE FROM usage_minutes m
     USING (SELECT f.account_id, f.minute, f.model, f.backend FROM usage_minutes f
             WHERE f.backend <> 0 AND f.minute < @before
               AND (sqlc.narg(account_id)::uuid IS NULL OR f.account_id = sqlc.narg(account_id)::uuid)
               AND NOT (f.account_id = ANY (@skip::uuid[]))
             ORDER BY f.minute
             LIMIT @max_rows
             FOR UPDATE SKIP LOCKED) f
     WHERE (m.account_id, m.minute, m.model, m.backend) = (f.account_id, f.minute, f.model, f.backend)
    RETURNING m.account_id, m.minute, m.model, m.requests, m.input_rungs, m.output_rungs, m.total_rungs
), folded AS (
    INSERT INTO usage_minutes AS m (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
    SELECT account_id, minute, model, 0, sum(requests), sum(input_rungs), sum(output_rungs), sum(total_rungs)
      FROM moved
     GROUP BY account_id, minute, model
    ON CONFLICT (account_id, minute, model, backend) DO UPDATE
       SET requests = m.requests + EXCLUDED.requests,
           input_rungs = m.input_rungs + EXCLUDED.input_rungs,
           output_rungs = m.output_rungs + EXCLUDED.output_rungs,
           total_rungs = m.total_rungs + EXCLUDED.total_rungs
), hours AS (
    INSERT INTO usage_hours AS h (account_id, hour, model, requests, input_rungs, output_rungs, total_rungs)
    SELECT account_id, date_bin('1 hour', minute, '2000-01-01 00:00Z'), model,
           sum(requests), sum(input_rungs), sum(output_rungs), sum(total_rungs)
      FROM moved
     GROUP BY 1, 2, 3
    ON CONFLICT (account_id, hour, model) DO UPDATE
       SET requests = h.requests + EXCLUDED.requests,
           input_rungs = h.input_rungs + EXCLUDED.input_rungs,
           output_rungs = h.output_rungs + EXCLUDED.output_rungs,
           total_rungs = h.total_rungs + EXCLUDED.total_rungs
)
SELECT count(*)::bigint AS folded FROM moved;

-- name: UnfoldedUsageAccounts :many
-- Accounts with rows of usage_minutes to fold before @before, apart from @skip.
SELECT DISTINCT f.account_id FROM usage_minutes f
WHERE f.backend <> 0 AND f.minute < @before AND NOT (f.account_id = ANY (@skip::uuid[]))
LIMIT @max_rows;

-- name: UsageReport :many
-- Committed usage on the UTC days [@start, @end_time) (both UTC midnights),
-- per account, project, UTC day of completion, model and entry point; only
-- the account named @account when it is given. A request is counted from its
-- row while it is kept and from usage_days once it is past the retention
-- (migration 00048), never from both. Each account's requests are read
-- through its index on completion time, so no index on the requests table
-- serves this report alone.
SELECT a.name AS account, p.name AS project, u.day, u.model, u.entry_point,
       sum(u.requests)::bigint AS requests,
       sum(u.input_rungs)::bigint AS input_rungs,
       sum(u.output_rungs)::bigint AS output_rungs,
       sum(u.total_rungs)::bigint AS total_rungs
FROM accounts a
CROSS JOIN LATERAL (
    SELECT r.project_id, (r.completed_at AT TIME ZONE 'UTC')::date AS day, r.model, r.entry_point,
           count(*) AS requests, sum(r.input_rungs) AS input_rungs,
           sum(r.output_rungs) AS output_rungs, sum(r.total_rungs) AS total_rungs
    FROM requests r
    WHERE r.account_id = a.id AND r.completed_at >= @start AND r.completed_at < @end_time
    GROUP BY r.project_id, 2, r.model, r.entry_point
    UNION ALL
    SELECT d.project_id, d.day, d.model, d.entry_point, d.requests, d.input_rungs, d.output_rungs, d.total_rungs
    FROM usage_days d
    WHERE d.account_id = a.id
      AND d.day >= timezone('UTC', @start)::date AND d.day < timezone('UTC', @end_time)::date
) u
JOIN projects p ON p.id = u.project_id
WHERE sqlc.narg(account)::text IS NULL OR a.name = sqlc.narg(account)::text
GROUP BY a.name, p.name, u.day, u.model, u.entry_point
ORDER BY a.name, p.name, u.day, u.model, u.entry_point;

-- name: OldUsageAccounts :many
-- Up to @max_rows accounts from @first_account on, in order of id, each
-- with whether it has requests completed before @before (to fold into their
-- days) and folded sums by minute of minutes before it (to remove), and
-- where the pass stands in it (retention_marks): the oldest of each, read
-- from there in each table's index. (EXISTS was planned as a scan of the
-- whole table when few accounts hold the requests.)
SELECT a.id, k.requests_from, k.minutes_from,
       coalesce((SELECT r.completed_at FROM requests r
                  WHERE r.account_id = a.id AND r.completed_at >= coalesce(k.requests_from, '-infinity')
                  ORDER BY r.completed_at LIMIT 1) < @before, false)::boolean AS old_requests,
       coalesce((SELECT m.minute FROM usage_minutes m
                  WHERE m.account_id = a.id AND m.minute >= coalesce(k.minutes_from, '-infinity') AND m.backend = 0
                  ORDER BY m.minute LIMIT 1) < @before, false)::boolean AS old_minutes
FROM accounts a
LEFT JOIN retention_marks k ON k.account_id = a.id
WHERE a.id >= @first_account
ORDER BY a.id
LIMIT @max_rows;

-- name: FoldOldRequests :one
-- Removes up to @max_rows requests of the account @account_id completed
-- before @before, oldest first from @requests_from (its mark, or NULL), and
-- adds them to their day's sums in usage_days, in one statement: a request
-- is in one or the other, never both. Its mark moves to the last removed.
-- Found through the account's index on completion time (migration 00001)
-- and removed through the primary key (ANY of an array: never a join
-- planned over the whole table). Evidence rows are removed at their own
-- expiry (DeleteExpiredEvidence), long past when the retention is at least
-- the evidence's.
WITH moved AS (
    DELETE FROM requests r
     WHERE r.id = ANY (ARRAY(
            SELECT o.id FROM requests o
             WHERE o.account_id = @account_id AND o.completed_at < @before
               AND o.completed_at >= coalesce(sqlc.narg(requests_from)::timestamptz, '-infinity')
             ORDER BY o.completed_at
             LIMIT @max_rows))
       AND r.completed_at < @before
    RETURNING r.account_id, r.project_id, r.completed_at, r.model, r.entry_point, r.input_rungs, r.output_rungs, r.total_rungs
), days AS (
    INSERT INTO usage_days AS d (account_id, day, project_id, model, entry_point, requests, input_rungs, output_rungs, total_rungs)
    SELECT account_id, (completed_at AT TIME ZONE 'UTC')::date, project_id, model, entry_point,
           count(*), sum(input_rungs), sum(output_rungs), sum(total_rungs)
      FROM moved
     GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (account_id, day, project_id, model, entry_point) DO UPDATE
       SET requests = d.requests + EXCLUDED.requests,
           input_rungs = d.input_rungs + EXCLUDED.input_rungs,
           output_rungs = d.output_rungs + EXCLUDED.output_rungs,
           total_rungs = d.total_rungs + EXCLUDED.total_rungs
), marked AS (
    INSERT INTO retention_marks AS k (account_id, requests_from)
    SELECT @account_id, max(completed_at) FROM moved HAVING count(*) > 0
    ON CONFLICT (account_id) DO UPDATE
       SET requests_from = greatest(k.requests_from, EXCLUDED.requests_from)
)
SELECT count(*)::bigint AS folded FROM moved;

-- name: DeleteOldUsageMinutes :one
-- Removes up to @max_rows folded sums by minute (backend 0) of the account
-- @account_id of minutes before @before, oldest first from @minutes_from
-- (its mark, or NULL): what they hold is in their hour's sums already
-- (FoldUsageMinutes adds to both in one statement). Its mark moves to the
-- last removed. Found through the table's key and removed by their
-- addresses (a join on the key was planned as a hash join over the whole
-- table). Rows not yet folded stay, for the fold.
WITH removed AS (
    DELETE FROM usage_minutes m
     WHERE m.ctid = ANY (ARRAY(
            SELECT f.ctid FROM usage_minutes f
             WHERE f.account_id = @account_id AND f.minute < @before AND f.backend = 0
               AND f.minute >= coalesce(sqlc.narg(minutes_from)::timestamptz, '-infinity')
             ORDER BY f.minute
             LIMIT @max_rows))
       AND m.minute < @before AND m.backend = 0
    RETURNING m.minute
), marked AS (
    INSERT INTO retention_marks AS k (account_id, minutes_from)
    SELECT @account_id, max(minute) FROM removed HAVING count(*) > 0
    ON CONFLICT (account_id) DO UPDATE
       SET minutes_from = greatest(k.minutes_from, EXCLUDED.minutes_from)
)
SELECT count(*)::bigint AS removed FROM removed;

-- name: DailyState :one
-- The account's ceiling and today's charge, with settlements not yet folded in
-- counted at their actual cost and replicas' quota leases at what was used
-- under them (the unused part of a slice is not a charge).
SELECT coalesce(a.daily_rung_ceiling, @default_ceiling::bigint)::bigint AS ceiling_rungs,
       (coalesce((SELECT d.charged_rungs FROM daily_charges d WHERE d.account_id = a.id AND d.day = @day::date), 0)
        + coalesce((SELECT sum(s.day_rungs) FROM batch_settlements s
                     WHERE s.account_id = a.id AND s.day = @day::date), 0)
        + coalesce((SELECT sum(q.used_rungs - q.daily_rungs) FROM quota_leases q
                     WHERE q.account_id = a.id AND q.day = @day::date), 0))::bigint AS charged_rungs
FROM accounts a
WHERE a.id = @account_id;

-- name: UnfinishedBatchEstimates :one
-- What the account's batches created on @day still hold of that day's charge:
-- the estimates of their items not yet finished (a batch is charged its whole
-- estimate when created, and each item, when it ends, its actual cost, the
-- rest going back). The batches @skip are left out: refused by the
-- transaction that reads it, their items were never charged. Read only on a
-- refusal by the ceiling, to tell one that the batches' end may cure.
SELECT coalesce(sum(i.estimate_rungs), 0)::bigint AS rungs
  FROM batches b
  JOIN batch_items i ON i.batch_id = b.id
 WHERE b.account_id = @account_id
   AND b.created_at >= sqlc.arg(day)::timestamptz AND b.created_at < sqlc.arg(day)::timestamptz + '1 day'::interval
   AND b.status IN ('queued', 'in_progress', 'cancelling')
   AND b.id <> ALL (@skip::uuid[])
   AND i.status IN ('queued', 'in_progress');

-- name: BudgetState :one
-- The project's budget, with settlements not yet folded in moved from reserved
-- to spent, and replicas' quota leases counted at what was used under them.
SELECT p.name, p.budget_cap_rungs,
       (p.spent_rungs + coalesce(pending.spent, 0) + coalesce(leased.spent, 0))::bigint AS spent_rungs,
       (p.reserved_rungs - coalesce(pending.reserved, 0) - coalesce(leased.reserved, 0))::bigint AS reserved_rungs
FROM projects p
LEFT JOIN LATERAL (
    SELECT sum(s.spent_rungs) AS spent, sum(s.reserved_rungs) AS reserved
    FROM batch_settlements s WHERE s.project_id = p.id
) pending ON true
LEFT JOIN LATERAL (
    SELECT sum(q.used_rungs) AS spent, sum(q.budget_rungs) AS reserved
    FROM quota_leases q WHERE q.project_id = p.id
) leased ON true
WHERE p.id = @id;
