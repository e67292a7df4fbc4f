-- +goose Up
-- claim_batch_items: planned with sequential scans off. A connection keeps
-- the plans of a function's statements for the session, and the claim's
-- statement is planned generically once it has run a few times. When that
-- happened while few batches were open, and known to be (an ANALYZE taken
-- then: a table of one page), the planner found each account's oldest open
-- batch by scanning and sorting the whole table, not by the index of open
-- batches; as the table grows, the statement is not planned again until the
-- table's next ANALYZE.
-- In bursts of 3,000 batches over 300 accounts, four runs in nineteen were
-- caught so: each claim read every open batch for each account it looked at
-- (over 8 ms a claim instead of about 2), and the drain ran at half its pace
-- (2,721-3,333 items/s, PostgreSQL 0.30-0.34 ms an item, against 5,356-6,875
-- and 0.12-0.16) for over a minute, until autovacuum analyzed the tables.
-- Every read of the claim has an index made for it, so no plan the claim
-- wants needs a sequential scan, whatever the statistics say (as
-- done_batches, 00026). A later CREATE OR REPLACE of the function drops the
-- setting unless it states it again.
ALTER FUNCTION claim_batch_items(uuid, integer, integer, interval, uuid, uuid, text[]) SET enable_seqscan = off;

-- +goose Down
ALTER FUNCTION claim_batch_items(uuid, integer, integer, interval, uuid, uuid, text[]) RESET enable_seqscan;
