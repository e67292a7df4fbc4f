-- name: BoundLostSessions :exec
-- Has the server end this session when its client, or the network to it, is
-- lost (see Connect): a transaction that waits longer than
-- @idle_in_transaction (milliseconds) for its next statement, and a
-- connection whose client answers no TCP keepalive (the first sent after
-- @keepalives_idle seconds of silence, then one every @keepalives_interval
-- seconds, @keepalives_count in all), or leaves what the server sent it
-- unacknowledged for @user_timeout milliseconds. On a Unix socket the TCP
-- settings are ignored.
SELECT set_config('idle_in_transaction_session_timeout', @idle_in_transaction::text, false),
       set_config('tcp_keepalives_idle', @keepalives_idle::text, false),
       set_config('tcp_keepalives_interval', @keepalives_interval::text, false),
       set_config('tcp_keepalives_count', @keepalives_count::text, false),
       set_config('tcp_user_timeout', @user_timeout::text, false);
