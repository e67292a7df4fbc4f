-- +goose Up
-- The usage view summed every request of its period, read one by one through
-- (account_id, completed_at): its cost grew with the requests of the period,
-- all day long for the default period (a day of a tenant at 1,000 requests a
-- second is 86 million rows). usage_minutes holds the same sums by account,
-- UTC minute of completion and model, and usage_hours by hour, so a period
-- reads a row for each of its hours (and each model), the minutes of the
-- hours at its two ends, and the requests themselves only for the parts of
-- a minute at its two ends.
--
-- A statement trigger on requests adds every statement's rows to their
-- minutes, in the statement's transaction: the sums are exact by
-- construction, whichever release of the gateway inserted the rows (the
-- store's settlement statement, complete_batch_items). The rows a statement
-- adds go to rows of its own server process (backend): two settlements of
-- the same account and minute on two connections never wait for each other
-- on one row (hot rows serialize). A maintenance job folds the rows of past
-- minutes into one a minute and model (backend 0), and adds what it folds to
-- usage_hours, the same sums by hour: an hour's row there is always the sum
-- of its minutes' backend-0 rows, so a period reads its whole hours from
-- there (and the rows of those hours not yet folded). The trigger costs a
-- settlement about 40 µs of the server's CPU (140 to 180 µs for one request,
-- BenchmarkMeteringAmongTenants), a statement of many rows hardly more.
--
-- Existing requests are summed once, below, while inserts into requests wait
-- (the lock is taken first, so none slips between the sum and the trigger):
-- one to two seconds a million requests on the machines measured (two for a
-- million accounts of one request each). Rather than hold settlements up
-- behind a long transaction, the migration gives up after five seconds
-- without its lock (the replica does not start, and the next start tries
-- again).
SET LOCAL lock_timeout = '5s';
LOCK TABLE requests IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE usage_minutes (
    account_id   uuid NOT NULL,
    minute       timestamptz NOT NULL,
    model        text NOT NULL,
    backend      integer NOT NULL,
    requests     bigint NOT NULL,
    input_rungs  bigint NOT NULL,
    output_rungs bigint NOT NULL,
    total_rungs  bigint NOT NULL,
    PRIMARY KEY (account_id, minute, model, backend)
);
-- The rows still to fold, by minute (for the fold) and by account (for the
-- view): few, whatever the table's size.
CREATE INDEX usage_minutes_unfolded_idx ON usage_minutes (minute) WHERE backend <> 0;
CREATE INDEX usage_minutes_unfolded_account_idx ON usage_minutes (account_id, minute) WHERE backend <> 0;

CREATE TABLE usage_hours (
    account_id   uuid NOT NULL,
    hour         timestamptz NOT NULL,
    model        text NOT NULL,
    requests     bigint NOT NULL,
    input_rungs  bigint NOT NULL,
    output_rungs bigint NOT NULL,
    total_rungs  bigint NOT NULL,
    PRIMARY KEY (account_id, hour, model)
);

-- +goose StatementBegin
CREATE FUNCTION add_usage_minutes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_minutes AS m (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
    SELECT a.account_id, date_bin('1 minute', a.completed_at, '2000-01-01 00:00Z'), a.model, pg_backend_pid(),
           count(*), sum(a.input_rungs), sum(a.output_rungs), sum(a.total_rungs)
      FROM added a
     GROUP BY 1, 2, 3
    ON CONFLICT (account_id, minute, model, backend) DO UPDATE
       SET requests = m.requests + EXCLUDED.requests,
           input_rungs = m.input_rungs + EXCLUDED.input_rungs,
           output_rungs = m.output_rungs + EXCLUDED.output_rungs,
           total_rungs = m.total_rungs + EXCLUDED.total_rungs;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER requests_add_usage_minutes AFTER INSERT ON requests
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION add_usage_minutes();

INSERT INTO usage_minutes (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
SELECT account_id, date_bin('1 minute', completed_at, '2000-01-01 00:00Z'), model, 0,
       count(*), sum(input_rungs), sum(output_rungs), sum(total_rungs)
  FROM requests
 GROUP BY 1, 2, 3;
INSERT INTO usage_hours (account_id, hour, model, requests, input_rungs, output_rungs, total_rungs)
SELECT account_id, date_bin('1 hour', minute, '2000-01-01 00:00Z'), model,
       sum(requests), sum(input_rungs), sum(output_rungs), sum(total_rungs)
  FROM usage_minutes
 GROUP BY 1, 2, 3;

-- +goose Down
-- Forward only, like 00038: the view of this release reads usage_minutes.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00039 cannot be reverted'; END $$;
-- +goose StatementEnd
