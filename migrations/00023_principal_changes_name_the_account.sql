-- +goose Up
-- notify_principals_changed: as in 00007, the payload names the account whose
-- key, account row or project changed ("table:account id"), so that a replica
-- drops that account's cached keys and quota slices, not every tenant's (each
-- of whom then paid a look-up and a grant before dispatch, every time any
-- tenant's limits changed). Replicas of the previous release compare the
-- payload with the table's name alone: they drop everything, as before, and
-- take a key's change for a change of limits, which costs them only slices.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION notify_principals_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_account uuid;
BEGIN
    IF TG_TABLE_NAME = 'accounts' THEN
        v_account := NEW.id;
    ELSIF TG_TABLE_NAME = 'projects' THEN
        v_account := NEW.account_id;
    ELSE
        SELECT p.account_id INTO v_account FROM projects p WHERE p.id = NEW.project_id;
    END IF;
    PERFORM pg_notify('gateway_principals', TG_TABLE_NAME || ':' || coalesce(v_account::text, ''));
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION notify_principals_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('gateway_principals', TG_TABLE_NAME);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
