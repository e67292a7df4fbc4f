-- name: CreateFloorTable :exec
-- The bare proxy's table (see floor.go), made at its start: this file is
-- both the schema sqlc reads and the queries it compiles.
CREATE TABLE IF NOT EXISTS bench_floor (
    request_id   uuid PRIMARY KEY,
    total_tokens bigint NOT NULL,
    completed_at timestamptz NOT NULL
);

-- name: InsertFloorRow :exec
-- A row a request, committed before the reply, as any gateway that bills
-- what it answers must commit something.
INSERT INTO bench_floor (request_id, total_tokens, completed_at) VALUES (@request_id, @total_tokens, now());
