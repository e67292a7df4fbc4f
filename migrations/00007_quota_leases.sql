-- +goose Up
-- The interactive hot path from memory (see docs/design.md, "The ledger").
--
-- 1. Replicas cache authenticated keys; a change to a key (revoked, scopes),
--    an account (name, tier, ceiling) or a project (name, cap) is announced on
--    the channel gateway_principals (the payload names the table) when its
--    transaction commits. Rows are never deleted (below).
-- +goose StatementBegin
CREATE FUNCTION notify_principals_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('gateway_principals', TG_TABLE_NAME);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
CREATE TRIGGER api_keys_changed AFTER UPDATE ON api_keys FOR EACH ROW
    WHEN (OLD.revoked_at IS DISTINCT FROM NEW.revoked_at OR OLD.scopes IS DISTINCT FROM NEW.scopes)
    EXECUTE FUNCTION notify_principals_changed();
CREATE TRIGGER accounts_changed AFTER UPDATE ON accounts FOR EACH ROW
    WHEN (OLD.name IS DISTINCT FROM NEW.name OR OLD.tier IS DISTINCT FROM NEW.tier
          OR OLD.daily_rung_ceiling IS DISTINCT FROM NEW.daily_rung_ceiling)
    EXECUTE FUNCTION notify_principals_changed();
CREATE TRIGGER projects_changed AFTER UPDATE ON projects FOR EACH ROW
    WHEN (OLD.name IS DISTINCT FROM NEW.name OR OLD.budget_cap_rungs IS DISTINCT FROM NEW.budget_cap_rungs)
    EXECUTE FUNCTION notify_principals_changed();

-- 2. Hot tables without per-row foreign-key checks: every committed request
--    took KEY SHARE locks on its account, project and key rows (five checks
--    per request with its evidence, a MultiXact on the rows every request of an
--    account shares). Integrity is kept the other way round: accounts,
--    projects and keys are never deleted (keys are revoked), so a request can
--    never lose what it refers to, and requests are only written with the ids
--    of an authenticated principal.
ALTER TABLE requests
    DROP CONSTRAINT requests_account_id_fkey,
    DROP CONSTRAINT requests_project_id_fkey,
    DROP CONSTRAINT requests_api_key_id_fkey;
ALTER TABLE evidence
    DROP CONSTRAINT evidence_request_id_fkey,
    DROP CONSTRAINT evidence_account_id_fkey;
ALTER TABLE rate_windows DROP CONSTRAINT rate_windows_key_id_fkey;
-- It served the cascade from a deleted project; no query reads requests by
-- project, and every insert paid for it.
DROP INDEX requests_project_idx;
-- +goose StatementBegin
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are never deleted: committed requests refer to them (revoke keys instead)', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END;
$$;
-- +goose StatementEnd
CREATE TRIGGER accounts_kept BEFORE DELETE ON accounts FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER projects_kept BEFORE DELETE ON projects FOR EACH ROW EXECUTE FUNCTION refuse_delete();
CREATE TRIGGER api_keys_kept BEFORE DELETE ON api_keys FOR EACH ROW EXECUTE FUNCTION refuse_delete();

-- 3. Rate limits in leased slices: a replica takes a slice of a key's count
--    for the current minute and admits from it in memory. The sum of slices
--    never passes the limit (in the sliding window counted before), so no
--    number of replicas admits more than the limit.
-- lease_rate grants a slice of the key's current minute: 1/p_share of what the
-- sliding window leaves under p_limit, at least 1 while anything is left; it
-- returns the grant and the window's use after it. Commits asynchronously: a database crash can lose the
-- last moments of counts, never a usage record.
-- +goose StatementBegin
CREATE FUNCTION lease_rate(p_key_id uuid, p_now timestamptz, p_limit integer, p_share integer)
RETURNS TABLE (granted integer, used double precision) LANGUAGE plpgsql AS $$
DECLARE
    v_window   timestamptz := date_trunc('minute', p_now);
    v_elapsed  double precision := extract(epoch FROM p_now - date_trunc('minute', p_now)) / 60.0;
    v_previous integer;
    v_current  integer;
    v_used     double precision;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT w.count INTO v_previous FROM rate_windows w
     WHERE w.key_id = p_key_id AND w.window_start = v_window - interval '1 minute';
    INSERT INTO rate_windows AS w (key_id, window_start, count) VALUES (p_key_id, v_window, 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO v_current;
    v_used := coalesce(v_previous, 0) * (1.0 - v_elapsed) + v_current;
    granted := greatest(0, least(greatest(1, floor((p_limit - v_used) / p_share)), floor(p_limit - v_used)))::integer;
    IF granted > 0 THEN
        UPDATE rate_windows w SET count = w.count + granted WHERE w.key_id = p_key_id AND w.window_start = v_window;
    END IF;
    used := v_used + granted;
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- return_rate gives back the unused parts of slices of the given windows (one
-- statement for every key a replica returns).
-- +goose StatementBegin
CREATE FUNCTION return_rate(p_keys uuid[], p_windows timestamptz[], p_counts integer[]) RETURNS void LANGUAGE sql AS $$
    UPDATE rate_windows w SET count = greatest(0, w.count - r.n)
      FROM (SELECT k, ws, sum(n)::integer AS n FROM unnest(p_keys, p_windows, p_counts) AS u(k, ws, n)
             GROUP BY k, ws ORDER BY k, ws) r
     WHERE w.key_id = r.k AND w.window_start = r.ws;
$$;
-- +goose StatementEnd
DROP FUNCTION authenticate_key(text, bytea, timestamptz, integer, integer);
-- Interactive requests no longer hold one reservation each (batch items still do).
DROP FUNCTION admit_request(uuid, uuid, uuid, date, bigint, bigint, timestamptz);
DROP FUNCTION settle_request(uuid, uuid, uuid, uuid, text, text, text, bigint, bigint, bigint, bigint, bigint, timestamptz, timestamptz, jsonb, text, timestamptz, date);
DROP FUNCTION release_reservation(uuid);

-- 4. Quota leases: a replica holds a slice of an account-day's ceiling (and of
--    a capped project's budget) and admits requests from it in memory. The
--    slice is charged to daily_charges and reserved on the project when
--    granted, so the sum of slices never passes either cap. Requests settled
--    under a lease add their actual cost to used_rungs; folding the lease
--    (returned when idle, or expired because its replica died) moves the day's
--    charge from the slice to what was used and the budget from reserved to
--    spent. A lease is renewed by its replica while it holds it.
CREATE TABLE quota_leases (
    id           uuid PRIMARY KEY,
    owner        uuid NOT NULL,
    account_id   uuid NOT NULL,
    project_id   uuid NOT NULL,
    day          date NOT NULL,
    daily_rungs  bigint NOT NULL DEFAULT 0 CHECK (daily_rungs >= 0),
    budget_rungs bigint NOT NULL DEFAULT 0 CHECK (budget_rungs >= 0),
    used_rungs   bigint NOT NULL DEFAULT 0 CHECK (used_rungs >= 0),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX quota_leases_expires_idx ON quota_leases (expires_at);
CREATE INDEX quota_leases_account_day_idx ON quota_leases (account_id, day);
CREATE INDEX quota_leases_project_idx ON quota_leases (project_id);

-- grant_quota adds to lease p_id (created on first use) a slice of the
-- account-day's ceiling and, when the project is capped, the same of its
-- budget: 1/p_share of what they leave, at least p_need; or nothing when they
-- leave less than p_need. Slices shrink as the remainder shrinks, and their sum
-- never passes a cap. Locks in one order everywhere: the lease,
-- then the account-day, then the project. Returns the outcome ('ok', 'daily',
-- 'budget'), the grants, and the ceiling and cap with what they leave, for the
-- replica to size its next slice and word a refusal.
-- +goose StatementBegin
CREATE FUNCTION grant_quota(
    p_id uuid, p_owner uuid, p_account_id uuid, p_project_id uuid, p_day date,
    p_default_ceiling bigint, p_need bigint, p_share integer, p_expires_at timestamptz
) RETURNS TABLE (
    outcome text, daily_granted bigint, budget_granted bigint, capped boolean,
    ceiling bigint, daily_left bigint, cap bigint, budget_left bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_charged bigint;
    v_spent   bigint;
    v_reserved bigint;
BEGIN
    INSERT INTO quota_leases AS q (id, owner, account_id, project_id, day, expires_at)
    VALUES (p_id, p_owner, p_account_id, p_project_id, p_day, p_expires_at)
    ON CONFLICT (id) DO UPDATE SET expires_at = greatest(q.expires_at, EXCLUDED.expires_at);

    SELECT coalesce(a.daily_rung_ceiling, p_default_ceiling) INTO ceiling FROM accounts a WHERE a.id = p_account_id;
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (p_account_id, p_day, 0)
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs
    RETURNING d.charged_rungs INTO v_charged;
    daily_left := greatest(0, ceiling - v_charged);
    daily_granted := 0;
    budget_granted := 0;
    SELECT p.budget_cap_rungs, p.spent_rungs, p.reserved_rungs INTO cap, v_spent, v_reserved
      FROM projects p WHERE p.id = p_project_id FOR NO KEY UPDATE;
    capped := cap IS NOT NULL;
    -- The budget is checked first: a refusal names the project's cap before
    -- the account's day.
    IF capped THEN
        budget_left := greatest(0, cap - v_spent - v_reserved);
        IF budget_left < p_need THEN
            outcome := 'budget';
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    IF daily_left < p_need THEN
        outcome := 'daily';
        RETURN NEXT;
        RETURN;
    END IF;
    daily_granted := greatest(p_need, daily_left / p_share);
    IF capped THEN
        daily_granted := least(daily_granted, greatest(p_need, budget_left / p_share));
        budget_granted := daily_granted;
        UPDATE projects SET reserved_rungs = reserved_rungs + budget_granted WHERE id = p_project_id;
        budget_left := budget_left - budget_granted;
    END IF;
    UPDATE daily_charges SET charged_rungs = charged_rungs + daily_granted WHERE account_id = p_account_id AND day = p_day;
    daily_left := daily_left - daily_granted;
    UPDATE quota_leases SET daily_rungs = daily_rungs + daily_granted, budget_rungs = budget_rungs + budget_granted
     WHERE id = p_id;
    outcome := 'ok';
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- fold_quota_leases folds and deletes the leases p_ids of p_owner (returned by
-- their replica) and up to p_expired leases of any replica whose time ran out
-- (but those in p_skip):
-- the account-day's charge moves from each slice to what was used under it, the
-- project's budget from reserved to spent. Rows another run holds are skipped.
-- Returns how many leases were folded.
-- +goose StatementBegin
CREATE FUNCTION fold_quota_leases(p_owner uuid, p_ids uuid[], p_expired integer, p_skip uuid[]) RETURNS bigint LANGUAGE sql AS $$
    WITH picked AS (
        SELECT q.id FROM quota_leases q
         WHERE (q.id = ANY (p_ids) AND q.owner = p_owner)
            OR q.id IN (SELECT e.id FROM quota_leases e WHERE e.expires_at < now() AND NOT (e.id = ANY (p_skip))
                         ORDER BY e.expires_at LIMIT p_expired)
         ORDER BY q.id FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM quota_leases q USING picked WHERE q.id = picked.id RETURNING q.*
    ), daily AS (
        UPDATE daily_charges d SET charged_rungs = greatest(0, d.charged_rungs + f.delta)
          FROM (SELECT account_id, day, sum(used_rungs - daily_rungs) AS delta FROM gone
                 GROUP BY account_id, day ORDER BY account_id, day) f
         WHERE d.account_id = f.account_id AND d.day = f.day
    ), budget AS (
        UPDATE projects p SET reserved_rungs = greatest(0, p.reserved_rungs - f.reserved), spent_rungs = p.spent_rungs + f.spent
          FROM (SELECT project_id, sum(budget_rungs) AS reserved, sum(used_rungs) AS spent FROM gone
                 GROUP BY project_id ORDER BY project_id) f
         WHERE p.id = f.project_id
    )
    SELECT count(*) FROM gone;
$$;
-- +goose StatementEnd

-- renew_quota_leases extends the leases p_ids of p_owner to p_expires_at and
-- returns those it still holds.
-- +goose StatementBegin
CREATE FUNCTION renew_quota_leases(p_owner uuid, p_ids uuid[], p_expires_at timestamptz)
RETURNS SETOF uuid LANGUAGE sql AS $$
    UPDATE quota_leases SET expires_at = p_expires_at
     WHERE id = ANY (p_ids) AND owner = p_owner
    RETURNING id;
$$;
-- +goose StatementEnd

-- settle_requests commits a group of finished interactive requests in one
-- statement: their usage and evidence, and their actual cost on the lease each
-- was admitted under (or, when that lease was already folded, straight onto
-- the counters). A request already stored (a retry after a reply lost past the
-- commit) is skipped, so a group may be sent again safely. Returns the ids of
-- the group, all of which are stored when it commits. PL/pgSQL, not SQL: its
-- plan is cached for the session instead of made again on every call (five
-- times the cost).
-- +goose StatementBegin
CREATE FUNCTION settle_requests(p_requests jsonb) RETURNS SETOF uuid LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH r AS (
        SELECT * FROM jsonb_to_recordset(p_requests) AS x(
            id uuid, account_id uuid, project_id uuid, api_key_id uuid, model text, entry_point text, status text,
            input_tokens bigint, output_tokens bigint, input_rungs bigint, output_rungs bigint, total_rungs bigint,
            created_at timestamptz, completed_at timestamptz, sources jsonb, verdict text,
            evidence_expires_at timestamptz, lease_id uuid, day date)
    ), stored AS (
        INSERT INTO requests (
            id, account_id, project_id, api_key_id, model, entry_point, status,
            input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
        SELECT r.id, r.account_id, r.project_id, r.api_key_id, r.model, r.entry_point, r.status,
               r.input_tokens, r.output_tokens, r.input_rungs, r.output_rungs, r.total_rungs, r.created_at, r.completed_at
          FROM r
        ON CONFLICT (id) DO NOTHING
        RETURNING requests.id
    ), ev AS (
        INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
        SELECT r.id, r.account_id, r.sources, r.verdict, r.evidence_expires_at FROM r JOIN stored USING (id)
    ), costs AS (
        SELECT r.lease_id, r.account_id, r.project_id, r.day, sum(r.total_rungs) AS cost
          FROM r JOIN stored USING (id) GROUP BY r.lease_id, r.account_id, r.project_id, r.day
    ), leased AS (
        UPDATE quota_leases q SET used_rungs = q.used_rungs + c.cost
          FROM (SELECT lease_id, sum(cost) AS cost FROM costs WHERE lease_id IS NOT NULL
                 GROUP BY lease_id ORDER BY lease_id) c
         WHERE q.id = c.lease_id
        RETURNING q.id
    ), direct AS (
        SELECT * FROM costs WHERE lease_id IS NULL OR lease_id NOT IN (SELECT id FROM leased)
    ), daily AS (
        INSERT INTO daily_charges AS d (account_id, day, charged_rungs)
        SELECT account_id, day, sum(cost) FROM direct GROUP BY account_id, day ORDER BY account_id, day
        ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs
    ), budget AS (
        UPDATE projects p SET spent_rungs = p.spent_rungs + s.cost
          FROM (SELECT project_id, sum(cost) AS cost FROM direct GROUP BY project_id ORDER BY project_id) s
         WHERE p.id = s.project_id
    )
    SELECT r.id FROM r;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00007 is forward-only'; END $$;
-- +goose StatementEnd
