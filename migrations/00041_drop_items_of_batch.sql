-- +goose Up
-- Drops items_of_batch (00028), which 00040 retired and kept one release for
-- the replicas of the release before: no replica of the last release calls
-- it (a batch's results are read a page at a time, items_of_batch_after).
DROP FUNCTION items_of_batch(uuid);

-- +goose Down
-- +goose StatementBegin
CREATE FUNCTION items_of_batch(p_batch_id uuid) RETURNS SETOF batch_items
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY SELECT i.* FROM batch_items i WHERE i.batch_id = p_batch_id;
END;
$$;
-- +goose StatementEnd
