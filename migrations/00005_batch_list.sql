-- +goose Up
-- The batch list pages by id (UUIDv7, creation order) within an account.
CREATE INDEX batches_account_id_idx ON batches (account_id, id DESC);

-- +goose Down
DROP INDEX batches_account_id_idx;
