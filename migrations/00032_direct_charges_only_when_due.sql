-- +goose Up
-- charge_directly: the part of a settlement (the statement SettleRequests)
-- for requests whose quota leases are gone (folded while they ran, after
-- their replica lost the database past the lease) or that had none: their
-- cost goes on their account-day and on their project directly, as the
-- statement's own two modifying expressions did. Nearly every settlement's
-- leases are held, yet PostgreSQL prepared those two expressions on every
-- execution (opening daily_charges, projects and their indexes): an eighth of
-- the statement's time. Called from the statement only when such requests
-- exist, the function is not prepared otherwise. Locks in the same order as
-- before: account-days by key, then projects by key.
-- +goose StatementBegin
CREATE FUNCTION charge_directly(p_account_ids uuid[], p_days date[], p_project_ids uuid[], p_costs bigint[])
RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs)
    SELECT c.account_id, c.day, sum(c.cost)
      FROM unnest(p_account_ids, p_days, p_costs) AS c(account_id, day, cost)
     GROUP BY c.account_id, c.day ORDER BY c.account_id, c.day
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs + EXCLUDED.charged_rungs;
    UPDATE projects p SET spent_rungs = p.spent_rungs + s.cost
      FROM (SELECT c.project_id, sum(c.cost) AS cost FROM unnest(p_project_ids, p_costs) AS c(project_id, cost)
             GROUP BY c.project_id ORDER BY c.project_id) s
     WHERE p.id = s.project_id AND p.id = ANY (p_project_ids);
    RETURN cardinality(p_costs);
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION charge_directly(uuid[], date[], uuid[], bigint[]);
