-- +goose Up
-- admit_batches charges the estimates of several batches of one account to
-- its day, in the order given, as admit_batch would one after another: each
-- is charged when what the day has left covers it, and refused otherwise
-- ('daily', or 'daily_never' when it is larger than the whole ceiling), and
-- the ones after it are still tried. It returns the outcome of each. The
-- account-day row is locked once and updated once, however many batches: a
-- replica stores the creations of one account that arrive together in one
-- transaction (see the store's creation groups) instead of one transaction
-- and one wait on this row each.
-- +goose StatementBegin
CREATE FUNCTION admit_batches(p_account_id uuid, p_day date, p_default_ceilings bigint[], p_estimates bigint[])
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_account_ceiling bigint;
    v_ceiling bigint;
    v_charged bigint;
    v_added bigint := 0;
    v_outcomes text[] := '{}';
BEGIN
    SELECT a.daily_rung_ceiling INTO v_account_ceiling FROM accounts a WHERE a.id = p_account_id;
    INSERT INTO daily_charges AS d (account_id, day, charged_rungs) VALUES (p_account_id, p_day, 0)
    ON CONFLICT (account_id, day) DO UPDATE SET charged_rungs = d.charged_rungs
    RETURNING d.charged_rungs INTO v_charged;
    FOR i IN 1 .. coalesce(cardinality(p_estimates), 0) LOOP
        v_ceiling := coalesce(v_account_ceiling, p_default_ceilings[i]);
        IF p_estimates[i] > v_ceiling THEN
            v_outcomes := v_outcomes || 'daily_never'::text;
        ELSIF v_charged + v_added > v_ceiling - p_estimates[i] THEN
            v_outcomes := v_outcomes || 'daily'::text;
        ELSE
            v_added := v_added + p_estimates[i];
            v_outcomes := v_outcomes || 'ok'::text;
        END IF;
    END LOOP;
    IF v_added > 0 THEN
        UPDATE daily_charges SET charged_rungs = charged_rungs + v_added WHERE account_id = p_account_id AND day = p_day;
    END IF;
    RETURN v_outcomes;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION admit_batches(uuid, date, bigint[], bigint[]);
