-- +goose Up
-- The planner's count of distinct batches among batch_items comes from
-- ANALYZE's sample, and it keeps it as a number, not as a share of the rows,
-- when batches have many items each: taken after the first 20 batches (a
-- drain's warm-up), it held 20 while the batches grew to 220, so each batch
-- looked like a tenth of the table, and the drainer's check for a batch's
-- unfinished items (DoneBatches) scanned the whole table instead of the
-- batch's items (2,000 buffers, 5 ms a call, a third of the drain's time in
-- PostgreSQL). A batch holds at most 100 items: the batches are at least a
-- hundredth of the rows, whatever the sample says. Set as the column's
-- statistics option (ANALYZE keeps it), and analyzed now so it holds at once.
ALTER TABLE batch_items ALTER COLUMN batch_id SET (n_distinct = -0.01);
ANALYZE batch_items;

-- +goose Down
ALTER TABLE batch_items ALTER COLUMN batch_id RESET (n_distinct);
ANALYZE batch_items;
