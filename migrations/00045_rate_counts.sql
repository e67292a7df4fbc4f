-- +goose Up
-- lease_rate_counts is lease_rate (00007) that also returns the two counts it
-- weighs: the key's previous minute and its current minute after the grant.
-- From them a replica tells a refused request when the sliding window admits
-- one again (its Retry-After). The end of the current minute, which it said
-- before, is too soon after a burst, which still weighs whole as the minute
-- turns, and most of a minute too late when the minute before is what
-- weighs. lease_rate stays for the replicas of the release before, which
-- call it, until a later migration drops it as 00038 did others.
-- +goose StatementBegin
CREATE FUNCTION lease_rate_counts(p_key_id uuid, p_now timestamptz, p_limit integer, p_share integer)
RETURNS TABLE (granted integer, used double precision, previous_count integer, current_count integer) LANGUAGE plpgsql AS $$
DECLARE
    v_window  timestamptz := date_trunc('minute', p_now);
    v_elapsed double precision := extract(epoch FROM p_now - date_trunc('minute', p_now)) / 60.0;
    v_used    double precision;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT w.count INTO previous_count FROM rate_windows w
     WHERE w.key_id = p_key_id AND w.window_start = v_window - interval '1 minute';
    previous_count := coalesce(previous_count, 0);
    INSERT INTO rate_windows AS w (key_id, window_start, count) VALUES (p_key_id, v_window, 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO current_count;
    v_used := previous_count * (1.0 - v_elapsed) + current_count;
    granted := greatest(0, least(greatest(1, floor((p_limit - v_used) / p_share)), floor(p_limit - v_used)))::integer;
    IF granted > 0 THEN
        UPDATE rate_windows w SET count = w.count + granted WHERE w.key_id = p_key_id AND w.window_start = v_window;
    END IF;
    used := v_used + granted;
    current_count := current_count + granted;
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION lease_rate_counts(uuid, timestamptz, integer, integer);
