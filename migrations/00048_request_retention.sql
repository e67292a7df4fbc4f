-- +goose Up
-- Requests were kept forever: a tenant at 1,000 requests a second adds 86
-- million rows a day. A maintenance job now removes the requests completed
-- before the request retention (GATEWAY_REQUEST_RETENTION) and, in the same
-- statement, adds them to usage_days: their sums by account, UTC day of
-- completion, project, model and entry point, what the operator's usage
-- report (`gateway usage`) reads besides the requests still kept. A request
-- is in one or the other, never both, so the report stays exact. The usage
-- view reads its sums by hour (migration 00039), which stay; its sums by
-- minute as old are removed by another job, their hours holding them. As
-- those sums, usage_days refers to accounts and projects without foreign
-- keys: they are never deleted (migration 00007).
CREATE TABLE usage_days (
    account_id   uuid NOT NULL,
    day          date NOT NULL,
    project_id   uuid NOT NULL,
    model        text NOT NULL,
    entry_point  text NOT NULL,
    requests     bigint NOT NULL,
    input_rungs  bigint NOT NULL,
    output_rungs bigint NOT NULL,
    total_rungs  bigint NOT NULL,
    PRIMARY KEY (account_id, day, project_id, model, entry_point)
);

-- +goose Down
-- Forward only, like 00039: the requests folded into usage_days are gone.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00048 cannot be reverted'; END $$;
-- +goose StatementEnd
