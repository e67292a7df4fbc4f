-- +goose Up
-- batch_items is a queue: every drained item leaves two dead row versions (its
-- claim and its completion), and their entries stay at the front of the claim
-- index, where every claim starts reading, until a vacuum removes them. In a
-- run of 300,000 items a claim went from 1.5 ms to 12.8 ms and the drain from
-- 3,200 to 1,200 items/s before autovacuum came by. By default a table is
-- vacuumed once a fifth of it is dead: for a queue that keeps weeks of
-- finished items, hundreds of thousands of dead versions. Vacuum it once
-- 10,000 are, unthrottled (the autovacuum launcher still visits a database at
-- most once per autovacuum_naptime, a minute by default).
ALTER TABLE batch_items SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
                             autovacuum_vacuum_cost_delay = 0);

-- +goose Down
ALTER TABLE batch_items RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                               autovacuum_vacuum_cost_delay);
