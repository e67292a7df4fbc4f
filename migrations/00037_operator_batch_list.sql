-- +goose Up
-- +goose StatementBegin
-- batches_for_operator: up to p_max batches of every account, or of the
-- account named p_account, newest first, only those whose status is among
-- p_statuses when it is given (gateway batches list). Read by key, newest
-- first, whatever the size and statistics of the batches table (as the
-- reads of 00028): planned while it was tiny, the list read it whole and
-- sorted it (its optional filters, planned generically, cannot use an index).
CREATE FUNCTION batches_for_operator(p_account text, p_statuses text[], p_max integer) RETURNS SETOF batches
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    IF p_account IS NULL THEN
        RETURN QUERY SELECT b.* FROM batches b
            WHERE p_statuses IS NULL OR b.status = ANY (p_statuses)
            ORDER BY b.id DESC LIMIT p_max;
    ELSE
        RETURN QUERY SELECT b.* FROM batches b
            WHERE b.account_id = (SELECT a.id FROM accounts a WHERE a.name = p_account)
              AND (p_statuses IS NULL OR b.status = ANY (p_statuses))
            ORDER BY b.id DESC LIMIT p_max;
    END IF;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION batches_for_operator(text, text[], integer);
