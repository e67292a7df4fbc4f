-- name: BoundIdleTransactions :exec
-- Has the server end this session should a transaction of it wait longer
-- than @timeout (milliseconds) for its client's next statement: its client,
-- or the network to it, is lost, and the transaction's locks must not outlive
-- it (see Connect).
SELECT set_config('idle_in_transaction_session_timeout', @timeout::text, false);
