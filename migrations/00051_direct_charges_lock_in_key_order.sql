-- +goose Up
-- charge_directly (00032) locks the projects it charges in key order, as the
-- claim of batch items, the fold of quota leases (00035) and the
-- reconciliation do. Its UPDATE ... FROM locked them in the order of its
-- join, not of the sorted expression it joins: over a small projects table,
-- in the order of the rows in the heap, which every update of a project
-- changes. A settlement charging two projects directly (requests of two
-- tenants whose leases were folded while they ran) could then hold one and
-- wait for the other while a claim held the other and waited for it: a
-- deadlock, which PostgreSQL ends after a second by failing one of the two.
-- The account-days keep their order (an INSERT ... SELECT ... ORDER BY
-- inserts, and locks, in its order); the projects are now locked by a
-- locking SELECT, which sorts before it locks, and then updated by key.
-- Same signature, in an instant: the replicas of the previous release call
-- it too.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION charge_directly(p_account_ids uuid[], p_days date[], p_project_ids uuid[], p_costs bigint[])
RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs)
    SELECT c.account_id, c.day, sum(c.cost)
      FROM unnest(p_account_ids, p_days, p_costs) AS c(account_id, day, cost)
     GROUP BY c.account_id, c.day ORDER BY c.account_id, c.day
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    PERFORM 1 FROM projects p WHERE p.id = ANY (p_project_ids) ORDER BY p.id FOR NO KEY UPDATE;
    UPDATE projects p SET spent_rungs = p.spent_rungs + s.cost
      FROM (SELECT c.project_id, sum(c.cost) AS cost FROM unnest(p_project_ids, p_costs) AS c(project_id, cost)
             GROUP BY c.project_id) s
     WHERE p.id = s.project_id AND p.id = ANY (p_project_ids);
    RETURN cardinality(p_costs);
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00035: the function before this one deadlocks with claims.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00051 cannot be reverted'; END $$;
-- +goose StatementEnd
