-- +goose Up
-- Statements that serve a few tenants read those tenants' rows by key, however
-- many tenants the tables hold. The planner sized the rows these statements
-- take from their arguments by its defaults (an array of ten, a set of a
-- hundred): joined to a table of a few thousand rows that looked like a
-- fraction of it, and it read the whole table. The fold of a replica's idle
-- leases read every lease, every project and every day's charge of every
-- account (17 ms at 200,000 charges, growing with each day served); the
-- return of unused rate slices every rate window. Each statement now names
-- the keys of the rows it changes as an index condition (key = ANY (ARRAY(...))),
-- which no estimate turns into a scan of the table.

-- fold_quota_leases: as in 00007. The leases are found by key (those returned
-- by their replica) or through the index of expiry (those that ran out), then
-- locked by key; the lock re-checks that a lease is still the owner's or still
-- expired (a renewal that committed meanwhile keeps its lease). The charges
-- and budgets they fold into are updated by key.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fold_quota_leases(p_owner uuid, p_ids uuid[], p_expired integer, p_skip uuid[]) RETURNS bigint LANGUAGE sql AS $$
    WITH candidates AS (
        SELECT q.id FROM quota_leases q WHERE q.id = ANY (p_ids) AND q.owner = p_owner
        UNION
        (SELECT e.id FROM quota_leases e WHERE e.expires_at < now() AND NOT (e.id = ANY (p_skip))
          ORDER BY e.expires_at LIMIT p_expired)
    ), picked AS (
        SELECT q.id FROM quota_leases q
         WHERE q.id = ANY (ARRAY(SELECT id FROM candidates))
           AND ((q.id = ANY (p_ids) AND q.owner = p_owner) OR q.expires_at < now())
         ORDER BY q.id FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM quota_leases q WHERE q.id = ANY (ARRAY(SELECT id FROM picked)) RETURNING q.*
    ), daily AS (
        UPDATE daily_charges d SET charged_rungs = greatest(0, d.charged_rungs + f.delta)
          FROM (SELECT account_id, day, sum(used_rungs - daily_rungs) AS delta FROM gone
                 GROUP BY account_id, day ORDER BY account_id, day) f
         WHERE d.account_id = f.account_id AND d.day = f.day
           AND d.account_id = ANY (ARRAY(SELECT account_id FROM gone)) AND d.day = ANY (ARRAY(SELECT day FROM gone))
    ), budget AS (
        UPDATE projects p SET reserved_rungs = greatest(0, p.reserved_rungs - f.reserved), spent_rungs = p.spent_rungs + f.spent
          FROM (SELECT project_id, sum(budget_rungs) AS reserved, sum(used_rungs) AS spent FROM gone
                 GROUP BY project_id ORDER BY project_id) f
         WHERE p.id = f.project_id AND p.id = ANY (ARRAY(SELECT project_id FROM gone))
    )
    SELECT count(*) FROM gone;
$$;
-- +goose StatementEnd

-- return_rate: as in 00007, the windows updated by key.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION return_rate(p_keys uuid[], p_windows timestamptz[], p_counts integer[]) RETURNS void LANGUAGE sql AS $$
    UPDATE rate_windows w SET count = greatest(0, w.count - r.n)
      FROM (SELECT k, ws, sum(n)::integer AS n FROM unnest(p_keys, p_windows, p_counts) AS u(k, ws, n)
             GROUP BY k, ws ORDER BY k, ws) r
     WHERE w.key_id = r.k AND w.window_start = r.ws
       AND w.key_id = ANY (p_keys) AND w.window_start = ANY (p_windows);
$$;
-- +goose StatementEnd

-- reconcile_settlements: as in 00011. Folding one account's settlements (as
-- the reconciler does, account by account, after a failure) reads that
-- account's by key: the account is a range of the index (every account when
-- none is named), where a plan shared by both cases read the whole index with
-- the account as a filter.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconcile_settlements(p_max integer, p_skip uuid[], p_account uuid) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v     record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT array_agg(s.id) INTO v_ids FROM (
        SELECT s.id FROM batch_settlements s
         WHERE s.account_id BETWEEN coalesce(p_account, '00000000-0000-0000-0000-000000000000')
                                AND coalesce(p_account, 'ffffffff-ffff-ffff-ffff-ffffffffffff')
           AND NOT (s.account_id = ANY (coalesce(p_skip, '{}')))
         ORDER BY s.account_id, s.day, s.project_id
         LIMIT p_max
         FOR UPDATE SKIP LOCKED) s;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    FOR v IN SELECT s.account_id, s.day, sum(s.day_rungs) AS delta
               FROM batch_settlements s WHERE s.id = ANY (v_ids)
              GROUP BY s.account_id, s.day ORDER BY s.account_id, s.day
    LOOP
        INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (v.account_id, v.day, v.delta)
        ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    END LOOP;
    FOR v IN SELECT s.project_id, sum(s.reserved_rungs) AS reserved, sum(s.spent_rungs) AS spent
               FROM batch_settlements s WHERE s.id = ANY (v_ids)
              GROUP BY s.project_id ORDER BY s.project_id
    LOOP
        UPDATE projects SET reserved_rungs = reserved_rungs - v.reserved, spent_rungs = spent_rungs + v.spent
         WHERE id = v.project_id;
    END LOOP;
    DELETE FROM batch_settlements s WHERE s.id = ANY (v_ids);
    RETURN cardinality(v_ids);
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00019.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00021 cannot be reverted'; END $$;
-- +goose StatementEnd
