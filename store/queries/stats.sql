-- name: DatabaseActivity :one
-- Transactions committed in this database so far, and WAL flushes and records
-- of the server.
SELECT pg_stat_get_db_xact_commit((SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database()))::bigint AS commits,
       w.wal_sync::bigint AS wal_syncs, w.wal_records::bigint AS wal_records
FROM pg_stat_get_wal() AS w;

-- name: AnalyzeQueue :exec
-- Takes the statistics of the batch tables now, as autovacuum does after a
-- drain, when every item has finished (bench/drain).
ANALYZE batches, batch_items;

-- name: DatabaseTime :one
-- The database's clock now (not the transaction's start).
SELECT clock_timestamp()::timestamptz AS now;

-- name: AcceptsWrites :one
-- Whether the database takes writes: not a standby (a replica in recovery,
-- as a failover may leave a connection on), nor set read-only.
SELECT NOT current_setting('transaction_read_only')::boolean AS accepts_writes;
