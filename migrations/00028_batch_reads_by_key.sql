-- +goose Up
-- A client's reads of a batch and of its results, by key whatever the size
-- and statistics of the batch tables. As prepared statements, they were
-- planned generically after a few calls and kept those plans until the next
-- ANALYZE: made while the tables were tiny, they read the whole batches and
-- items tables on every call once a burst had grown them (28-35 ms a poll
-- among 3,000 batches of 100 items, BenchmarkBatchReadsAfterABurst). The
-- other statements on the batch tables are planned for each call instead
-- (store.plannedPerCall); these are sent on every poll, and a plan a call
-- would double the cost of one. A plan made for the call would also take the
-- items of a batch that an ANALYZE of the tiny table sampled for most of the
-- table, until the next one. Functions planned with sequential scans off
-- keep their plans for the session and read by key (as done_batches, 00026).
-- +goose StatementBegin
-- batch_of_account: the batch p_id if the account p_account_id owns it.
CREATE FUNCTION batch_of_account(p_id uuid, p_account_id uuid) RETURNS SETOF batches
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY SELECT b.* FROM batches b WHERE b.id = p_id AND b.account_id = p_account_id;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- items_of_batch: the items of the batch p_batch_id.
CREATE FUNCTION items_of_batch(p_batch_id uuid) RETURNS SETOF batch_items
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY SELECT i.* FROM batch_items i WHERE i.batch_id = p_batch_id;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- batch_item_totals: a batch's items counted by outcome, and their usage.
CREATE FUNCTION batch_item_totals(p_batch_id uuid)
RETURNS TABLE (completed integer, failed integer, cancelled integer, input_rungs bigint, output_rungs bigint, total_rungs bigint)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    SELECT count(*) FILTER (WHERE i.status = 'completed')::integer,
           count(*) FILTER (WHERE i.status = 'failed')::integer,
           count(*) FILTER (WHERE i.status = 'cancelled')::integer,
           coalesce(sum(i.input_rungs), 0)::bigint,
           coalesce(sum(i.output_rungs), 0)::bigint,
           coalesce(sum(i.total_rungs), 0)::bigint
      FROM batch_items i WHERE i.batch_id = p_batch_id;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION batch_item_totals(uuid);
DROP FUNCTION items_of_batch(uuid);
DROP FUNCTION batch_of_account(uuid, uuid);
