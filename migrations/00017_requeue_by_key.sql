-- +goose Up
-- requeue_batch_items: as in 00011, but items named by their keys (an item the
-- upstream never processed, handed back; many of them in an outage) are found
-- by those keys, the owner checked so that no index serves it, as the
-- completion does since 00016: the lease owner's index holds an entry for
-- every item the owner ran until the table is vacuumed. Only the items of a
-- lost claim are found through it. The items are locked first, in key order,
-- then handed back.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION requeue_batch_items(p_owner uuid, p_batch_ids uuid[], p_idxs integer[], p_claim_id uuid)
RETURNS TABLE (batch_id uuid, idx integer, status text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_batches uuid[];
    v_indexes integer[];
BEGIN
    IF p_claim_id IS NULL THEN
        SELECT array_agg(x.batch_id), array_agg(x.idx) INTO v_batches, v_indexes FROM (
            SELECT i.batch_id, i.idx FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx)
              JOIN batch_items i ON i.batch_id = k.batch_id AND i.idx = k.idx
             WHERE i.status = 'in_progress'
               AND i.lease_owner IS NOT DISTINCT FROM p_owner -- no index condition: see above
             ORDER BY i.batch_id, i.idx
             FOR UPDATE OF i) x;
    ELSE
        SELECT array_agg(x.batch_id), array_agg(x.idx) INTO v_batches, v_indexes FROM (
            SELECT i.batch_id, i.idx FROM batch_items i
             WHERE i.status = 'in_progress' AND i.lease_owner = p_owner
               AND ((i.batch_id, i.idx) IN (SELECT k.batch_id, k.idx FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx))
                    OR i.claim_id = p_claim_id)
             ORDER BY i.batch_id, i.idx
             FOR UPDATE OF i) x;
    END IF;

    RETURN QUERY
    WITH mine AS (
        SELECT k.batch_id, k.idx, b.status IN ('queued', 'in_progress') AS requeue,
               CASE WHEN b.status = 'expired' THEN 'expiry' ELSE 'owner' END AS reason
          FROM unnest(v_batches, v_indexes) AS k(batch_id, idx) JOIN batches b ON b.id = k.batch_id
    )
    UPDATE batch_items i
       SET status = CASE WHEN m.requeue THEN 'queued' ELSE 'cancelled' END,
           lease_owner = NULL, lease_expires_at = NULL, reserved_rungs = 0,
           started_at = CASE WHEN m.requeue THEN NULL ELSE i.started_at END,
           claim_id = CASE WHEN m.requeue THEN NULL ELSE i.claim_id END,
           cancel_reason = CASE WHEN m.requeue THEN NULL ELSE m.reason END,
           completed_at = CASE WHEN m.requeue THEN NULL ELSE now() END
      FROM mine m
     WHERE i.batch_id = m.batch_id AND i.idx = m.idx
    RETURNING i.batch_id, i.idx, i.status;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00011.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00017 cannot be reverted'; END $$;
-- +goose StatementEnd
