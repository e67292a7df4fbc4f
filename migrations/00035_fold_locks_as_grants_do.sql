-- +goose Up
-- fold_quota_leases locks what it changes in the order every other statement
-- that changes both locks it: the leases, then the account-days, then the
-- projects, each in key order. As one statement (00021), PostgreSQL ran its
-- update of the projects before the update of the account-days (a statement's
-- secondary updates run in the reverse of their order in the text), so a fold
-- could hold a project and wait for its account-day while a grant of the same
-- tenant held the account-day and waited for the project: a deadlock, which
-- PostgreSQL ends after a second by failing one of the two. A failed fold left
-- its slices away until their lease ran out.
--
-- The leases are found and deleted as in 00021; the rows they fold into are
-- then locked in key order (a locking SELECT sorts before it locks, where an
-- UPDATE ... FROM locks in the order of its join) and updated by key.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fold_quota_leases(p_owner uuid, p_ids uuid[], p_expired integer, p_skip uuid[]) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_gone quota_leases[];
BEGIN
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
    )
    SELECT array_agg(g) INTO v_gone FROM gone g;
    IF v_gone IS NULL THEN
        RETURN 0;
    END IF;

    PERFORM 1 FROM daily_charges d
     WHERE d.account_id = ANY (ARRAY(SELECT g.account_id FROM unnest(v_gone) g))
       AND d.day = ANY (ARRAY(SELECT g.day FROM unnest(v_gone) g))
       AND (d.account_id, d.day) IN (SELECT g.account_id, g.day FROM unnest(v_gone) g)
     ORDER BY d.account_id, d.day FOR NO KEY UPDATE;
    UPDATE daily_charges d SET charged_rungs = greatest(0, d.charged_rungs + f.delta)
      FROM (SELECT g.account_id, g.day, sum(g.used_rungs - g.daily_rungs) AS delta FROM unnest(v_gone) g
             GROUP BY g.account_id, g.day) f
     WHERE d.account_id = f.account_id AND d.day = f.day
       AND d.account_id = ANY (ARRAY(SELECT g.account_id FROM unnest(v_gone) g))
       AND d.day = ANY (ARRAY(SELECT g.day FROM unnest(v_gone) g));

    PERFORM 1 FROM projects p
     WHERE p.id = ANY (ARRAY(SELECT g.project_id FROM unnest(v_gone) g))
     ORDER BY p.id FOR NO KEY UPDATE;
    UPDATE projects p SET reserved_rungs = greatest(0, p.reserved_rungs - f.reserved), spent_rungs = p.spent_rungs + f.spent
      FROM (SELECT g.project_id, sum(g.budget_rungs) AS reserved, sum(g.used_rungs) AS spent FROM unnest(v_gone) g
             GROUP BY g.project_id) f
     WHERE p.id = f.project_id AND p.id = ANY (ARRAY(SELECT g.project_id FROM unnest(v_gone) g));
    RETURN cardinality(v_gone);
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00021: the function before this one deadlocks with grants.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00035 cannot be reverted'; END $$;
-- +goose StatementEnd
