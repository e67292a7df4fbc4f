-- +goose Up
-- Drops what earlier migrations retired and kept one release for the replicas
-- of the release before them, which no replica of the last release calls: the
-- batch items' reservations table (empty since 00011) with its trigger and the
-- job that released lapsed reservations; settle_requests (00007, replaced by
-- the store's own settlement statement); admit_batch and the charge_daily it
-- called (replaced by admit_batches, 00034).
--
-- Dropping reservations drops its foreign keys, whose triggers live on
-- accounts and projects: it takes an exclusive lock on both for an instant,
-- which waits for the transactions using them (settlements, grants: short)
-- and holds off new ones meanwhile. Rather than hold them up behind a long
-- one, the migration gives up after five seconds without its locks
-- (lock_timeout: the replica does not start, and the next start tries again).
SET LOCAL lock_timeout = '5s';
DROP TABLE reservations;
DROP FUNCTION ignore_retired_write();
DROP FUNCTION release_expired_reservations(integer);
DROP FUNCTION settle_requests(jsonb);
DROP FUNCTION admit_batch(uuid, date, bigint, bigint);
DROP FUNCTION charge_daily(uuid, date, bigint, bigint);

-- +goose Down
-- Forward only, like 00011.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00038 cannot be reverted'; END $$;
-- +goose StatementEnd
