-- +goose Up
-- requeue_batch_items: as in 00017, but the batch's status, which decides
-- between the queue and cancelled, is read under a share lock on the batch's
-- row, taken with the items' locks. A cancel holds its batch's row while it
-- cancels the queued items, so an item handed back meanwhile waits for it,
-- reads "cancelling" and is cancelled, instead of going back to the queue of a
-- batch that no claim would drain again (00017 read the status without a
-- lock).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION requeue_batch_items(p_owner uuid, p_batch_ids uuid[], p_idxs integer[], p_claim_id uuid)
RETURNS TABLE (batch_id uuid, idx integer, status text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_batches  uuid[];
    v_indexes  integer[];
    v_statuses text[];
BEGIN
    IF p_claim_id IS NULL THEN
        SELECT array_agg(x.batch_id), array_agg(x.idx), array_agg(x.status) INTO v_batches, v_indexes, v_statuses FROM (
            SELECT i.batch_id, i.idx, b.status FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx)
              JOIN batch_items i ON i.batch_id = k.batch_id AND i.idx = k.idx
              JOIN batches b ON b.id = i.batch_id
             WHERE i.status = 'in_progress'
               AND i.lease_owner IS NOT DISTINCT FROM p_owner -- no index condition: see above
             ORDER BY i.batch_id, i.idx
             FOR UPDATE OF i FOR KEY SHARE OF b) x;
    ELSE
        SELECT array_agg(x.batch_id), array_agg(x.idx), array_agg(x.status) INTO v_batches, v_indexes, v_statuses FROM (
            SELECT i.batch_id, i.idx, b.status FROM batch_items i
              JOIN batches b ON b.id = i.batch_id
             WHERE i.status = 'in_progress' AND i.lease_owner = p_owner
               AND ((i.batch_id, i.idx) IN (SELECT k.batch_id, k.idx FROM unnest(p_batch_ids, p_idxs) AS k(batch_id, idx))
                    OR i.claim_id = p_claim_id)
             ORDER BY i.batch_id, i.idx
             FOR UPDATE OF i FOR KEY SHARE OF b) x;
    END IF;

    RETURN QUERY
    WITH mine AS (
        SELECT k.batch_id, k.idx, k.status IN ('queued', 'in_progress') AS requeue,
               CASE WHEN k.status = 'expired' THEN 'expiry' ELSE 'owner' END AS reason
          FROM unnest(v_batches, v_indexes, v_statuses) AS k(batch_id, idx, status)
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
DO $$ BEGIN RAISE EXCEPTION 'migration 00018 cannot be reverted'; END $$;
-- +goose StatementEnd
