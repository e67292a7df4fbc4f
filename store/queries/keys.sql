-- name: UpsertAccount :one
-- Creates the account on first use (tier developer unless given); an explicit
-- tier updates an existing account.
INSERT INTO accounts (id, name, tier)
VALUES (@id, @name, COALESCE(sqlc.narg(tier)::text, 'developer'))
ON CONFLICT (name) DO UPDATE
    SET tier = COALESCE(sqlc.narg(tier)::text, accounts.tier)
RETURNING *;

-- name: UpsertProject :one
INSERT INTO projects (id, account_id, name)
VALUES (@id, @account_id, @name)
ON CONFLICT (account_id, name) DO UPDATE SET name = EXCLUDED.name
RETURNING *;

-- name: InsertAPIKey :one
INSERT INTO api_keys (id, project_id, prefix, hash, scopes, expires_at)
VALUES (@id, @project_id, @prefix, @hash, @scopes, sqlc.narg(expires_at))
RETURNING *;

-- name: RevokeAPIKey :execrows
-- Revokes by key id (text form) or by prefix; revoking twice is a no-op.
UPDATE api_keys SET revoked_at = now()
WHERE (id::text = @key::text OR prefix = @key::text) AND revoked_at IS NULL;

-- name: RevokeAccountAPIKeys :execrows
-- Revokes every active key (neither revoked nor past its end) of an account's
-- projects, or of one of them; the others keep their state.
UPDATE api_keys k SET revoked_at = now()
  FROM projects p
 WHERE p.id = k.project_id AND p.account_id = @account_id
   AND (sqlc.narg(project_id)::uuid IS NULL OR p.id = sqlc.narg(project_id)::uuid)
   AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now());

-- name: LockActiveAPIKey :one
-- An active key (neither revoked nor expired) by key id (text form) or prefix,
-- locked until the transaction ends.
SELECT id, project_id, scopes, expires_at FROM api_keys
WHERE (id::text = @key::text OR prefix = @key::text) AND revoked_at IS NULL
  AND (expires_at IS NULL OR expires_at > now())
FOR UPDATE;

-- name: SetAPIKeyExpiry :exec
UPDATE api_keys SET expires_at = @expires_at WHERE id = @id;

-- name: SetAccountDailyCeiling :execrows
UPDATE accounts SET daily_rung_ceiling = @daily_rung_ceiling WHERE id = @id;

-- name: SetProjectBudget :execrows
UPDATE projects SET budget_cap_rungs = @budget_cap_rungs WHERE id = @id;

-- name: GetAccountByName :one
SELECT * FROM accounts WHERE name = @name;

-- name: ListAccountProjects :many
SELECT id, name FROM projects WHERE account_id = @account_id ORDER BY name;

-- name: GetProjectByName :one
SELECT * FROM projects WHERE account_id = @account_id AND name = @name;

-- name: ListAPIKeys :many
-- Every key with its account and project, newest first; only the account's
-- when one is named. Operators list keys to find the one to revoke.
SELECT k.id, k.prefix, k.scopes, k.created_at, k.revoked_at, k.expires_at,
       a.name AS account, a.tier, p.name AS project
FROM api_keys k
JOIN projects p ON p.id = k.project_id
JOIN accounts a ON a.id = p.account_id
WHERE sqlc.narg(account)::text IS NULL OR a.name = sqlc.narg(account)::text
ORDER BY k.created_at DESC, k.id DESC;
