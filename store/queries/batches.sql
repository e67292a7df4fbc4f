-- name: InsertBatches :many
-- Creates batches of one account, each unless the account already used its
-- idempotency key (an empty key is none), or its id is taken (the same
-- creation, sent again after its reply was lost); the ids of those created
-- are returned.
INSERT INTO batches (id, account_id, project_id, status, total_requests, idempotency_key, request_hash, created_at, expires_at)
SELECT b.id, @account_id, b.project_id, 'queued', b.total_requests, nullif(b.idempotency_key, ''), b.request_hash, b.created_at, b.expires_at
  FROM (SELECT unnest(@ids::uuid[]) AS id, unnest(@project_ids::uuid[]) AS project_id,
               unnest(@total_requests::integer[]) AS total_requests, unnest(@idempotency_keys::text[]) AS idempotency_key,
               unnest(@request_hashes::bytea[]) AS request_hash, unnest(@created_ats::timestamptz[]) AS created_at,
               unnest(@expires_ats::timestamptz[]) AS expires_at) b
ON CONFLICT DO NOTHING
RETURNING id;

-- name: GetBatchByIdempotencyKey :one
SELECT id, request_hash FROM batches WHERE account_id = @account_id AND idempotency_key = @idempotency_key;

-- name: AdmitBatches :one
-- Charges each batch's estimate to the account's day in turn, as far as the
-- ceiling allows, and returns each one's outcome.
SELECT admit_batches(@account_id, @day, @default_ceilings::bigint[], @estimates::bigint[])::text[] AS outcomes;

-- name: DayCharge :one
-- What admit_batches reads, without its lock: the account's own daily
-- ceiling (NULL: its tier's default) and what is charged to the day. Read
-- before a creation's items are sent, so that one the day has no room for
-- is refused without them.
SELECT a.daily_rung_ceiling,
       coalesce((SELECT d.charged_rungs FROM daily_charges d
                  WHERE d.account_id = a.id AND d.day = @day::date), 0)::bigint AS charged_rungs
  FROM accounts a
 WHERE a.id = @account_id;

-- name: DeleteRefusedBatches :exec
-- Removes, with their items, the batches of a creation group that the
-- daily ceiling refused, in the transaction that inserted them.
DELETE FROM batches WHERE id = ANY (@ids::uuid[]);

-- name: InsertBatchItems :copyfrom
INSERT INTO batch_items (batch_id, idx, account_id, project_id, api_key_id, request_id, status, request, model, estimate_rungs, queued_at, expires_at)
VALUES (@batch_id, @idx, @account_id, @project_id, @api_key_id, @request_id, @status, @request, @model, @estimate_rungs, @queued_at, @expires_at);

-- name: NotifyBatchCreated :exec
SELECT pg_notify('batch_created', @batch_id::text);

-- name: ListenBatchCreated :exec
LISTEN batch_created;

-- name: NotifyBatchStopped :exec
-- Tells every replica that the items of the batch it claimed and has not
-- started must not start: the batch was cancelled, or its window ended.
SELECT pg_notify('batch_stopped', @batch_id::text);

-- name: ListenBatchStopped :exec
LISTEN batch_stopped;

-- name: GetBatch :one
-- A batch of the account with its counters and usage aggregated from its
-- items. By key, whatever the statistics: see migration 00028.
SELECT b.id, b.status, b.total_requests, b.error_code, b.error_message,
       b.created_at, b.started_at, b.completed_at, b.expires_at,
       t.completed::integer AS completed_requests, t.failed::integer AS failed_requests,
       t.cancelled::integer AS cancelled_requests, t.input_rungs::bigint AS input_rungs,
       t.output_rungs::bigint AS output_rungs, t.total_rungs::bigint AS total_rungs
FROM batch_of_account(@id, @account_id) AS b
CROSS JOIN LATERAL batch_item_totals(b.id) AS t;

-- name: ListBatches :many
-- The account's batches, newest first by id (UUIDv7: creation order), older
-- than the cursor @after when it is set, each with its items' totals.
SELECT b.id, b.status, b.total_requests, b.error_code, b.error_message,
       b.created_at, b.started_at, b.completed_at, b.expires_at,
       t.completed::integer AS completed_requests, t.failed::integer AS failed_requests,
       t.cancelled::integer AS cancelled_requests, t.input_rungs::bigint AS input_rungs,
       t.output_rungs::bigint AS output_rungs, t.total_rungs::bigint AS total_rungs
FROM (SELECT x.* FROM batches x
       WHERE x.account_id = @account_id AND (sqlc.narg(after)::uuid IS NULL OR x.id < sqlc.narg(after)::uuid)
       ORDER BY x.id DESC LIMIT @max_rows) b
CROSS JOIN LATERAL batch_item_totals(b.id) AS t
ORDER BY b.id DESC;

-- name: ListBatchesForOperator :many
-- Batches of every account, or of the account named, newest first, with
-- statuses among @statuses when given and ids below @before when given, each
-- with its account's and project's names and its items' totals. Operators
-- list batches to find one to cancel. By key, whatever the statistics: see
-- migrations 00037 and 00046.
SELECT b.id, a.name AS account, p.name AS project, b.status, b.error_code, b.total_requests,
       b.created_at, b.expires_at,
       t.completed::integer AS completed_requests, t.failed::integer AS failed_requests,
       t.cancelled::integer AS cancelled_requests, t.total_rungs::bigint AS total_rungs
FROM batches_for_operator_page(sqlc.narg(account)::text, sqlc.narg(statuses)::text[], sqlc.narg(before)::uuid, @max_rows::integer) AS b
JOIN accounts a ON a.id = b.account_id
JOIN projects p ON p.id = b.project_id
CROSS JOIN LATERAL batch_item_totals(b.id) AS t
ORDER BY b.id DESC;

-- name: GetBatchItems :many
-- The items of one of the account's batches after index @after, in order, as
-- many as fit in @max_bytes of content (at least one). By key, whatever the
-- statistics: see migration 00040.
SELECT i.idx, i.status, i.request_id, i.model, i.content, i.input_rungs, i.output_rungs, i.total_rungs,
       i.error_code, i.error_message, i.provider, i.upstream_model, i.attempts
FROM items_of_batch_after(@batch_id, @account_id, @after::integer, @max_bytes::bigint) AS i
ORDER BY i.idx;

-- name: DoneBatches :many
-- Of the batches given, those not yet terminal with no item queued or
-- running, read without locks: only these can be finished (the finish locks
-- and counts again). By key, whatever the statistics: see migration 00026.
SELECT d.id::uuid AS id FROM done_batches(@ids::uuid[]) AS d(id);

-- name: QueuedBatches :many
-- Of the batches given, those still queued, read without locks: only these
-- can be started (the start locks and reads again). By key, whatever the
-- statistics: see migration 00030.
SELECT q.id::uuid AS id FROM queued_batches(@ids::uuid[]) AS q(id);

-- name: LockBatch :one
-- The batch's status, locked for a transition, with the facts of its items.
-- By key, whatever the statistics: see migration 00030.
SELECT l.status::text AS status, l.unfinished::integer AS unfinished, l.running::integer AS running,
       l.succeeded::integer AS succeeded, l.expired_items::integer AS expired_items, l.first_error::text AS first_error
FROM lock_batch(@id::uuid, sqlc.narg(account_id)::uuid) AS l;

-- name: SetBatchStatus :exec
-- By key, whatever the statistics: see migration 00030.
SELECT set_batch_status(@id::uuid, @status::text, sqlc.narg(error_code)::text, sqlc.narg(error_message)::text);

-- name: CancelQueuedItems :execrows
-- Cancels a batch's items that have not started; their estimates go back to
-- the day (settle_batch_items). The items are found by the batch's key: the
-- status check is one the claim index does not serve (IS NOT DISTINCT FROM,
-- see migration 00019), or statistics taken while the queue was empty would
-- have the cancel read every queued item through it.
UPDATE batch_items SET status = 'cancelled', cancel_reason = @reason, completed_at = now()
WHERE batch_id = @batch_id AND status IS NOT DISTINCT FROM 'queued';

-- name: ClaimBatchItems :many
SELECT c.batch_id::uuid AS batch_id, c.idx::integer AS idx, c.account_id::uuid AS account_id,
       c.request::jsonb AS request, c.batch_status::text AS batch_status, c.claimed::boolean AS claimed
FROM claim_batch_items(@owner::uuid, @max_items::integer, @per_account::integer, @lease::interval, @pivot::uuid, @claim_id::uuid, sqlc.narg('models')::text[], sqlc.narg('skip')::uuid[]) AS c;

-- name: CompleteBatchItems :many
-- The outcomes as one array a column (migration 00047): empty texts and
-- attempts of 0 are none, sources NULL none.
SELECT c.batch_id::uuid AS batch_id, c.idx::integer AS idx
FROM complete_batch_items(@owner::uuid, @batch_ids::uuid[], @idxs::integer[], @statuses::text[], @contents::text[],
    @input_tokens::bigint[], @output_tokens::bigint[], @input_rungs::bigint[], @output_rungs::bigint[],
    @total_rungs::bigint[], @error_codes::text[], @error_messages::text[], @sources::jsonb[], @verdicts::text[],
    @evidence_expires_ats::timestamptz[], @providers::text[], @upstream_models::text[], @attempts::smallint[]) AS c;

-- name: RequeueBatchItems :many
SELECT r.batch_id::uuid AS batch_id, r.idx::integer AS idx, r.status::text AS status
FROM requeue_batch_items(@owner::uuid, @batch_ids::uuid[], @idxs::integer[], sqlc.narg(claim_id)::uuid) AS r;

-- name: RenewLeases :execrows
-- Extends the leases of the given items, if still leased to @owner: only what
-- the replica really runs, so an item it does not hold runs out its lease.
-- Each item is found by its key; the owner is checked so that no index serves
-- it (migration 00016: the owner's index holds an entry for every item the
-- owner ran since the table was last vacuumed). An item another statement has
-- locked is skipped, not waited for: it is being completed or handed back, or
-- its renewal waits for the next beat, a third of a lease later. Waiting, the
-- renewal locked its items in an order of its own and deadlocked with the
-- completion of a group (PostgreSQL ended one of them after a second).
WITH held AS (
    SELECT i.batch_id, i.idx FROM batch_items i
    WHERE (i.batch_id, i.idx) IN (SELECT unnest(@batch_ids::uuid[]), unnest(@idxs::integer[]))
      AND i.lease_owner IS NOT DISTINCT FROM @owner::uuid AND i.status = 'in_progress'
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE batch_items i SET lease_expires_at = now() + @lease::interval
FROM held h WHERE i.batch_id = h.batch_id AND i.idx = h.idx;

-- name: ItemOutcomes :many
-- The stored outcomes of the given items, each found by its key: read when a
-- group of outcomes was sent again after a reply lost on its way back, to
-- tell the outcomes the lost attempt stored from those another gave.
SELECT i.batch_id, i.idx, i.status, coalesce(i.error_code, '')::text AS error_code, i.total_rungs
FROM batch_items i
WHERE (i.batch_id, i.idx) IN (SELECT unnest(@batch_ids::uuid[]), unnest(@idxs::integer[]));

-- name: RescueExpiredLeases :many
SELECT r.batch_id::uuid AS batch_id FROM rescue_expired_leases(@max_rows::integer) AS r;

-- name: BatchesPastWindow :many
-- Open batches whose completion window ended.
SELECT id FROM batches
WHERE status IN ('queued', 'in_progress', 'cancelling') AND expires_at <= now()
ORDER BY expires_at
LIMIT @max_rows;

-- name: UnfinishedBatches :many
-- Open batches none of whose items is unfinished: a finalization was missed
-- (the replica died between committing an item and finalizing its batch).
-- Queued ones too: a batch stays queued until its first item's dispatch is
-- recorded, and a claim that refuses a batch its budget fails its items at
-- once. Each open batch costs a look at its first unfinished item (under 10
-- µs): the housekeeping spaces its runs (maintenance.scanSpacing).
SELECT b.id FROM batches b
WHERE b.status IN ('queued', 'in_progress', 'cancelling')
  AND NOT EXISTS (SELECT 1 FROM batch_items i WHERE i.batch_id = b.id AND i.status IN ('queued', 'in_progress'))
LIMIT @max_rows;

-- name: DeleteOldBatches :one
-- Removes up to @max_rows terminal batches (and their items) completed before
-- @before, the earliest first from @completed_from on, and returns how many
-- and where the next run reads from: the last completion removed, or
-- @before when fewer were left (see resumeMark). Their usage stays (in
-- requests, and the sums they are folded into).
WITH removed AS (
    DELETE FROM batches
    WHERE batches.id IN (SELECT x.id FROM batches x
                          WHERE x.completed_at < @before AND x.completed_at >= @completed_from::timestamptz
                          ORDER BY x.completed_at LIMIT @max_rows::integer)
    RETURNING batches.completed_at
)
SELECT count(*)::bigint AS removed,
       (CASE WHEN count(*) < @max_rows::integer THEN @before::timestamptz ELSE max(completed_at) END)::timestamptz AS read_from
  FROM removed;

-- name: ExpireIdempotencyKeys :one
-- Forgets the idempotency keys of up to @max_rows batches created before
-- @before, the earliest first from @created_from on, and returns how many
-- and where the next run reads from, as DeleteOldBatches does.
WITH expired AS (
    UPDATE batches SET idempotency_key = NULL
    WHERE batches.id IN (SELECT x.id FROM batches x
                          WHERE x.idempotency_key IS NOT NULL AND x.created_at < @before AND x.created_at >= @created_from
                          ORDER BY x.created_at LIMIT @max_rows::integer)
    RETURNING batches.created_at
)
SELECT count(*)::bigint AS expired,
       (CASE WHEN count(*) < @max_rows::integer THEN @before::timestamptz ELSE max(created_at) END)::timestamptz AS read_from
  FROM expired;

-- name: QueueDepth :one
SELECT count(*) FROM batch_items WHERE status = 'queued';

-- name: TryJobLock :one
-- A transaction advisory lock naming a maintenance job (namespace 7120, apart
-- from the migrations' lock): one replica runs the job at a time. The
-- transaction waits, idle, while the job runs on other connections; should
-- its client be lost, the server ends it @hold (milliseconds) after its last
-- statement, and the lock with it, where a session's lock would be held for
-- as long as the server keeps the connection. A job resting (job_rests) is
-- not taken up: locked is then false too.
SELECT set_config('idle_in_transaction_session_timeout', @hold::text, true)::text AS hold,
       (NOT EXISTS (SELECT 1 FROM job_rests r WHERE r.job = @job::text AND r.until > clock_timestamp())
        AND pg_try_advisory_xact_lock(7120, hashtext(@job::text)))::boolean AS locked;

-- name: RestJob :exec
-- Rests the job, in the transaction holding its lock, for @rest times as long
-- as the transaction has lasted so far (the job's run), from now on: the
-- database's clock measures both ends, so the replicas' clocks do not matter.
INSERT INTO job_rests (job, until)
VALUES (@job::text, clock_timestamp() + (clock_timestamp() - now()) * @rest::integer)
ON CONFLICT (job) DO UPDATE SET until = excluded.until;
