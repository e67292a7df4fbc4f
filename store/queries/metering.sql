-- name: AuthenticateKey :one
SELECT a.key_id::uuid AS key_id, a.scopes::text[] AS scopes,
       a.project_id::uuid AS project_id, a.project_name::text AS project_name,
       a.account_id::uuid AS account_id, a.account_name::text AS account_name, a.tier::text AS tier,
       a.rate_limit::integer AS rate_limit, a.admitted::boolean AS admitted,
       a.remaining::integer AS remaining, a.reset_seconds::integer AS reset_seconds
FROM authenticate_key(@prefix::text, @hash::bytea, @now::timestamptz, @limit_free::integer, @limit_developer::integer) AS a;

-- name: AdmitRequest :one
SELECT admit_request(@request_id, @account_id, @project_id, @day, @default_ceiling, @estimate, @expires_at)::text AS outcome;

-- name: SettleRequest :exec
-- Commits a request: its usage and evidence, the reconciliation of its daily
-- charge from estimate to actual, and its budget from reserved to spent, in one
-- statement. When recovery already released the reservation, the actual cost is
-- charged to the day given.
WITH released AS (
    DELETE FROM reservations WHERE reservations.request_id = @id
    RETURNING day, charged_rungs, reserved_rungs
), req AS (
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
), ev AS (
    INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
    SELECT req.id, req.account_id, @sources, sqlc.narg(verdict), @evidence_expires_at
    FROM req
), daily AS (
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs)
    VALUES (@account_id, coalesce((SELECT r.day FROM released r), @day::date), @total_rungs)
    ON CONFLICT (account_id, day) DO UPDATE
        SET charged_rungs = d.charged_rungs - coalesce((SELECT r.charged_rungs FROM released r), 0) + EXCLUDED.charged_rungs
)
UPDATE projects
   SET reserved_rungs = reserved_rungs - coalesce((SELECT r.reserved_rungs FROM released r), 0),
       spent_rungs = spent_rungs + @total_rungs
 WHERE projects.id = @project_id;

-- name: ReleaseReservation :exec
-- Gives back a request's charge and reservation when it ends without cost.
WITH released AS (
    DELETE FROM reservations WHERE reservations.request_id = @request_id
    RETURNING account_id, project_id, day, charged_rungs, reserved_rungs
), daily AS (
    UPDATE daily_charges d SET charged_rungs = d.charged_rungs - r.charged_rungs
      FROM released r WHERE d.account_id = r.account_id AND d.day = r.day
)
UPDATE projects p SET reserved_rungs = p.reserved_rungs - r.reserved_rungs
  FROM released r WHERE p.id = r.project_id;

-- name: ReleaseExpiredReservations :one
-- Releases reservations whose lease ran out (their replica died), at most
-- @max_rows at a time; safe to run on every replica at once.
WITH expired AS (
    DELETE FROM reservations
     WHERE request_id IN (
        SELECT request_id FROM reservations
         WHERE expires_at < now()
         ORDER BY expires_at
         LIMIT @max_rows
         FOR UPDATE SKIP LOCKED)
    RETURNING account_id, project_id, day, charged_rungs, reserved_rungs
), daily AS (
    UPDATE daily_charges d SET charged_rungs = d.charged_rungs - e.charged
      FROM (SELECT account_id, day, sum(charged_rungs) AS charged FROM expired GROUP BY account_id, day) e
     WHERE d.account_id = e.account_id AND d.day = e.day
), budget AS (
    UPDATE projects p SET reserved_rungs = p.reserved_rungs - e.reserved
      FROM (SELECT project_id, sum(reserved_rungs) AS reserved FROM expired GROUP BY project_id) e
     WHERE p.id = e.project_id
)
SELECT count(*) FROM expired;

-- name: DeleteOldRateWindows :execrows
DELETE FROM rate_windows WHERE window_start < @before;

-- name: UsageByModel :many
-- Committed usage of an account in [@start, @end), per model.
SELECT model,
       count(*)::bigint AS requests,
       coalesce(sum(input_rungs), 0)::bigint AS input_rungs,
       coalesce(sum(output_rungs), 0)::bigint AS output_rungs,
       coalesce(sum(total_rungs), 0)::bigint AS total_rungs
FROM requests
WHERE account_id = @account_id AND completed_at >= @start AND completed_at < @end_time
GROUP BY model
ORDER BY model;

-- name: DailyState :one
SELECT coalesce(a.daily_rung_ceiling, @default_ceiling::bigint)::bigint AS ceiling_rungs,
       coalesce((SELECT d.charged_rungs FROM daily_charges d WHERE d.account_id = a.id AND d.day = @day::date), 0)::bigint AS charged_rungs
FROM accounts a
WHERE a.id = @account_id;

-- name: BudgetState :one
SELECT name, budget_cap_rungs, spent_rungs, reserved_rungs FROM projects WHERE id = @id;
