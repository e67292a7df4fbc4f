-- +goose Up
-- renew_quota_leases (00007) and return_rate (00021) lock their rows in key
-- order, as the fold of quota leases (00035) and the settlement's statement
-- do. Their UPDATEs locked them in the order of their plans: over a table of
-- a few hundred rows, a scan of the heap, whose order every update of a row
-- changes. A renewal of a replica's leases could then hold one and wait for
-- another that a settlement of the same replica held while it waited for the
-- first; two replicas returning unused rate slices of the same keys could do
-- the same to each other. PostgreSQL ends such a deadlock after a second by
-- failing one of the two. The rows are now locked first by a locking SELECT,
-- which sorts before it locks, and then updated. Same signatures, in an
-- instant: the replicas of the previous release call them too.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION renew_quota_leases(p_owner uuid, p_ids uuid[], p_expires_at timestamptz)
RETURNS SETOF uuid LANGUAGE sql AS $$
    SELECT 1 FROM quota_leases WHERE id = ANY (p_ids) AND owner = p_owner ORDER BY id FOR NO KEY UPDATE;
    UPDATE quota_leases SET expires_at = p_expires_at
     WHERE id = ANY (p_ids) AND owner = p_owner
    RETURNING id;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION return_rate(p_keys uuid[], p_windows timestamptz[], p_counts integer[]) RETURNS void LANGUAGE sql AS $$
    SELECT 1 FROM rate_windows w
     WHERE (w.key_id, w.window_start) IN (SELECT u.k, u.ws FROM unnest(p_keys, p_windows) AS u(k, ws))
       AND w.key_id = ANY (p_keys) AND w.window_start = ANY (p_windows)
     ORDER BY w.key_id, w.window_start FOR NO KEY UPDATE OF w;
    UPDATE rate_windows w SET count = greatest(0, w.count - r.n)
      FROM (SELECT k, ws, sum(n)::integer AS n FROM unnest(p_keys, p_windows, p_counts) AS u(k, ws, n)
             GROUP BY k, ws) r
     WHERE w.key_id = r.k AND w.window_start = r.ws
       AND w.key_id = ANY (p_keys) AND w.window_start = ANY (p_windows);
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00051: the functions before these deadlock.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00052 cannot be reverted'; END $$;
-- +goose StatementEnd
