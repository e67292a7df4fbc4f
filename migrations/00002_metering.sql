-- +goose Up
-- Per-key request counts in one-minute windows (sliding-window rate limit).
CREATE TABLE rate_windows (
    key_id       uuid NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    window_start timestamptz NOT NULL,
    count        integer NOT NULL CHECK (count >= 0),
    PRIMARY KEY (key_id, window_start)
);
CREATE INDEX rate_windows_start_idx ON rate_windows (window_start);

-- Rungs charged against an account's daily ceiling, per UTC day: estimates at
-- admission, reconciled to actual cost when each request ends.
CREATE TABLE daily_charges (
    account_id    uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    day           date NOT NULL,
    charged_rungs bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, day)
);

-- Project budget state: committed spend and reservations of running requests.
ALTER TABLE projects
    ADD COLUMN spent_rungs    bigint NOT NULL DEFAULT 0,
    ADD COLUMN reserved_rungs bigint NOT NULL DEFAULT 0 CHECK (reserved_rungs >= 0);

-- One row per admitted request not yet folded into the counters: what it
-- charged to the day and reserved on the budget, and until when (its lease).
-- Settlement records the actual cost in settled_rungs; the reconciler then folds
-- the row into daily_charges and projects and deletes it. A running request
-- whose lease ran out (its replica died) is released by recovery.
CREATE TABLE reservations (
    request_id     uuid PRIMARY KEY,
    account_id     uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    project_id     uuid NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    day            date NOT NULL,
    charged_rungs  bigint NOT NULL CHECK (charged_rungs >= 0),
    reserved_rungs bigint NOT NULL CHECK (reserved_rungs >= 0),
    expires_at     timestamptz NOT NULL,
    -- NULL while running; the actual cost once settled.
    settled_rungs  bigint CHECK (settled_rungs >= 0)
);
CREATE INDEX reservations_running_expires_idx ON reservations (expires_at) WHERE settled_rungs IS NULL;
-- Settled rows await the reconciler, which takes them in this order; the usage
-- view sums the few of them per account-day and project through it too. No
-- other index: every admission and settlement writes this table.
CREATE INDEX reservations_settled_idx ON reservations (account_id, day, project_id) WHERE settled_rungs IS NOT NULL;

-- authenticate_key resolves a key (prefix and hash) to its principal and counts
-- the request against the key's rate limit: a sliding window over the current
-- and the previous minute (the previous minute weighted by how much of it still
-- overlaps the last 60 s). A request past the limit is not counted and comes
-- back with admitted = false. No row: unknown or revoked key.
-- The count commits asynchronously (synchronous_commit off for this transaction
-- only): the per-key row lock is released without waiting for the WAL flush, and
-- a database crash can lose at most the last moments of counts.
-- +goose StatementBegin
CREATE FUNCTION authenticate_key(
    p_prefix text, p_hash bytea, p_now timestamptz, p_limit_free integer, p_limit_developer integer
) RETURNS TABLE (
    key_id uuid, scopes text[], project_id uuid, project_name text,
    account_id uuid, account_name text, tier text,
    rate_limit integer, admitted boolean, remaining integer, reset_seconds integer
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_window   timestamptz := date_trunc('minute', p_now);
    v_elapsed  double precision := extract(epoch FROM p_now - date_trunc('minute', p_now)) / 60.0;
    v_previous integer;
    v_current  integer;
    v_used     double precision;
BEGIN
    SELECT k.id, k.scopes, p.id, p.name, a.id, a.name, a.tier
      INTO key_id, scopes, project_id, project_name, account_id, account_name, tier
      FROM api_keys k
      JOIN projects p ON p.id = k.project_id
      JOIN accounts a ON a.id = p.account_id
     WHERE k.prefix = p_prefix AND k.hash = p_hash AND k.revoked_at IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    rate_limit := CASE WHEN tier = 'free' THEN p_limit_free ELSE p_limit_developer END;
    PERFORM set_config('synchronous_commit', 'off', true);

    SELECT w.count INTO v_previous FROM rate_windows w
     WHERE w.key_id = authenticate_key.key_id AND w.window_start = v_window - interval '1 minute';
    INSERT INTO rate_windows AS w (key_id, window_start, count)
    VALUES (authenticate_key.key_id, v_window, 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO v_current;

    v_used := coalesce(v_previous, 0) * (1.0 - v_elapsed) + v_current;
    admitted := v_used + 1 <= rate_limit;
    IF admitted THEN
        UPDATE rate_windows w SET count = w.count + 1
         WHERE w.key_id = authenticate_key.key_id AND w.window_start = v_window;
        v_used := v_used + 1;
    END IF;
    remaining := greatest(0, floor(rate_limit - v_used))::integer;
    reset_seconds := ceil(60 - v_elapsed * 60)::integer;
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- charge_daily charges p_amount to an account's day if it stays within the
-- account's ceiling (its own, or p_default_ceiling), locking the account-day row.
-- +goose StatementBegin
CREATE FUNCTION charge_daily(p_account_id uuid, p_day date, p_default_ceiling bigint, p_amount bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_ceiling bigint;
    v_charged bigint;
BEGIN
    SELECT coalesce(a.daily_rung_ceiling, p_default_ceiling) INTO v_ceiling FROM accounts a WHERE a.id = p_account_id;
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (p_account_id, p_day, 0)
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs
    RETURNING d.charged_rungs INTO v_charged;
    IF v_charged + p_amount > v_ceiling THEN
        RETURN false;
    END IF;
    UPDATE daily_charges SET charged_rungs = charged_rungs + p_amount WHERE account_id = p_account_id AND day = p_day;
    RETURN true;
END;
$$;
-- +goose StatementEnd

-- admit_request charges a request's estimate to the account's daily ceiling and
-- reserves it on a capped project budget, atomically: both or neither. Rows are
-- locked in a fixed order (account-day, then project), and the project row with
-- FOR NO KEY UPDATE, which does not conflict with the KEY SHARE locks that
-- foreign-key checks of concurrent settlements hold on it. The admission commits
-- asynchronously, so the hot account-day row is not held through a WAL flush;
-- should a database crash lose a reservation, settle_request charges the actual
-- cost without one and nothing is double-counted. Returns 'ok', 'daily' (the
-- ceiling would be passed) or 'budget' (the cap would be passed).
-- +goose StatementBegin
CREATE FUNCTION admit_request(
    p_request_id uuid, p_account_id uuid, p_project_id uuid, p_day date,
    p_default_ceiling bigint, p_estimate bigint, p_expires_at timestamptz
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_cap      bigint;
    v_spent    bigint;
    v_reserved bigint;
    v_reserve  bigint := 0;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF NOT charge_daily(p_account_id, p_day, p_default_ceiling, p_estimate) THEN
        RETURN 'daily';
    END IF;
    SELECT p.budget_cap_rungs INTO v_cap FROM projects p WHERE p.id = p_project_id;
    IF v_cap IS NOT NULL THEN
        SELECT p.budget_cap_rungs, p.spent_rungs, p.reserved_rungs INTO v_cap, v_spent, v_reserved
          FROM projects p WHERE p.id = p_project_id FOR NO KEY UPDATE;
        IF v_cap IS NOT NULL THEN
            IF v_spent + v_reserved + p_estimate > v_cap THEN
                UPDATE daily_charges SET charged_rungs = charged_rungs - p_estimate
                 WHERE account_id = p_account_id AND day = p_day;
                RETURN 'budget';
            END IF;
            v_reserve := p_estimate;
            UPDATE projects SET reserved_rungs = reserved_rungs + v_reserve WHERE id = p_project_id;
        END IF;
    END IF;
    INSERT INTO reservations (request_id, account_id, project_id, day, charged_rungs, reserved_rungs, expires_at)
    VALUES (p_request_id, p_account_id, p_project_id, p_day, p_estimate, v_reserve, p_expires_at);
    RETURN 'ok';
END;
$$;
-- +goose StatementEnd

-- settle_request commits a finished request durably: its usage and evidence,
-- and its actual cost on its own reservation row (inserted when recovery already
-- released it). It touches no row shared with other requests, so settlements of
-- one account do not queue behind each other's WAL flushes; reconcile_settlements
-- folds the cost into the day and budget counters.
-- +goose StatementBegin
CREATE FUNCTION settle_request(
    p_id uuid, p_account_id uuid, p_project_id uuid, p_api_key_id uuid,
    p_model text, p_entry_point text, p_status text,
    p_input_tokens bigint, p_output_tokens bigint,
    p_input_rungs bigint, p_output_rungs bigint, p_total_rungs bigint,
    p_created_at timestamptz, p_completed_at timestamptz,
    p_sources jsonb, p_verdict text, p_evidence_expires_at timestamptz, p_day date
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO requests (
        id, account_id, project_id, api_key_id, model, entry_point, status,
        input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at
    ) VALUES (
        p_id, p_account_id, p_project_id, p_api_key_id, p_model, p_entry_point, p_status,
        p_input_tokens, p_output_tokens, p_input_rungs, p_output_rungs, p_total_rungs, p_created_at, p_completed_at
    );
    INSERT INTO evidence (request_id, account_id, sources, verdict, expires_at)
    VALUES (p_id, p_account_id, p_sources, p_verdict, p_evidence_expires_at);
    INSERT INTO reservations AS r (request_id, account_id, project_id, day, charged_rungs, reserved_rungs, expires_at, settled_rungs)
    VALUES (p_id, p_account_id, p_project_id, p_day, 0, 0, p_completed_at, p_total_rungs)
    ON CONFLICT (request_id) DO UPDATE SET settled_rungs = EXCLUDED.settled_rungs;
END;
$$;
-- +goose StatementEnd

-- reconcile_settlements folds up to p_max settled reservations into the
-- counters: each day's charge moves from estimate to actual, each project's
-- budget from reserved to spent. Rows are locked in one order everywhere
-- (account-days ascending, then projects ascending) and rows another run holds
-- are skipped, so every replica may run it. It commits asynchronously: a run
-- lost in a database crash leaves its rows in place to be folded again.
-- +goose StatementBegin
CREATE FUNCTION reconcile_settlements(p_max integer) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_ids uuid[];
    v     record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT array_agg(s.request_id) INTO v_ids FROM (
        SELECT r.request_id FROM reservations r
         WHERE r.settled_rungs IS NOT NULL
         ORDER BY r.account_id, r.day, r.project_id
         LIMIT p_max
         FOR UPDATE SKIP LOCKED) s;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    FOR v IN SELECT r.account_id, r.day, sum(r.settled_rungs - r.charged_rungs) AS delta
               FROM reservations r WHERE r.request_id = ANY (v_ids)
              GROUP BY r.account_id, r.day ORDER BY r.account_id, r.day
    LOOP
        INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (v.account_id, v.day, v.delta)
        ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    END LOOP;
    FOR v IN SELECT r.project_id, sum(r.reserved_rungs) AS reserved, sum(r.settled_rungs) AS spent
               FROM reservations r WHERE r.request_id = ANY (v_ids)
              GROUP BY r.project_id ORDER BY r.project_id
    LOOP
        UPDATE projects SET reserved_rungs = reserved_rungs - v.reserved, spent_rungs = spent_rungs + v.spent
         WHERE id = v.project_id;
    END LOOP;
    DELETE FROM reservations r WHERE r.request_id = ANY (v_ids);
    RETURN cardinality(v_ids);
END;
$$;
-- +goose StatementEnd

-- release_reservation gives back a running request's charge and reservation
-- (it ended without cost, or its lease ran out) by settling it at no cost: the
-- reconciler then returns the estimate to the day and the reservation to the
-- budget. Only admission, claims and the reconciler lock counter rows, so no
-- lock-order cycle can form. Returns false when there was nothing to release.
-- +goose StatementBegin
CREATE FUNCTION release_reservation(p_request_id uuid) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE reservations SET settled_rungs = 0 WHERE request_id = p_request_id AND settled_rungs IS NULL;
    RETURN FOUND;
END;
$$;
-- +goose StatementEnd

-- release_expired_reservations releases up to p_max running reservations whose
-- lease ran out; rows another run holds are skipped.
-- +goose StatementBegin
CREATE FUNCTION release_expired_reservations(p_max integer) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint;
BEGIN
    UPDATE reservations SET settled_rungs = 0
     WHERE request_id IN (
        SELECT r.request_id FROM reservations r
         WHERE r.expires_at < now() AND r.settled_rungs IS NULL
         ORDER BY r.expires_at
         LIMIT p_max
         FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION release_expired_reservations(integer);
DROP FUNCTION release_reservation(uuid);
DROP FUNCTION reconcile_settlements(integer);
DROP FUNCTION settle_request(uuid, uuid, uuid, uuid, text, text, text, bigint, bigint, bigint, bigint, bigint, timestamptz, timestamptz, jsonb, text, timestamptz, date);
DROP FUNCTION admit_request(uuid, uuid, uuid, date, bigint, bigint, timestamptz);
DROP FUNCTION charge_daily(uuid, date, bigint, bigint);
DROP FUNCTION authenticate_key(text, bytea, timestamptz, integer, integer);
DROP TABLE reservations;
ALTER TABLE projects DROP COLUMN reserved_rungs, DROP COLUMN spent_rungs;
DROP TABLE daily_charges;
DROP TABLE rate_windows;
