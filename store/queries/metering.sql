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
SELECT settle_request(
    @id, @account_id, @project_id, @api_key_id, @model, @entry_point, @status,
    @input_tokens, @output_tokens, @input_rungs, @output_rungs, @total_rungs,
    @created_at, @completed_at, @sources, sqlc.narg(verdict), @evidence_expires_at, @day
);

-- name: ReleaseReservation :exec
SELECT release_reservation(@request_id);

-- name: ReleaseExpiredReservations :one
SELECT release_expired_reservations(@max_rows)::bigint AS released;

-- name: ReconcileSettlements :one
SELECT reconcile_settlements(@max_rows, @skip::uuid[], sqlc.narg(account_id)::uuid)::bigint AS reconciled;

-- name: SettledAccounts :many
-- Accounts with settlements to fold, apart from @skip.
SELECT DISTINCT r.account_id FROM reservations r
WHERE r.settled_rungs IS NOT NULL AND NOT (r.account_id = ANY (@skip::uuid[]))
LIMIT @max_rows;

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
-- The account's ceiling and today's charge, with settlements not yet folded in
-- counted at their actual cost.
SELECT coalesce(a.daily_rung_ceiling, @default_ceiling::bigint)::bigint AS ceiling_rungs,
       (coalesce((SELECT d.charged_rungs FROM daily_charges d WHERE d.account_id = a.id AND d.day = @day::date), 0)
        + coalesce((SELECT sum(r.settled_rungs - r.charged_rungs) FROM reservations r
                     WHERE r.account_id = a.id AND r.day = @day::date AND r.settled_rungs IS NOT NULL), 0))::bigint AS charged_rungs
FROM accounts a
WHERE a.id = @account_id;

-- name: BudgetState :one
-- The project's budget, with settlements not yet folded in moved from reserved to spent.
SELECT p.name, p.budget_cap_rungs,
       (p.spent_rungs + coalesce(pending.spent, 0))::bigint AS spent_rungs,
       (p.reserved_rungs - coalesce(pending.reserved, 0))::bigint AS reserved_rungs
FROM projects p
LEFT JOIN LATERAL (
    SELECT sum(r.settled_rungs) AS spent, sum(r.reserved_rungs) AS reserved
    FROM reservations r WHERE r.project_id = p.id AND r.settled_rungs IS NOT NULL
) pending ON true
WHERE p.id = @id;
