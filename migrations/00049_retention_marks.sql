-- +goose Up
-- Where the pass over usage past the retention (migration 00048) goes on in
-- each account: every request of the account completed before requests_from
-- is folded into usage_days, and every folded sum by minute of a minute
-- before minutes_from removed. The pass reads each account's oldest rows
-- from there, not from the start of its range in the index: the entries of
-- the rows it removed stay in the index until a vacuum (every fifth of the
-- table by default, days of removals on a large one), and a read from the
-- start went through all of them each time.
CREATE TABLE retention_marks (
    account_id    uuid PRIMARY KEY,
    requests_from timestamptz,
    minutes_from  timestamptz
);

-- +goose Down
DROP TABLE retention_marks;
