-- +goose Up
-- A read of a batch's results a page at a time, so that the reply is written
-- as it is read and a replica never holds a whole batch's texts (up to 100
-- items of a model's longest output) at once. By key, whatever the
-- statistics, as items_of_batch (00028), which replicas of the release before
-- still call while a rolling upgrade runs.
-- +goose StatementBegin
-- items_of_batch_after: the items of the batch p_batch_id of the account
-- p_account_id after index p_after, in index order, as many as fit in
-- p_max_bytes of content (at least one). The sizes are read from the stored
-- values' headers: nothing is decompressed to count them.
CREATE FUNCTION items_of_batch_after(p_batch_id uuid, p_account_id uuid, p_after integer, p_max_bytes bigint)
RETURNS SETOF batch_items
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY SELECT (s.i).* FROM (
        SELECT i, sum(coalesce(octet_length(i.content), 0)) OVER (ORDER BY i.idx) - coalesce(octet_length(i.content), 0) AS before
          FROM batch_items i
         WHERE i.batch_id = p_batch_id AND i.idx > p_after AND i.account_id = p_account_id) s
     WHERE s.before < p_max_bytes
     ORDER BY (s.i).idx;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION items_of_batch_after(uuid, uuid, integer, bigint);
