-- +goose Up
-- +goose StatementBegin
-- batches_for_operator_page is batches_for_operator (00037) with a cursor:
-- only batches whose id is below p_before, when it is given, so that a list
-- can go on past its first page (gateway batches cancel --account, which
-- must reach every batch of an account however many fail to cancel). The
-- cursor is an index condition, NULL standing for the largest uuid, so that
-- a page further down is read by key as the first is. batches_for_operator
-- stays for the release before, whose commands call it.
CREATE FUNCTION batches_for_operator_page(p_account text, p_statuses text[], p_before uuid, p_max integer) RETURNS SETOF batches
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    v_before uuid := coalesce(p_before, 'ffffffff-ffff-ffff-ffff-ffffffffffff');
BEGIN
    IF p_account IS NULL THEN
        RETURN QUERY SELECT b.* FROM batches b
            WHERE b.id < v_before AND (p_statuses IS NULL OR b.status = ANY (p_statuses))
            ORDER BY b.id DESC LIMIT p_max;
    ELSE
        RETURN QUERY SELECT b.* FROM batches b
            WHERE b.account_id = (SELECT a.id FROM accounts a WHERE a.name = p_account)
              AND b.id < v_before
              AND (p_statuses IS NULL OR b.status = ANY (p_statuses))
            ORDER BY b.id DESC LIMIT p_max;
    END IF;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION batches_for_operator_page(text, text[], uuid, integer);
