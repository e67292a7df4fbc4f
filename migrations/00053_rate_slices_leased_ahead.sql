-- +goose Up
-- A replica leases the next minute's slice of a key in active use during the
-- last seconds of a minute (lease_rate_ahead), so that the key's first request
-- of the new minute does not wait for a lease. The sliding window weighs the
-- previous minute whole at the start of a minute, so a slice of the next
-- minute is granted as at its start: what the limit leaves after this
-- minute's count and the next one's. For that bound to hold, a grant of this
-- minute's must leave room for the next minute's slices already granted:
-- lease_rate_counts, same signature (the replicas of the previous release
-- call it too), now also counts the next minute's row. The two serialize on
-- this minute's row: lease_rate_ahead locks it (creating it, as a grant of
-- this minute does) before the next minute's, in key order, as return_rate
-- locks its rows (00052).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION lease_rate_counts(p_key_id uuid, p_now timestamptz, p_limit integer, p_share integer)
RETURNS TABLE (granted integer, used double precision, previous_count integer, current_count integer) LANGUAGE plpgsql AS $$
DECLARE
    v_window  timestamptz := date_trunc('minute', p_now);
    v_elapsed double precision := extract(epoch FROM p_now - date_trunc('minute', p_now)) / 60.0;
    v_used    double precision;
    v_next    integer;
    v_room    double precision;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT w.count INTO previous_count FROM rate_windows w
     WHERE w.key_id = p_key_id AND w.window_start = v_window - interval '1 minute';
    previous_count := coalesce(previous_count, 0);
    INSERT INTO rate_windows AS w (key_id, window_start, count) VALUES (p_key_id, v_window, 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO current_count;
    SELECT w.count INTO v_next FROM rate_windows w
     WHERE w.key_id = p_key_id AND w.window_start = v_window + interval '1 minute';
    v_used := previous_count * (1.0 - v_elapsed) + current_count;
    v_room := least(p_limit - v_used, p_limit - current_count - coalesce(v_next, 0));
    granted := greatest(0, least(greatest(1, floor(v_room / p_share)), floor(v_room)))::integer;
    IF granted > 0 THEN
        UPDATE rate_windows w SET count = w.count + granted WHERE w.key_id = p_key_id AND w.window_start = v_window;
    END IF;
    used := v_used + granted;
    current_count := current_count + granted;
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION lease_rate_ahead(p_key_id uuid, p_window timestamptz, p_limit integer, p_share integer)
RETURNS TABLE (granted integer, used double precision, previous_count integer, current_count integer) LANGUAGE plpgsql AS $$
DECLARE
    v_window timestamptz := date_trunc('minute', p_window);
    v_room   integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO rate_windows AS w (key_id, window_start, count) VALUES (p_key_id, v_window - interval '1 minute', 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO previous_count;
    INSERT INTO rate_windows AS w (key_id, window_start, count) VALUES (p_key_id, v_window, 0)
    ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count
    RETURNING w.count INTO current_count;
    v_room := p_limit - previous_count - current_count;
    granted := greatest(0, least(greatest(1, v_room / p_share), v_room));
    IF granted > 0 THEN
        UPDATE rate_windows w SET count = w.count + granted WHERE w.key_id = p_key_id AND w.window_start = v_window;
    END IF;
    current_count := current_count + granted;
    used := previous_count + current_count;
    RETURN NEXT;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- Forward only, like 00052: the replicas of this release lease ahead, and
-- the grants of the function before leave no room for it.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'migration 00053 cannot be reverted'; END $$;
-- +goose StatementEnd
