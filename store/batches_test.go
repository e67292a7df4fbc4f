package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// newBatch stores a batch of n items of estimate est each for p.
func (b *testBundle) newBatch(t testing.TB, p *gateway.Principal, n int, est int64, key string, expires time.Time) uuid.UUID {
	t.Helper()
	res, err := b.store.CreateBatch(b.ctx, b.batchOf(p, n, est, key, expires))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	return res.BatchID
}

func (b *testBundle) batchOf(p *gateway.Principal, n int, est int64, key string, expires time.Time) store.NewBatch {
	items := make([]store.NewItem, n)
	for i := range items {
		items[i] = store.NewItem{Request: store.ItemRequest{Prompt: fmt.Sprintf("item %d", i), Model: gateway.ModelInstant, MaxOutputRungs: 10}, Estimate: est}
	}
	hash, _ := store.HashRequest(map[string]any{"n": n, "est": est})
	now := time.Now().UTC()
	return store.NewBatch{Principal: p, IdempotencyKey: key, RequestHash: hash, Items: items, CreatedAt: now, ExpiresAt: expires}
}

func (b *testBundle) claim(t *testing.T, owner uuid.UUID, n int, lease time.Duration) []store.ClaimedItem {
	t.Helper()
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: n, PerAccount: n, Lease: lease})
	require.NoError(t, err)
	return items
}

func (b *testBundle) complete(t *testing.T, owner uuid.UUID, items []store.ClaimedItem, cost int64) []store.ItemKey {
	t.Helper()
	applied := b.completeItems(t, owner, items, cost)
	ids := make([]uuid.UUID, len(applied))
	for i, k := range applied {
		ids[i] = k.BatchID
	}
	require.NoError(t, b.store.FinishBatches(b.ctx, ids))
	return applied
}

// completeItems stores each item's outcome, completed at cost, without
// finishing their batches.
func (b *testBundle) completeItems(t *testing.T, owner uuid.UUID, items []store.ClaimedItem, cost int64) []store.ItemKey {
	t.Helper()
	applied, err := b.store.CompleteItems(b.ctx, owner, itemResults(items, cost))
	require.NoError(t, err)
	return applied
}

// itemResults are the outcomes of items completed at cost, citing nothing.
func itemResults(items []store.ClaimedItem, cost int64) []store.ItemResult {
	results := make([]store.ItemResult, len(items))
	for i, it := range items {
		results[i] = store.ItemResult{
			BatchID: it.BatchID, Index: it.Index, Status: "completed", Content: "done " + it.Request.Prompt,
			InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: cost - 1, TotalRungs: cost,
			EvidenceExpiresAt: time.Now().Add(time.Hour),
		}
	}
	return results
}

func (b *testBundle) batch(t *testing.T, p *gateway.Principal, id uuid.UUID) (*gateway.Batch, []gateway.BatchItem) {
	t.Helper()
	batch, err := b.store.Batch(b.ctx, p.AccountID, id)
	require.NoError(t, err)
	items, err := b.store.BatchItems(b.ctx, p.AccountID, id, -1, 1<<30)
	require.NoError(t, err)
	return batch, items
}

func day() time.Time { return time.Now().Add(24 * time.Hour) }

// perAccount counts claimed items by account.
func perAccount(items []store.ClaimedItem) map[uuid.UUID]int {
	n := map[uuid.UUID]int{}
	for _, it := range items {
		n[it.AccountID]++
	}
	return n
}

func keysOf(items []store.ClaimedItem) []store.ItemKey {
	keys := make([]store.ItemKey, len(items))
	for i, it := range items {
		keys[i] = it.Key()
	}
	return keys
}

func TestCreateBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 3, 50, "", day())

	batch, items := b.batch(t, p, id)
	require.Equal(t, gateway.BatchQueued, batch.Status)
	require.Equal(t, 3, batch.Total)
	require.Nil(t, batch.StartedAt)
	require.Len(t, items, 3)
	for i, it := range items {
		require.Equal(t, i, it.Index)
		require.Equal(t, gateway.ItemQueued, it.Status)
		require.Zero(t, it.Usage)
	}
	require.Equal(t, int64(150), b.view(t, p).Daily.Charged, "the whole estimate is charged at creation")

	_, err := b.store.Batch(b.ctx, other.AccountID, id)
	require.Equal(t, gateway.EBatchNotFound, gateway.ErrorCodeOf(err), "another account's batch is missing")
	_, err = b.store.Batch(b.ctx, p.AccountID, uuid.Must(uuid.NewV7()))
	require.Equal(t, gateway.EBatchNotFound, gateway.ErrorCodeOf(err))

	// Newest first, limited.
	second := b.newBatch(t, p, 1, 1, "", day())
	list, err := b.store.Batches(b.ctx, p.AccountID, nil, 50)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{second, id}, []uuid.UUID{list[0].ID, list[1].ID})
	list, err = b.store.Batches(b.ctx, p.AccountID, nil, 1)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, second, list[0].ID, "the newest")
	list, err = b.store.Batches(b.ctx, p.AccountID, &second, 50)
	require.NoError(t, err)
	require.Len(t, list, 1, "after the cursor")
	require.Equal(t, id, list[0].ID)

	// The queue's depth counts the items waiting, not those running.
	require.Len(t, b.claim(t, uuid.Must(uuid.NewV7()), 1, time.Minute), 1)
	depth, err := b.store.QueueDepth(b.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), depth)
}

func TestCreateBatchPastDailyCeiling(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 3, 50, "key-1", day()))
	require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(err))
	list, err := b.store.Batches(b.ctx, p.AccountID, nil, 50)
	require.NoError(t, err)
	require.Empty(t, list, "nothing is stored")
	require.Zero(t, b.view(t, p).Daily.Charged)

	// The refused create stored no key: once the ceiling allows, the key works.
	b.limits(t, "acme", ptr(int64(1000)), nil)
	res, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 3, 50, "key-1", day()))
	require.NoError(t, err)
	require.False(t, res.Replayed)
}

// TestCreateBatchSentAgain: a creation sent again with the id of a batch it
// stored (its reply was lost) stores nothing more and returns that batch as
// created, with an idempotency key or without, and with concurrent resends.
func TestCreateBatchSentAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	for _, key := range []string{"", "key-1"} {
		nb := b.batchOf(p, 2, 10, key, day())
		nb.ID = uuid.Must(uuid.NewV7())
		var wg sync.WaitGroup
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, err := b.store.CreateBatch(b.ctx, nb)
				require.NoError(t, err)
				require.Equal(t, store.CreateResult{BatchID: nb.ID}, res, "created, not replayed (key %q)", key)
			}()
		}
		wg.Wait()
	}
	list, err := b.store.Batches(b.ctx, p.AccountID, nil, 50)
	require.NoError(t, err)
	require.Len(t, list, 2, "one batch each")
	require.Equal(t, int64(40), b.view(t, p).Daily.Charged, "each charged once")
}

// lockedItems returns a store over a pool of maxConns, and holds a lock that
// keeps any insert of batch items waiting (creations hold their connections)
// until unlock.
func (b *testBundle) lockedItems(t *testing.T, maxConns int32) (*store.Store, *pgxpool.Pool, func()) {
	t.Helper()
	pool := b.poolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = maxConns
		cfg.ConnConfig.Tracer = b.tracer
	})
	lock, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(b.ctx) })
	_, err = lock.Exec(b.ctx, "LOCK TABLE batch_items IN SHARE MODE")
	require.NoError(t, err)
	st := store.New(pool)
	st.Observe(b.metrics)
	return st, pool, func() { require.NoError(t, lock.Rollback(b.ctx)) }
}

// TestABurstOfCreationsLeavesConnections: batch creations waiting on the
// database (here on a lock of the items' table) hold half the pool at most;
// the rest wait their turn without a connection, so a settlement still gets
// one. Without the bound, the creations took all four and the settlement
// waited behind them. (The creations are of different accounts: one
// account's wait for each other without a connection anyway.)
func TestABurstOfCreationsLeavesConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	small, pool, unlock := b.lockedItems(t, 4)

	const burst = 10
	errs := make(chan error, burst)
	for i := range burst {
		_, owner := b.key(t, fmt.Sprintf("burst-%d", i), gateway.TierDeveloper, gateway.ScopeInference)
		go func() {
			_, err := small.CreateBatch(b.ctx, b.batchOf(owner, 2, 10, "", day()))
			errs <- err
		}()
	}
	require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() >= 2 }, 10*time.Second, 5*time.Millisecond,
		"creations hold connections, waiting on the lock")

	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	id := uuid.Must(uuid.NewV7())
	require.NoError(t, small.SettleRequests(ctx, []store.Settlement{{Record: record(p, id, 5)}}),
		"the settlement found a connection among the creations'")
	require.Equal(t, int32(2), pool.Stat().AcquiredConns(), "the other creations wait without one")

	unlock()
	for range burst {
		require.NoError(t, <-errs)
	}
	var stored int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, "SELECT count(*) FROM batches").Scan(&stored))
	require.Equal(t, burst, stored, "every creation stored its batch")
}

// TestACreationThatGaveUpWaitingSentNothing: a creation whose caller's
// deadline passed while it waited for its turn (behind a creation of its
// account) or for a connection (the one slot of a pool of two held by
// another account's) is transient and certainly not stored, so it is not
// sent again as one whose reply was lost; one that waited behind it goes on.
func TestACreationThatGaveUpWaitingSentNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	small, pool, unlock := b.lockedItems(t, 2)
	held := make(chan error, 1)
	go func() {
		_, err := small.CreateBatch(b.ctx, b.batchOf(p, 1, 10, "", day()))
		held <- err
	}()
	require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 1 }, 10*time.Second, 5*time.Millisecond)

	for _, who := range []*gateway.Principal{p, other} {
		ctx, cancel := context.WithTimeout(b.ctx, 50*time.Millisecond)
		_, err := small.CreateBatch(ctx, b.batchOf(who, 1, 10, "", day()))
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.True(t, store.Transient(err))
		require.False(t, store.MayHaveCommitted(err))
	}

	// One that gives up waiting for a connection hands its turn on.
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	gaveUp := make(chan error, 1)
	go func() {
		_, err := small.CreateBatch(ctx, b.batchOf(other, 1, 10, "", day()))
		gaveUp <- err
	}()
	require.Eventually(t, func() bool { return small.CreationsWaiting() == 1 }, 10*time.Second, time.Millisecond)
	behind := make(chan error, 1)
	go func() {
		_, err := small.CreateBatch(b.ctx, b.batchOf(other, 2, 10, "", day()))
		behind <- err
	}()
	require.Eventually(t, func() bool { return small.CreationsWaiting() == 2 }, 10*time.Second, time.Millisecond)
	cancel()
	err := <-gaveUp
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, store.MayHaveCommitted(err))

	unlock()
	require.NoError(t, <-held)
	require.NoError(t, <-behind)
	require.Len(t, b.storedItems(t, p.AccountID), 1, "the creation that gave up behind it stored nothing")
	items := b.storedItems(t, other.AccountID)
	require.Len(t, items, 1)
	for _, n := range items {
		require.Equal(t, 2, n, "only the one that waited behind them was stored")
	}
}

// TestItemsKeepTheirBatch: items name a batch that exists, and go when it is
// deleted (migration 00025 keeps, a statement at a time, what the foreign key
// kept a row at a time).
func TestItemsKeepTheirBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	old := b.newBatch(t, p, 3, 1, "", day())
	kept := b.newBatch(t, p, 2, 1, "", day())

	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO batch_items
		SELECT (jsonb_populate_record(i, jsonb_build_object('batch_id', gen_random_uuid()))).*
		  FROM batch_items i WHERE i.batch_id = $1`, old)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23503", pgErr.Code, "items of no batch are refused: %v", err)

	_, err = b.store.Pool().Exec(b.ctx, `UPDATE batches SET status = 'completed', completed_at = now() - interval '2 days' WHERE id = $1`, old)
	require.NoError(t, err)
	n, err := b.store.DeleteOldBatches(b.ctx, time.Now().Add(-24*time.Hour), 10)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	var oldItems, keptItems int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FILTER (WHERE batch_id = $1), count(*) FILTER (WHERE batch_id = $2) FROM batch_items`, old, kept).Scan(&oldItems, &keptItems))
	require.Zero(t, oldItems, "the deleted batch's items went with it")
	require.Equal(t, 2, keptItems, "another batch's stayed")
}

// TestBatchItemsComeByPages: a batch's items are read after an index, as
// many as fit in a budget of content (counting what comes before each item,
// so always at least one), and never by another account.
func TestBatchItemsComeByPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, stranger := b.key(t, "stranger", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 6, 1, "", day())
	// Items 1, 2 and 4 completed with 100, 300 and 50 bytes; the others
	// have no content yet.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE batch_items SET status = 'completed',
		content = repeat('x', CASE idx WHEN 1 THEN 100 WHEN 2 THEN 300 ELSE 50 END)
		WHERE batch_id = $1 AND idx IN (1, 2, 4)`, id)
	require.NoError(t, err)
	indexes := func(after int, maxBytes int64) []int {
		t.Helper()
		items, err := b.store.BatchItems(b.ctx, p.AccountID, id, after, maxBytes)
		require.NoError(t, err)
		var got []int
		for _, it := range items {
			got = append(got, it.Index)
		}
		return got
	}
	require.Equal(t, []int{0, 1, 2, 3, 4, 5}, indexes(-1, 1<<20))
	require.Equal(t, []int{0, 1}, indexes(-1, 100), "item 2 starts past 100 bytes")
	require.Equal(t, []int{0, 1, 2}, indexes(-1, 101))
	require.Equal(t, []int{2}, indexes(1, 1), "one item at least, whatever its size")
	require.Equal(t, []int{3, 4}, indexes(2, 1), "an item without content takes none of the budget")
	require.Equal(t, []int{5}, indexes(4, 1<<20))
	require.Empty(t, indexes(5, 1<<20))

	items, err := b.store.BatchItems(b.ctx, p.AccountID, id, 0, 1<<20)
	require.NoError(t, err)
	require.Equal(t, strings.Repeat("x", 100), items[0].Content)
	require.Equal(t, gateway.ItemCompleted, items[0].Status)
	require.Equal(t, gateway.ItemQueued, items[2].Status)

	foreign, err := b.store.BatchItems(b.ctx, stranger.AccountID, id, -1, 1<<20)
	require.NoError(t, err)
	require.Empty(t, foreign, "another account reads none of them")
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)

	// Concurrent repeats create exactly one batch.
	var wg sync.WaitGroup
	ids := make([]uuid.UUID, 10)
	replays := make([]bool, 10)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 10, "same", day()))
			require.NoError(t, err)
			ids[i], replays[i] = res.BatchID, res.Replayed
		}()
	}
	wg.Wait()
	created := 0
	for i := range ids {
		require.Equal(t, ids[0], ids[i])
		if !replays[i] {
			created++
		}
	}
	require.Equal(t, 1, created)
	list, err := b.store.Batches(b.ctx, p.AccountID, nil, 50)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, int64(20), b.view(t, p).Daily.Charged, "charged once")

	_, err = b.store.CreateBatch(b.ctx, b.batchOf(p, 3, 10, "same", day()))
	require.Equal(t, gateway.EIdempotencyKeyReused, gateway.ErrorCodeOf(err))

	// Keys are per account: one another account used first is none of
	// this one's, and a repeat resolves to this account's batch.
	res, err := b.store.CreateBatch(b.ctx, b.batchOf(other, 2, 10, "same", day()))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	theirs, err := b.store.CreateBatch(b.ctx, b.batchOf(other, 2, 10, "again", day()))
	require.NoError(t, err)
	mine, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 10, "again", day()))
	require.NoError(t, err)
	require.False(t, mine.Replayed)
	repeat, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 10, "again", day()))
	require.NoError(t, err)
	require.Equal(t, store.CreateResult{BatchID: mine.BatchID, Replayed: true}, repeat)
	require.NotEqual(t, theirs.BatchID, mine.BatchID)
	list, err = b.store.Batches(b.ctx, p.AccountID, nil, 50)
	require.NoError(t, err)
	var listed []uuid.UUID
	for _, batch := range list {
		listed = append(listed, batch.ID)
	}
	require.Equal(t, []uuid.UUID{mine.BatchID, ids[0]}, listed, "the account's own, newest first")

	// Past the window the key is forgotten.
	n, err := b.store.ExpireIdempotencyKeys(b.ctx, time.Now().Add(time.Minute), 100)
	require.NoError(t, err)
	require.Equal(t, int64(4), n)
	res, err = b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 10, "same", day()))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.NotEqual(t, ids[0], res.BatchID)
}

// TestClaimIsExclusive: concurrent claimers never get the same item, and
// together they get every item.
func TestClaimIsExclusive(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, q := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	for range 3 {
		b.newBatch(t, p, 100, 1, "", day())
		b.newBatch(t, q, 50, 1, "", day())
	}
	var mu sync.Mutex
	seen := map[store.ItemKey]uuid.UUID{}
	b.claimConcurrently(t, store.ClaimParams{Max: 7, PerAccount: 4, Lease: time.Minute}, func(owner uuid.UUID, items []store.ClaimedItem) {
		mu.Lock()
		defer mu.Unlock()
		for _, it := range items {
			key := it.Key()
			prev, dup := seen[key]
			assert.False(t, dup, "item %v claimed by %s and %s", key, prev, owner)
			seen[key] = owner
		}
	})
	require.Len(t, seen, 450)
}

// TestClaimPassesOverLockedItems: a claim takes the items no other
// transaction holds, and does not wait for those one does (here, longer than
// the claim's lock timeout: waiting, it would fail).
func TestClaimPassesOverLockedItems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 4, 1, "", day())
	tx, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback(b.ctx)) }()
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM batch_items WHERE batch_id = $1 AND idx < 2 FOR UPDATE`, id)
	require.NoError(t, err)

	impatient := b.impatient(t)
	items, err := impatient.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 8, PerAccount: 8, Lease: time.Minute})
	require.NoError(t, err)
	require.ElementsMatch(t, []store.ItemKey{{BatchID: id, Index: 2}, {BatchID: id, Index: 3}}, keysOf(items))
}

// TestItemsOfAStartedBatchHandedBackAreQueued: items handed back return to
// the queue while their batch is open, started or not, and are claimed
// again; once it is cancelling they are cancelled.
func TestItemsOfAStartedBatchHandedBackAreQueued(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id, owner, items := b.claimedBatch(t, p, 3, 1)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{id}))

	back, err := b.store.RequeueItems(b.ctx, owner, keysOf(items[:2]))
	require.NoError(t, err)
	require.ElementsMatch(t, keysOf(items[:2]), back.Queued)
	require.Empty(t, back.Cancelled)
	again := b.claim(t, owner, 8, time.Minute)
	require.ElementsMatch(t, keysOf(items[:2]), keysOf(again))

	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id))
	back, err = b.store.RequeueItems(b.ctx, owner, keysOf(items))
	require.NoError(t, err)
	require.ElementsMatch(t, keysOf(items), back.Cancelled)
	require.Empty(t, back.Queued)
}

// TestAHandBackOfItemsAnotherHoldsIsNone: a replica hands back only the
// items it holds; named items another holds stay with it, by key or by
// claim.
func TestAHandBackOfItemsAnotherHoldsIsNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 2, 1, "", day())
	holder, other := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	claimID := uuid.Must(uuid.NewV7())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: holder, ClaimID: claimID, Max: 8, PerAccount: 8, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 2)

	back, err := b.store.RequeueItems(b.ctx, other, keysOf(items))
	require.NoError(t, err)
	require.Equal(t, store.Requeued{}, back, "by key")
	back, err = b.store.ReleaseClaim(b.ctx, other, claimID)
	require.NoError(t, err)
	require.Equal(t, store.Requeued{}, back, "by claim")
	require.Len(t, b.complete(t, holder, items, 1), 2, "the holder's outcomes are stored")
}

// claimConcurrently runs eight claimers, each with p under an owner of its
// own, claiming until nothing is left, and hands what each claim took to got.
func (b *testBundle) claimConcurrently(t *testing.T, p store.ClaimParams, got func(owner uuid.UUID, items []store.ClaimedItem)) {
	t.Helper()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			p := p
			p.Owner = uuid.Must(uuid.NewV7())
			for {
				items, err := b.store.ClaimItems(b.ctx, p)
				if !assert.NoError(t, err) || len(items) == 0 {
					return
				}
				got(p.Owner, items)
			}
		})
	}
	wg.Wait()
}

// TestClaimIsFair: an account with a small batch behind another account's
// large queue is served in the first claim.
func TestClaimIsFair(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, big := b.key(t, "big", gateway.TierDeveloper, gateway.ScopeInference)
	_, small := b.key(t, "small", gateway.TierDeveloper, gateway.ScopeInference)
	for range 3 {
		b.newBatch(t, big, 100, 1, "", day())
	}
	b.newBatch(t, small, 5, 1, "", day())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 8, PerAccount: 4, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 8)
	counts := perAccount(items)
	require.Equal(t, 4, counts[small.AccountID])
	require.Equal(t, 4, counts[big.AccountID])
	// Within an account, the oldest batch comes first.
	for _, it := range items {
		if it.AccountID == big.AccountID {
			require.Less(t, it.Index, 4)
		}
	}
}

// TestClaimPassesOverSkippedAccounts: a claim takes no item of an account it
// is told to skip, and gives the skipped account's share to the others; the
// skipped account's items stay queued for a later claim.
func TestClaimPassesOverSkippedAccounts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, held := b.key(t, "held", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, held, 10, 1, "", day())
	b.newBatch(t, other, 10, 1, "", day())
	owner := uuid.Must(uuid.NewV7())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 8, PerAccount: 4, Lease: time.Minute, Skip: []uuid.UUID{held.AccountID}})
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID]int{other.AccountID: 8}, perAccount(items), "the whole claim goes to the account not skipped")

	items, err = b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 8, PerAccount: 4, Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID]int{held.AccountID: 4, other.AccountID: 2}, perAccount(items), "without the skip its items are claimed, its share")
}

// TestClaimTakesTheModelsAsked: a claim limited to some models takes items
// of those only, even from an account whose oldest items are of others, and
// an account with queued items of other models alone takes no share of it.
func TestClaimTakesTheModelsAsked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, mixed := b.key(t, "mixed", gateway.TierDeveloper, gateway.ScopeInference)
	_, reasoning := b.key(t, "reasoning", gateway.TierDeveloper, gateway.ScopeInference)
	_, instant := b.key(t, "instant", gateway.TierDeveloper, gateway.ScopeInference)
	for _, p := range []*gateway.Principal{mixed, reasoning} {
		nb := b.batchOf(p, 10, 1, "", day())
		for i := range nb.Items {
			nb.Items[i].Request.Model = gateway.ModelReasoning
		}
		_, err := b.store.CreateBatch(b.ctx, nb)
		require.NoError(t, err)
	}
	b.newBatch(t, mixed, 10, 1, "", day())
	b.newBatch(t, instant, 10, 1, "", day())

	owner := uuid.Must(uuid.NewV7())
	claim := func(max int, models ...gateway.Model) []store.ClaimedItem {
		t.Helper()
		items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: max, PerAccount: 1, Lease: time.Minute, Models: models})
		require.NoError(t, err)
		return items
	}
	items := claim(8, gateway.ModelInstant)
	require.Equal(t, map[uuid.UUID]int{mixed.AccountID: 4, instant.AccountID: 4}, perAccount(items),
		"the claim goes to the accounts with items of the model")
	for _, it := range items {
		require.Equal(t, gateway.ModelInstant, it.Request.Model)
	}
	items = claim(40, gateway.ModelElements, gateway.ModelReasoning)
	require.Equal(t, map[uuid.UUID]int{mixed.AccountID: 10, reasoning.AccountID: 10}, perAccount(items))
	for _, it := range items {
		require.Equal(t, gateway.ModelReasoning, it.Request.Model)
	}
}

// TestClaimOfThePreviousReleaseStillClaims: replicas of the release before
// migration 00044 call the claim without accounts to skip during a rolling
// upgrade; it claims as the new one does skipping none.
func TestClaimOfThePreviousReleaseStillClaims(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 3, 1, "", day())
	var n int
	err := b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM claim_batch_items($1, 8, 4, interval '1 minute', $2, $3, NULL)`,
		uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewRandom()), uuid.Must(uuid.NewV7())).Scan(&n)
	require.NoError(t, err)
	require.Equal(t, 3, n)
}

// TestClaimTakesAccountsInTurnFromThePivot: a claim looks for work one
// account after the other from its pivot, those after it first and then
// those up to it, each account once, however its open batches stand (here
// all started); of a claim its accounts' shares overfill, the last account
// in turn gets what is left.
func TestClaimTakesAccountsInTurnFromThePivot(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var accounts []uuid.UUID
	for _, name := range []string{"first", "second", "third"} {
		_, p := b.key(t, name, gateway.TierDeveloper, gateway.ScopeInference)
		b.newBatch(t, p, 10, 1, "", day())
		accounts = append(accounts, p.AccountID)
	}
	slices.SortFunc(accounts, func(x, y uuid.UUID) int { return bytes.Compare(x[:], y[:]) })
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE batches SET status = 'in_progress'`)
	require.NoError(t, err)

	claimFrom := func(pivot uuid.UUID) map[uuid.UUID]int {
		t.Helper()
		tx, err := b.store.Pool().Begin(b.ctx)
		require.NoError(t, err)
		defer func() { require.NoError(t, tx.Rollback(b.ctx)) }()
		rows, err := tx.Query(b.ctx, `SELECT account_id FROM claim_batch_items($1, 8, 1, interval '1 minute', $2, $3, NULL, NULL)`,
			uuid.Must(uuid.NewV7()), pivot, uuid.Must(uuid.NewV7()))
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		require.NoError(t, err)
		n := map[uuid.UUID]int{}
		for _, id := range ids {
			n[id]++
		}
		return n
	}
	// Shares of ceil(8/3) = 3: the third account in turn gets 2.
	for _, c := range []struct {
		name  string
		pivot uuid.UUID
		last  int
	}{
		{"before every account", uuid.Nil, 2},
		{"at the first", accounts[0], 0},
		{"at the second", accounts[1], 1},
		{"past every account", uuid.Max, 2},
	} {
		want := map[uuid.UUID]int{accounts[0]: 3, accounts[1]: 3, accounts[2]: 3}
		want[accounts[c.last]] = 2
		require.Equal(t, want, claimFrom(c.pivot), "pivot %s", c.name)
	}
}

// TestClaimShares: an account's share of a claim is the claim divided among
// the accounts with work, and at least PerAccount.
func TestClaimShares(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, alone := b.key(t, "alone", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, alone, 30, 1, "", day())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 10, PerAccount: 5, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 10, "an account alone with work takes the whole claim")

	var others []*gateway.Principal
	for _, name := range []string{"second", "third"} {
		_, p := b.key(t, name, gateway.TierDeveloper, gateway.ScopeInference)
		b.newBatch(t, p, 30, 1, "", day())
		others = append(others, p)
	}
	items, err = b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 9, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID]int{alone.AccountID: 3, others[0].AccountID: 3, others[1].AccountID: 3}, perAccount(items),
		"three accounts share a claim of nine")
	items, err = b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 9, PerAccount: 4, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 9)
	for account, n := range perAccount(items) {
		require.LessOrEqual(t, n, 4, "account %s", account)
	}
}

// TestClaimAmongManyAccounts: with more accounts with work than a claim
// takes items, a claim takes PerAccount items from each of Max accounts, and
// looks for work in no more accounts than it needs: its cost does not grow
// with the accounts that have work (it looked at every one). In turn, the
// claims serve every account.
func TestClaimAmongManyAccounts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const accounts, perBatch, max = 40, 3, 8
	for i := range accounts {
		_, p := b.key(t, fmt.Sprintf("tenant%d", i), gateway.TierDeveloper, gateway.ScopeInference)
		b.newBatch(t, p, perBatch, 1, "", day())
	}
	explained, plans := b.explained(t)
	_, err := explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on`)
	require.NoError(t, err)

	owner := uuid.Must(uuid.NewV7())
	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: max, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, max)
	require.Len(t, perAccount(items), max, "one item of each of %d accounts", max)
	chose := plansOf(t, plans(), []string{"open_since"})
	require.Len(t, chose, 1, "the claim's choice was explained: %q", plans())
	probes := regexp.MustCompile(`Index (?:Only )?Scan using batch_items_claim_idx on batch_items i .*loops=(\d+)\)`).FindStringSubmatch(chose[0])
	require.NotNil(t, probes, chose[0])
	require.Equal(t, strconv.Itoa(max), probes[1], "accounts looked at for work: %s", chose[0])

	seen := map[store.ItemKey]bool{}
	for _, k := range keysOf(items) {
		seen[k] = true
	}
	for len(seen) < accounts*perBatch {
		items := b.claim(t, owner, max, time.Minute)
		require.NotEmpty(t, items, "every item is claimed in turn")
		for _, k := range keysOf(items) {
			require.False(t, seen[k], "claimed twice: %v", k)
			seen[k] = true
		}
	}
}

// TestClaimReadsOnlyTheOpenBatchesItNeeds: with many batches open, a claim
// finds where an account's queued items start through the index of open
// batches, a probe an account, instead of reading every open batch.
func TestClaimReadsOnlyTheOpenBatchesItNeeds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 4, 1, "", day())
	b.openCopies(t, 3000)
	_, err := b.store.Pool().Exec(b.ctx, "ANALYZE batches")
	require.NoError(t, err)
	explained, plans := b.explained(t)
	_, err = explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on`)
	require.NoError(t, err)

	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 4, PerAccount: 4, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 4)
	requireFewOpenBatchesRead(t, plans(), 3000)
}

// TestClaimPlansHoldAsTheQueueGrows: a claim planned once, generically, while
// few batches were open and known to be (analyzed then, as a replica's
// connections plan it when a burst of creations begins after an ANALYZE)
// still finds where items start through the index of open batches once
// thousands are open. With a plan that scanned the then tiny table, each
// claim of a burst of 3,000 batches read them all for each account it looked
// at, and the drain ran at half its pace until an ANALYZE replanned it.
func TestClaimPlansHoldAsTheQueueGrows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 4, 1, "", day())
	b.analyzeOnce(t)
	explained, plans := b.explained(t)
	_, err := explained.Pool().Exec(b.ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	owner := uuid.Must(uuid.NewV7())
	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 1)

	b.openCopies(t, 3000)
	_, err = explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on`)
	require.NoError(t, err)
	before := len(plans())
	items, err = explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 3, PerAccount: 3, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 3)
	requireFewOpenBatchesRead(t, plans()[before:], 3000)
}

// TestBatchStatementsPlanForTheTablesAsTheyAre: the statements on the batch
// tables that no drain function runs (a client's reads, creation replays,
// cancels, batch transitions, maintenance) read by key once the tables have
// grown: a client's reads of a batch and its results, and a batch's start
// and finish, through functions planned with sequential scans off, the
// others planned for each call, from the tables as they are then. Planned once and kept, generically, while the
// tables were tiny and known to be, they read every batch, or every item, for
// each call once thousands were there (GetBatch and QueuedBatches took
// 8-12 ms a call in bursts of 3,000 batches, until the next ANALYZE).
func TestBatchStatementsPlanForTheTablesAsTheyAre(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	first, second := b.batchOf(p, 4, 1, "first", day()), b.batchOf(p, 4, 1, "second", day())
	ids := []uuid.UUID{b.newBatch(t, p, 4, 1, first.IdempotencyKey, day()), b.newBatch(t, p, 4, 1, second.IdempotencyKey, day())}
	b.analyzeOnce(t)
	explained, plans := b.explained(t)
	_, err := explained.Pool().Exec(b.ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	// Every statement runs once on the tiny tables, then again on one of
	// thousands of batches.
	use := func(id uuid.UUID, replay store.NewBatch) {
		t.Helper()
		res, err := explained.CreateBatch(b.ctx, replay)
		require.NoError(t, err)
		require.Equal(t, store.CreateResult{BatchID: id, Replayed: true}, res)
		_, err = explained.Batch(b.ctx, p.AccountID, id)
		require.NoError(t, err)
		_, err = explained.Batches(b.ctx, p.AccountID, &id, 10)
		require.NoError(t, err)
		items, err := explained.BatchItems(b.ctx, p.AccountID, id, -1, 1<<30)
		require.NoError(t, err)
		require.Len(t, items, 4)
		require.NoError(t, explained.StartBatches(b.ctx, []uuid.UUID{id}))
		require.NoError(t, explained.FinishBatches(b.ctx, []uuid.UUID{id}))
		_, err = explained.BatchesForOperator(b.ctx, "", nil, nil, 10)
		require.NoError(t, err)
		_, err = explained.BatchesForOperator(b.ctx, "acme", []gateway.BatchStatus{gateway.BatchInProgress}, &id, 10)
		require.NoError(t, err)
		require.NoError(t, explained.CancelBatch(b.ctx, p.AccountID, id))
		_, err = explained.ExpireBatches(b.ctx, 10)
		require.NoError(t, err)
		_, err = explained.FinishStrandedBatches(b.ctx, 10)
		require.NoError(t, err)
		_, err = explained.DeleteOldBatches(b.ctx, time.Now().Add(-time.Hour), 10)
		require.NoError(t, err)
		_, err = explained.ExpireIdempotencyKeys(b.ctx, time.Now().Add(-time.Hour), 10)
		require.NoError(t, err)
		_, err = explained.RenewLeases(b.ctx, uuid.Must(uuid.NewV7()), []store.ItemKey{{BatchID: id, Index: 0}}, time.Minute)
		require.NoError(t, err)
	}
	use(ids[0], first)

	b.openCopies(t, 1500) // of both batches: 3,000, with 12,000 items
	b.copyItems(t, ids[1], ids)
	_, err = explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on`)
	require.NoError(t, err)
	before := len(plans())
	use(ids[1], second)
	statements := []string{"GetBatchByIdempotencyKey", "ListBatches", "ListBatchesForOperator", "CancelQueuedItems", "BatchesPastWindow",
		"DeleteOldBatches", "ExpireIdempotencyKeys", "RenewLeases"}
	for i, name := range statements {
		statements[i] = "-- name: " + name + " "
	}
	// GetBatch (migration 00028), GetBatchItems (00040), QueuedBatches, LockBatch
	// and SetBatchStatus (00030), DoneBatches (00026, 00042) run through
	// functions: their statements.
	statements = append(statements, "SELECT b.* FROM batches b WHERE b.id = p_id",
		"WHERE i.batch_id = p_batch_id AND i.idx > p_after", batchItemTotalsStatement,
		queuedBatchesStatement, lockBatchStatement, "UPDATE batches b SET status = p_status",
		doneBatchesStatement,
		// batches_for_operator_page (00046), its two statements.
		"WHERE b.id < v_before AND (p_statuses IS NULL", "WHERE b.account_id = (SELECT a.id FROM accounts a WHERE a.name = p_account)")
	for _, statement := range statements {
		ran := plansOf(t, plans()[before:], []string{statement}, "Seq Scan on batches", "Seq Scan on batch_items")
		require.NotEmpty(t, ran, "%q ran on the grown tables", statement)
		// Nor every item through the items' primary key, as a filter (as
		// done_batches' anti-join did, for each batch, before migration 00042).
		for _, plan := range ran {
			require.Empty(t, scansWithoutCond(plan, "batch_items_pkey"), plan)
		}
	}
}

// TestBatchFunctionsKeepTheirPlans: the drainer's choices of batches to start
// and to finish, the lock of a batch for a transition and a client's poll of
// a batch run on plans their connection keeps, from the first call (migration
// 00042): a plan made for a call names the call's keys, a kept plan its
// parameters. Made for each call, they cost more to plan than to run.
func TestBatchFunctionsKeepTheirPlans(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	explained, plans := b.explained(t)
	const calls = 8
	for range calls {
		id := b.newBatch(t, p, 2, 10, "", day())
		_, err := explained.Batch(b.ctx, p.AccountID, id)
		require.NoError(t, err)
		require.NoError(t, explained.StartBatches(b.ctx, []uuid.UUID{id}))
		require.NoError(t, explained.FinishBatches(b.ctx, []uuid.UUID{id}))
	}
	literal := regexp.MustCompile(`'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}'`)
	for name, statement := range map[string]string{
		"queued_batches":    queuedBatchesStatement,
		"done_batches":      doneBatchesStatement,
		"lock_batch":        lockBatchStatement,
		"batch_item_totals": batchItemTotalsStatement,
	} {
		ran := plansOf(t, plans(), []string{statement})
		require.Len(t, ran, calls, "%s ran once a batch: %q", name, plans())
		for _, plan := range ran {
			require.NotRegexp(t, literal, plan, "%s planned for its call", name)
		}
	}
}

// analyzeOnce takes the statistics of the batch tables now and keeps them:
// autovacuum is off for both, so that a test of plans made from statistics
// of tiny tables still has those once it has grown them. (Otherwise a slow
// run lets autovacuum analyze the grown tables midway, and a plan the test
// made from fresh statistics, fit for a few thousand rows, is not the one it
// asks about.)
func (b *testBundle) analyzeOnce(t testing.TB) {
	t.Helper()
	_, err := b.store.Pool().Exec(b.ctx, `ALTER TABLE batches SET (autovacuum_enabled = off);
		ALTER TABLE batch_items SET (autovacuum_enabled = off); ANALYZE batches, batch_items`)
	require.NoError(t, err)
}

// openCopies opens more batches, as a burst of creations leaves them: n-1
// copies of each batch there is (one, in most tests), without items or
// idempotency keys of their own.
func (b *testBundle) openCopies(t testing.TB, n int) {
	t.Helper()
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO batches
		SELECT (jsonb_populate_record(b, jsonb_build_object('id', gen_random_uuid(), 'idempotency_key', null))).*
		  FROM batches b, generate_series(2, $1)`, n)
	require.NoError(t, err)
}

// copyItems gives every batch but the originals a copy of the items of
// batch from, each batch's items together, as a creation writes them.
func (b *testBundle) copyItems(t testing.TB, from uuid.UUID, originals []uuid.UUID) {
	t.Helper()
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO batch_items
		SELECT (jsonb_populate_record(i, jsonb_build_object('batch_id', c.id, 'request_id', gen_random_uuid()))).*
		  FROM batches c JOIN batch_items i ON i.batch_id = $1 WHERE c.id <> ALL ($2) ORDER BY c.id, i.idx`, from, originals)
	require.NoError(t, err)
}

// BenchmarkCompleteItems: the commit of a completion group of 64 items
// whose outputs are 64 bytes or 4 KiB of text with characters JSON escapes,
// each citing a source (the group's encoding, the statement and its
// transaction), per group and per item.
func BenchmarkCompleteItems(b *testing.B) {
	for _, size := range []struct {
		name  string
		bytes int
	}{{"64B", 64}, {"4KiB", 4 << 10}} {
		b.Run(size.name, func(b *testing.B) {
			tb := setup(b)
			_, p := tb.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
			content := strings.Repeat(`an "output" <of> words `, size.bytes/23+1)[:size.bytes]
			src := []gateway.Source{{Title: "T", URL: "https://example.com/a", Snippet: "s"}}
			const group = 64
			for b.Loop() {
				b.StopTimer()
				tb.newBatch(b, p, group, 10, "", day())
				owner := uuid.Must(uuid.NewV7())
				items, err := tb.store.ClaimItems(tb.ctx, store.ClaimParams{Owner: owner, Max: group, PerAccount: group, Lease: time.Minute})
				require.NoError(b, err)
				results := itemResults(items, 55)
				for i := range results {
					results[i].Content, results[i].Sources = content, src
					results[i].Provider, results[i].UpstreamModel, results[i].Attempts = "primary", "m-1", 1
				}
				b.StartTimer()
				applied, err := tb.store.CompleteItems(tb.ctx, owner, results)
				require.NoError(b, err)
				require.Len(b, applied, group)
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*group), "µs/item")
		})
	}
}

// BenchmarkBatchReadsAfterABurst: a client's reads of a batch of the burst
// (its status, its results, the list of the account's batches) on a
// connection that made its plans while the tables held two batches, one of
// them analyzed, once the burst has grown them to 3,000 batches of 100 items:
// before any ANALYZE, then after one.
func BenchmarkBatchReadsAfterABurst(b *testing.B) {
	tb := &testBundle{ctx: context.Background(), store: store.New(testdb.New(b))}
	_, p := tb.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	analyzed := tb.newBatch(b, p, 100, 1, "", day())
	tb.analyzeOnce(b)
	id := tb.newBatch(b, p, 100, 1, "", day())
	st := store.New(tb.poolWith(b, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 }))
	reads := map[string]func() error{
		"status": func() error { _, err := st.Batch(tb.ctx, p.AccountID, id); return err },
		"results": func() error {
			items, err := st.BatchItems(tb.ctx, p.AccountID, id, -1, 1<<30)
			if err == nil && len(items) != 100 {
				err = fmt.Errorf("%d items", len(items))
			}
			return err
		},
		"list": func() error { _, err := st.Batches(tb.ctx, p.AccountID, nil, 50); return err },
	}
	for range 10 {
		for _, read := range reads {
			require.NoError(b, read())
		}
	}
	tb.openCopies(b, 1500)
	tb.copyItems(b, id, []uuid.UUID{analyzed, id})
	measure := func(phase string) {
		for _, name := range []string{"status", "results", "list"} {
			b.Run(phase+"/"+name, func(b *testing.B) {
				for b.Loop() {
					if err := reads[name](); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
	measure("burst")
	_, err := tb.store.Pool().Exec(tb.ctx, `VACUUM ANALYZE batches, batch_items`)
	require.NoError(b, err)
	measure("analyzed")
}

// BenchmarkFinishStrandedBatches: the housekeeping's pass over stranded
// batches while 10,000 batches of 10 items wait in the queue, none of them
// stranded: it looks at each open batch's first unfinished item. Reported
// per pass, and per open batch.
func BenchmarkFinishStrandedBatches(b *testing.B) {
	const batches = 10_000
	tb := &testBundle{ctx: context.Background(), store: store.New(testdb.New(b))}
	_, p := tb.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := tb.newBatch(b, p, 10, 1, "", day())
	tb.openCopies(b, batches)
	tb.copyItems(b, id, []uuid.UUID{id})
	_, err := tb.store.Pool().Exec(tb.ctx, `VACUUM ANALYZE batches, batch_items`)
	require.NoError(b, err)
	for b.Loop() {
		n, err := tb.store.FinishStrandedBatches(tb.ctx, 1000)
		require.NoError(b, err)
		require.Zero(b, n)
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/batches, "µs/batch")
}

// requireFewOpenBatchesRead checks, in the claim's explained plans, that it
// found where items start through the index of open batches, reading a few
// of the open ones.
func requireFewOpenBatchesRead(t *testing.T, plans []string, open int) {
	t.Helper()
	chose := plansOf(t, plans, []string{"open_since"})
	require.Len(t, chose, 1, "the claim's choice was explained: %q", plans)
	require.NotContains(t, chose[0], "Seq Scan on batches", chose[0])
	read := 0
	for _, m := range regexp.MustCompile(`Scan using batches_drainable_idx on batches b.*actual time=\S+ rows=(\d+) loops=(\d+)\)`).FindAllStringSubmatch(chose[0], -1) {
		rows, _ := strconv.Atoi(m[1])
		loops, _ := strconv.Atoi(m[2])
		read += rows * loops
	}
	require.Positive(t, read, "open batches are found through their index: %s", chose[0])
	require.Less(t, read, 10, "of %d open batches, those the claim needs: %s", open, chose[0])
}

// TestClaimMixesCappedAndUncapped: in one claim, items of an uncapped project
// are claimed as they are, and those of a capped project reserve their
// estimates in order until the cap refuses one, which fails the rest of its
// batch.
func TestClaimMixesCappedAndUncapped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, capped := b.key(t, "capped", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "capped", nil, ptr(int64(250)))
	_, free := b.key(t, "free", gateway.TierDeveloper, gateway.ScopeInference)
	cappedID := b.newBatch(t, capped, 5, 100, "", day())
	freeID := b.newBatch(t, free, 5, 100, "", day())

	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 10, PerAccount: 5, Lease: time.Minute})
	require.NoError(t, err)
	for _, it := range items {
		require.True(t, it.BatchQueued)
	}
	claimed, refused := byOutcome(items)
	require.ElementsMatch(t, []int{0, 1, 2, 3, 4}, claimed[freeID])
	require.Equal(t, []int{0, 1}, claimed[cappedID], "the cap fits the first two, in order")
	require.Equal(t, []int{2}, refused[cappedID])
	require.Empty(t, refused[freeID])
	require.Equal(t, int64(200), b.view(t, capped).Budget.Reserved)

	_, results := b.batch(t, capped, cappedID)
	for _, r := range results[2:] {
		require.Equal(t, gateway.ItemFailed, r.Status)
		require.Equal(t, gateway.EBudgetExceeded, r.Error.Code)
	}
	_, results = b.batch(t, free, freeID)
	for _, r := range results {
		require.Equal(t, gateway.ItemInProgress, r.Status)
	}
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute), "nothing is left to claim")
}

// TestClaimOfAProjectWhoseCapIsLiftedMeanwhileTakesItsItems: a claim that
// found a project capped, and then, locking it to reserve, finds its cap
// lifted by a change that committed meanwhile, takes its items: there is no
// cap to refuse them.
func TestClaimOfAProjectWhoseCapIsLiftedMeanwhileTakesItsItems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	id := b.newBatch(t, p, 3, 100, "", day())
	lift, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = lift.Rollback(b.ctx) }()
	_, err = lift.Exec(b.ctx, `UPDATE projects SET budget_cap_rungs = NULL WHERE id = $1`, p.ProjectID)
	require.NoError(t, err)

	claimed := make(chan []store.ClaimedItem, 1)
	go func() {
		items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 8, PerAccount: 8, Lease: time.Minute})
		assert.NoError(t, err)
		claimed <- items
	}()
	b.requireOneWaiting(t, "the claim waits to lock the project")
	require.NoError(t, lift.Commit(b.ctx))
	items := <-claimed
	taken, refused := byOutcome(items)
	require.Equal(t, []int{0, 1, 2}, taken[id])
	require.Empty(t, refused)
}

// TestClaimReadsEachProjectOnce: a claim reads the projects of the items it
// chose in one statement, whatever their number, and reads none of those
// items again by its key; a claim of items of projects without a cap (most
// claims) then takes them at once. Before migration 00043 every item taken
// was joined to its project, then every candidate and its project read again
// to find the capped ones among them.
func TestClaimReadsEachProjectOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 20, 10, "", day())
	b.newBatch(t, other, 20, 10, "", day())
	explained, plans := b.explained(t)

	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 32, PerAccount: 16, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 32)
	require.Len(t, plansOf(t, plans(), []string{" on projects "}), 1, "one statement read the projects: %q", plans())
	require.Empty(t, plansOf(t, plans(), []string{"batch_items_pkey"}), "no item was read again by its key")
}

// TestClaimReservesCappedProjectsInClaimOrder: each capped project's items
// reserve their estimates in claim order; a refused item fails the rest of
// its batch's queue, and a later item of another batch still takes what is
// left if it fits. Two projects in one claim each keep their own room.
func TestClaimReservesCappedProjectsInClaimOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, a := b.key(t, "a", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "a", nil, ptr(int64(250)))
	_, c := b.key(t, "c", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "c", nil, ptr(int64(100)))
	large := b.newBatch(t, a, 3, 100, "", day())
	small := b.newBatch(t, a, 2, 30, "", day())
	other := b.newBatch(t, c, 3, 60, "", day())

	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 16, PerAccount: 8, Lease: time.Minute})
	require.NoError(t, err)
	claimed, refused := byOutcome(items)
	require.Equal(t, map[uuid.UUID][]int{large: {0, 1}, small: {0}, other: {0}}, claimed,
		"a's cap (250) fits two of 100 and one of 30; c's (100), one of 60")
	require.Equal(t, map[uuid.UUID][]int{large: {2}, small: {1}, other: {1}}, refused, "the first item of each batch that did not fit")
	require.Equal(t, int64(230), b.view(t, a).Budget.Reserved)
	require.Equal(t, int64(60), b.view(t, c).Budget.Reserved)
	_, results := b.batch(t, c, other)
	require.Equal(t, gateway.ItemFailed, results[2].Status, "the rest of a refused batch's queue fails")
	require.Equal(t, gateway.EBudgetExceeded, results[2].Error.Code)
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 16, time.Minute), "nothing is left to claim")
}

// byOutcome gives the indexes of a claim's items by batch: those claimed,
// and those the budget refused.
func byOutcome(items []store.ClaimedItem) (claimed, refused map[uuid.UUID][]int) {
	claimed, refused = map[uuid.UUID][]int{}, map[uuid.UUID][]int{}
	for _, it := range items {
		if it.BudgetRefused {
			refused[it.BatchID] = append(refused[it.BatchID], it.Index)
		} else {
			claimed[it.BatchID] = append(claimed[it.BatchID], it.Index)
		}
	}
	return claimed, refused
}

// TestConcurrentClaimsNeverReservePastTheCap: claims racing for one capped
// project's items reserve exactly what the cap holds, never more.
func TestConcurrentClaimsNeverReservePastTheCap(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	ids := make([]uuid.UUID, 5)
	for i := range ids {
		ids[i] = b.newBatch(t, p, 100, 10, "", day())
	}
	var taken, refused atomic.Int64
	b.claimConcurrently(t, store.ClaimParams{Max: 16, PerAccount: 16, Lease: time.Minute}, func(_ uuid.UUID, items []store.ClaimedItem) {
		for _, it := range items {
			if it.BudgetRefused {
				refused.Add(1)
			} else {
				taken.Add(1)
			}
		}
	})
	require.Equal(t, int64(100), taken.Load(), "the cap holds 100 estimates of 10")
	require.Equal(t, int64(1000), b.view(t, p).Budget.Reserved)
	require.Positive(t, refused.Load())
	failed := 0
	for _, id := range ids {
		_, results := b.batch(t, p, id)
		for _, r := range results {
			if r.Status != gateway.ItemInProgress {
				require.Equal(t, gateway.ItemFailed, r.Status)
				require.Equal(t, gateway.EBudgetExceeded, r.Error.Code)
				failed++
			}
		}
	}
	require.Equal(t, 400, failed, "every item the cap did not hold failed")
}

// TestClaimReturnsEachItemWithItsBatchStatus: a claim returns every item it
// took with its own request, and its batch's status when it was claimed: the
// first items of a batch find it queued, those claimed after it started do
// not; items of two batches claimed together are not mixed up.
func TestClaimReturnsEachItemWithItsBatchStatus(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	first := b.newBatch(t, p, 6, 10, "", day())
	second := b.newBatch(t, p, 6, 10, "", day())
	owner := uuid.Must(uuid.NewV7())

	check := func(items []store.ClaimedItem, queued map[uuid.UUID]bool) {
		t.Helper()
		for _, it := range items {
			require.Equal(t, fmt.Sprintf("item %d", it.Index), it.Request.Prompt, "item %s/%d", it.BatchID, it.Index)
			require.Equal(t, queued[it.BatchID], it.BatchQueued, "item %s/%d", it.BatchID, it.Index)
		}
	}
	items := b.claim(t, owner, 4, time.Minute)
	require.Len(t, items, 4)
	check(items, map[uuid.UUID]bool{first: true, second: true})
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{first}))

	rest := b.claim(t, owner, 20, time.Minute)
	require.Len(t, rest, 8)
	check(rest, map[uuid.UUID]bool{first: false, second: true})
	seen := map[store.ItemKey]bool{}
	for _, key := range keysOf(append(items, rest...)) {
		require.False(t, seen[key], "claimed twice: %v", key)
		seen[key] = true
	}
	require.Len(t, seen, 12)
	require.Empty(t, b.claim(t, owner, 20, time.Minute))
}

// TestCompletedItemsWriteEvidenceRowsOnlyWithEvidence: an item completed
// with neither sources nor a verdict writes no row of evidence (migration
// 00031); its empty evidence is served all the same.
func TestCompletedItemsWriteEvidenceRowsOnlyWithEvidence(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id, owner, items := b.claimedBatch(t, p, 3, 50)
	src := []gateway.Source{{Title: "T", URL: "https://x"}}
	none := []gateway.Source{}
	evidence := []gateway.Evidence{{Sources: src, Verdict: "supported"}, {Sources: none, Verdict: "unsupported"}, {Sources: none}}
	results := itemResults(items, 2)
	for i, r := range results {
		results[i].Sources, results[i].Verdict = evidence[r.Index].Sources, evidence[r.Index].Verdict
	}
	_, err := b.store.CompleteItems(b.ctx, owner, results)
	require.NoError(t, err)

	_, stored := b.batch(t, p, id)
	require.Len(t, stored, 3)
	withRows := map[uuid.UUID]bool{}
	for _, item := range stored {
		require.NotNil(t, item.RequestID)
		ev, err := b.store.Evidence(b.ctx, p.AccountID, *item.RequestID)
		require.NoError(t, err)
		want := evidence[item.Index]
		want.RequestID = *item.RequestID
		require.Equal(t, &want, ev)
		if item.Index < 2 {
			withRows[*item.RequestID] = true
		}
	}
	require.Equal(t, withRows, b.evidenceRows(t))
}

// TestCompletedItemsStoreWhatTheDocumentStored: outcomes sent as arrays
// (migration 00047) store exactly what the same outcomes sent as one JSON
// document to the function replicas of the previous release call stored:
// the items, their requests and their evidence, column by column (an empty
// text and attempts of 0 as none; a request's start the item's; no evidence
// of a failed item, whatever it cites).
func TestCompletedItemsStoreWhatTheDocumentStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	arrays, document := b.newBatch(t, p, 6, 50, "", day()), b.newBatch(t, p, 6, 50, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 12, time.Minute)
	require.Len(t, items, 12)

	expires := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	src := []gateway.Source{{Title: "T", URL: "https://x", Snippet: "s"}}
	outcomes := []store.ItemResult{
		{Status: "completed", Content: "cited", InputTokens: 3, OutputTokens: 4, InputRungs: 3, OutputRungs: 4, TotalRungs: 7,
			Sources: src, Verdict: "supported", Provider: "primary", UpstreamModel: "m-1", Attempts: 2},
		{Status: "completed", Content: "plain", InputTokens: 1, OutputTokens: 2, InputRungs: 1, OutputRungs: 2, TotalRungs: 3,
			Sources: []gateway.Source{}, Provider: "backup", UpstreamModel: "m-2", Attempts: 1},
		{Status: "completed", InputTokens: 5, InputRungs: 5, TotalRungs: 5, Verdict: "unsupported"},
		{Status: "failed", ErrorCode: "INFERENCE_BUSY", ErrorMessage: "no", InputTokens: 9, OutputTokens: 1, InputRungs: 9, OutputRungs: 1, TotalRungs: 10,
			Sources: src, Verdict: "supported"},
		{Status: "failed", ErrorCode: "INTERRUPTED", ErrorMessage: "gone"},
		{Status: "completed", Content: "cited without a verdict", InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: 1, TotalRungs: 2,
			Sources: src},
	}
	var viaArrays []store.ItemResult
	var viaDocument []map[string]any
	for _, it := range items {
		r := outcomes[it.Index]
		r.BatchID, r.Index, r.EvidenceExpiresAt = it.BatchID, it.Index, expires
		if it.BatchID == arrays {
			viaArrays = append(viaArrays, r)
			continue
		}
		doc := map[string]any{"batch_id": r.BatchID, "idx": r.Index, "status": r.Status,
			"input_tokens": r.InputTokens, "output_tokens": r.OutputTokens, "input_rungs": r.InputRungs,
			"output_rungs": r.OutputRungs, "total_rungs": r.TotalRungs, "evidence_expires_at": r.EvidenceExpiresAt}
		// As the document's encoding left them out when empty.
		for k, v := range map[string]string{"content": r.Content, "error_code": r.ErrorCode, "error_message": r.ErrorMessage,
			"verdict": r.Verdict, "provider": r.Provider, "upstream_model": r.UpstreamModel} {
			if v != "" {
				doc[k] = v
			}
		}
		if len(r.Sources) > 0 {
			doc["sources"] = r.Sources
		}
		if r.Attempts != 0 {
			doc["attempts"] = r.Attempts
		}
		viaDocument = append(viaDocument, doc)
	}
	applied, err := b.store.CompleteItems(b.ctx, owner, viaArrays)
	require.NoError(t, err)
	require.Len(t, applied, 6)
	var n int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM complete_batch_items($1, $2::jsonb)`, owner, viaDocument).Scan(&n))
	require.Equal(t, 6, n)

	stored := func(batch uuid.UUID) []string {
		rows, err := b.store.Pool().Query(b.ctx, `
			SELECT jsonb_build_object(
			    'item', jsonb_build_object('status', i.status, 'content', i.content, 'input_rungs', i.input_rungs,
			        'output_rungs', i.output_rungs, 'total_rungs', i.total_rungs, 'error_code', i.error_code,
			        'error_message', i.error_message, 'provider', i.provider, 'upstream_model', i.upstream_model,
			        'attempts', i.attempts, 'reserved_rungs', i.reserved_rungs, 'leased', i.lease_owner IS NOT NULL
			        OR i.lease_expires_at IS NOT NULL, 'completed', i.completed_at IS NOT NULL,
			        'request_started', r.created_at = i.started_at),
			    'request', to_jsonb(r) - '{id,created_at,completed_at}'::text[],
			    'evidence', to_jsonb(e) - 'request_id'::text)::text
			  FROM batch_items i
			  LEFT JOIN requests r ON r.id = i.request_id
			  LEFT JOIN evidence e ON e.request_id = i.request_id
			 WHERE i.batch_id = $1 ORDER BY i.idx`, batch)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	got := stored(arrays)
	require.Len(t, got, 6)
	require.Equal(t, stored(document), got)
	require.Contains(t, got[0], `"upstream_model": "m-1"`, "an item's route is stored")
	require.Contains(t, got[4], `"content": null`, "a failed item has no content")
	require.Contains(t, got[0], `"request_started": true`, "a request starts with its item")
	require.Contains(t, got[3], `"evidence": null`, "a failed item has no evidence")
	require.Contains(t, got[5], `"empty_evidence_expires_at": null`, "an item citing sources has evidence")
}

func TestCompleteItemsAndBatchLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id, owner, items := b.claimedBatch(t, p, 3, 50)
	require.True(t, items[0].BatchQueued)
	require.Equal(t, p.AccountID, items[0].AccountID)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{id}))
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchInProgress, batch.Status)
	require.NotNil(t, batch.StartedAt)

	// Results are visible as items finish.
	b.complete(t, owner, items[:1], 20)
	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchInProgress, batch.Status)
	require.Equal(t, 1, batch.Completed)
	require.Equal(t, int64(20), batch.Usage.TotalRungs)
	require.Equal(t, gateway.ItemCompleted, results[0].Status)
	require.Equal(t, "done item 0", results[0].Content)
	require.NotNil(t, results[0].RequestID)
	require.Equal(t, gateway.ItemInProgress, results[1].Status)

	_, err := b.store.Evidence(b.ctx, p.AccountID, *results[0].RequestID)
	require.NoError(t, err, "a completed item's evidence is served by its request id")

	b.complete(t, owner, items[1:], 30)
	batch, _ = b.batch(t, p, id)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.NotNil(t, batch.CompletedAt)
	require.Equal(t, 3, batch.Completed)
	require.Equal(t, int64(80), batch.Usage.TotalRungs)
	require.Nil(t, batch.Error)
	v := b.view(t, p)
	require.Equal(t, int64(80), v.Daily.Charged, "the batch estimate reconciled to actual")
	require.Equal(t, int64(80), v.Totals.TotalRungs)

	// Completing again changes nothing: a terminal batch does not change.
	require.Empty(t, b.complete(t, owner, items, 99))
	again, _ := b.batch(t, p, id)
	require.Equal(t, batch, again)
}

func TestLeaseRescueRefusesZombies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 50, "", day())
	zombie := uuid.Must(uuid.NewV7())
	items := b.claim(t, zombie, 10, 50*time.Millisecond)
	require.Len(t, items, 2)

	// The live replica renews its leases; the dead one does not.
	time.Sleep(100 * time.Millisecond)
	n, err := b.store.RescueExpiredLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "one batch touched")

	// The zombie's late outcomes are refused.
	require.Empty(t, b.complete(t, zombie, items, 10))
	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchFailed, batch.Status)
	require.Equal(t, gateway.EInterrupted, batch.Error.Code)
	for _, r := range results {
		require.Equal(t, gateway.ItemFailed, r.Status)
		require.Equal(t, gateway.EInterrupted, r.Error.Code)
		require.Zero(t, r.Usage)
	}
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute), "interrupted items never run again")
	require.Zero(t, b.view(t, p).Daily.Charged)

	// Renewed leases are not rescued.
	b.newBatch(t, p, 1, 1, "", day())
	live := uuid.Must(uuid.NewV7())
	held := b.claim(t, live, 10, 50*time.Millisecond)
	require.Len(t, held, 1)
	renewed, err := b.store.RenewLeases(b.ctx, live, keysOf(held), time.Minute)
	require.NoError(t, err)
	require.Equal(t, int64(1), renewed)
	time.Sleep(100 * time.Millisecond)
	n, err = b.store.RescueExpiredLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Zero(t, n)
}

// TestAnOutcomeOfAnItemHandedBackIsRefused: once a replica handed its items
// back and another claimed them, the first one's late outcomes are refused
// (the item is running, under another owner); the second one's are stored,
// and the usage counted once.
func TestAnOutcomeOfAnItemHandedBackIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 50, "", day())
	first, second := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	items := b.claim(t, first, 10, time.Minute)
	require.Len(t, items, 2)
	back, err := b.store.RequeueItems(b.ctx, first, keysOf(items))
	require.NoError(t, err)
	require.Len(t, back.Queued, 2)
	again := b.claim(t, second, 10, time.Minute)
	require.ElementsMatch(t, keysOf(items), keysOf(again))

	require.Empty(t, b.completeItems(t, first, items, 10), "the first owner's outcomes")
	require.Len(t, b.complete(t, second, again, 20), 2)
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.Equal(t, int64(40), batch.Usage.TotalRungs)
	require.Equal(t, int64(40), b.view(t, p).Daily.Charged)
}

// TestItemOutcomesReadWhatWasStored: the outcomes read back after a reply
// lost (ItemOutcomes) are each item's as stored, an item without an error
// code or a cost read as none; a key of no item is left out.
func TestItemOutcomesReadWhatWasStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id, owner, items := b.claimedBatch(t, p, 3, 10)
	b.completeItems(t, owner, items[:1], 7)
	_, err := b.store.CompleteItems(b.ctx, owner, []store.ItemResult{{BatchID: id, Index: 1, Status: "failed", ErrorCode: string(gateway.EInferenceBusy), ErrorMessage: "busy"}})
	require.NoError(t, err)

	got, err := b.store.ItemOutcomes(b.ctx, []store.ItemKey{{BatchID: id, Index: 0}, {BatchID: id, Index: 1}, {BatchID: id, Index: 2}, {BatchID: id, Index: 3}})
	require.NoError(t, err)
	require.Equal(t, map[store.ItemKey]store.ItemOutcome{
		{BatchID: id, Index: 0}: {Status: "completed", TotalRungs: 7},
		{BatchID: id, Index: 1}: {Status: "failed", ErrorCode: string(gateway.EInferenceBusy)},
		{BatchID: id, Index: 2}: {Status: "in_progress"},
	}, got)
}

func TestRequeueReturnsBudget(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	b.newBatch(t, p, 2, 100, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 10, time.Minute)
	require.Len(t, items, 2)
	require.Equal(t, int64(200), b.view(t, p).Budget.Reserved)
	r, err := b.store.RequeueItems(b.ctx, owner, keysOf(items[:1]))
	require.NoError(t, err)
	require.Equal(t, store.Requeued{Queued: keysOf(items[:1])}, r)
	require.Equal(t, int64(100), b.view(t, p).Budget.Reserved)
	again := b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute)
	require.Len(t, again, 1)
	require.Equal(t, items[0].Index, again[0].Index)
}

// TestEveryWayOutSettlesOnce: on a capped project, each way an item leaves
// its run (completed, completed again by a replay, failed, put back in the
// queue, interrupted, cancelled) settles its day charge and budget reservation
// exactly once, and once folded the counters agree with the view.
func TestEveryWayOutSettlesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	id, owner, items := b.claimedBatch(t, p, 4, 100)
	require.Equal(t, int64(400), b.view(t, p).Budget.Reserved)

	b.complete(t, owner, items[:1], 30)
	require.Empty(t, b.complete(t, owner, items[:1], 30), "a replayed outcome changes nothing")
	// A failed item is not billed, whatever usage its outcome tells.
	failed, err := b.store.CompleteItems(b.ctx, owner, []store.ItemResult{{BatchID: id, Index: items[1].Index, Status: "failed", ErrorCode: "INFERENCE_FAILED", ErrorMessage: "no",
		InputTokens: 10, InputRungs: 10, TotalRungs: 10}})
	require.NoError(t, err)
	require.Len(t, failed, 1)
	_, err = b.store.RequeueItems(b.ctx, owner, keysOf(items[2:3]))
	require.NoError(t, err)
	v := b.view(t, p)
	require.Equal(t, gateway.BudgetState{Project: "default", Cap: ptr(int64(1000)), Spent: 30, Reserved: 100}, v.Budget, "only the item still running holds its reservation")
	require.Equal(t, int64(400-70-100), v.Daily.Charged, "the requeued item is still charged its estimate")

	// The last running item's replica dies; the requeued one is cancelled.
	_, err = b.store.RenewLeases(b.ctx, owner, keysOf(items[3:]), time.Millisecond)
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)
	n, err := b.store.RescueExpiredLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id))
	want := gateway.BudgetState{Project: "default", Cap: ptr(int64(1000)), Spent: 30, Reserved: 0}
	v = b.view(t, p)
	require.Equal(t, want, v.Budget)
	require.Equal(t, int64(30), v.Daily.Charged)

	folded, err := b.store.ReconcileSettlements(b.ctx, 100)
	require.NoError(t, err)
	require.Positive(t, folded)
	folded, err = b.store.ReconcileSettlements(b.ctx, 100)
	require.NoError(t, err)
	require.Zero(t, folded, "nothing settles twice")
	v = b.view(t, p)
	require.Equal(t, want, v.Budget)
	require.Equal(t, int64(30), v.Daily.Charged)

	// Nor does a later write to the ended items (a migration's, say).
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE batch_items SET attempts = attempts WHERE batch_id = $1`, id)
	require.NoError(t, err)
	folded, err = b.store.ReconcileSettlements(b.ctx, 100)
	require.NoError(t, err)
	require.Zero(t, folded, "an ended item settles once")
}

// TestAFailedBatchNamesItsFirstItemsError: a batch none of whose items
// succeeded fails with the error of its first item by index, whatever order
// they failed in.
func TestAFailedBatchNamesItsFirstItemsError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 10, "", day())
	owner := uuid.Must(uuid.NewV7())
	require.Len(t, b.claim(t, owner, 8, time.Minute), 2)
	for _, r := range []store.ItemResult{
		{BatchID: id, Index: 1, Status: "failed", ErrorCode: string(gateway.EInferenceBusy), ErrorMessage: "busy"},
		{BatchID: id, Index: 0, Status: "failed", ErrorCode: string(gateway.EInterrupted), ErrorMessage: "gone"},
	} {
		applied, err := b.store.CompleteItems(b.ctx, owner, []store.ItemResult{r})
		require.NoError(t, err)
		require.Len(t, applied, 1)
	}
	require.NoError(t, b.store.FinishBatches(b.ctx, []uuid.UUID{id}))
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchFailed, batch.Status)
	require.Equal(t, gateway.EInterrupted, batch.Error.Code)
}

func TestBudgetExhaustedMidBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(250)))
	id := b.newBatch(t, p, 5, 100, "", day())
	owner := uuid.Must(uuid.NewV7())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 10, PerAccount: 10, Lease: time.Minute})
	require.NoError(t, err)
	var claimed []store.ClaimedItem
	refused := 0
	for _, it := range items {
		if it.BudgetRefused {
			refused++
		} else {
			claimed = append(claimed, it)
		}
	}
	require.Len(t, claimed, 2, "the cap fits two reservations")
	require.Equal(t, 1, refused)
	b.complete(t, owner, claimed, 40)

	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCompleted, batch.Status, "the batch still reports every outcome")
	require.Equal(t, 2, batch.Completed)
	require.Equal(t, 3, batch.Failed)
	for _, r := range results[2:] {
		require.Equal(t, gateway.ItemFailed, r.Status)
		require.Equal(t, gateway.EBudgetExceeded, r.Error.Code)
		require.Zero(t, r.Usage)
	}
	v := b.view(t, p)
	require.Equal(t, int64(80), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)
	require.Equal(t, int64(80), v.Daily.Charged)
}

// TestStrandedBatchesAreFinished: the housekeeping finishes the open batches
// whose items all reached an outcome while their finish was missed (the
// replica died between the two, or the database was away for longer than
// its retries): a batch running, and a batch still queued whose items a claim
// refused their budget, or that completed before the batch's start was
// recorded. A queued batch with an item waiting is left as it is.
func TestStrandedBatchesAreFinished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, capped := b.key(t, "capped", gateway.TierDeveloper, gateway.ScopeInference)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "capped", nil, ptr(int64(10)))
	owner := uuid.Must(uuid.NewV7())
	claim := func() []store.ClaimedItem {
		t.Helper()
		items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 10, PerAccount: 10, Lease: time.Minute})
		require.NoError(t, err)
		return items
	}

	refused := b.newBatch(t, capped, 3, 100, "", day())
	items := claim()
	require.Len(t, items, 1)
	require.True(t, items[0].BudgetRefused, "the claim fails the batch's items")
	running := b.newBatch(t, p, 2, 10, "", day())
	items = claim()
	require.Len(t, items, 2)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{running}))
	b.completeItems(t, owner, items, 10)
	unstarted := b.newBatch(t, p, 2, 10, "", day())
	b.completeItems(t, owner, claim(), 10)
	cancelling := b.newBatch(t, p, 1, 10, "", day())
	items = claim()
	require.Len(t, items, 1)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, cancelling))
	b.completeItems(t, owner, items, 10)
	waiting := b.newBatch(t, p, 2, 10, "", day())
	for who, id := range map[*gateway.Principal]uuid.UUID{capped: refused, p: unstarted} {
		batch, _ := b.batch(t, who, id)
		require.Equal(t, gateway.BatchQueued, batch.Status, "every item ended, the finish missed")
	}
	batch, _ := b.batch(t, p, cancelling)
	require.Equal(t, gateway.BatchCancelling, batch.Status, "its running item ended, the finish missed")

	n, err := b.store.FinishStrandedBatches(b.ctx, 10)
	require.NoError(t, err)
	require.Equal(t, int64(4), n)
	batch, _ = b.batch(t, p, cancelling)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	batch, results := b.batch(t, capped, refused)
	require.Equal(t, gateway.BatchFailed, batch.Status)
	require.Equal(t, gateway.EBudgetExceeded, batch.Error.Code)
	require.Equal(t, 3, batch.Failed)
	for _, r := range results {
		require.Equal(t, gateway.EBudgetExceeded, r.Error.Code)
	}
	for _, id := range []uuid.UUID{running, unstarted} {
		batch, _ := b.batch(t, p, id)
		require.Equal(t, gateway.BatchCompleted, batch.Status)
		require.Equal(t, 2, batch.Completed)
	}
	batch, _ = b.batch(t, p, waiting)
	require.Equal(t, gateway.BatchQueued, batch.Status, "its items wait to be claimed")

	n, err = b.store.FinishStrandedBatches(b.ctx, 10)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is left stranded")
}

func TestCancelBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)

	queued := b.newBatch(t, p, 3, 50, "", day())
	require.Equal(t, gateway.EBatchNotFound, gateway.ErrorCodeOf(b.store.CancelBatch(b.ctx, other.AccountID, queued)))
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, queued))
	batch, results := b.batch(t, p, queued)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	for _, r := range results {
		require.Equal(t, gateway.ItemCancelled, r.Status)
	}
	require.Zero(t, b.view(t, p).Daily.Charged, "cancelled items give back their estimates")
	require.Equal(t, gateway.EBatchNotCancellable, gateway.ErrorCodeOf(b.store.CancelBatch(b.ctx, p.AccountID, queued)))

	running := b.newBatch(t, p, 3, 50, "", day())
	owner := uuid.Must(uuid.NewV7())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{running}))
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, running))
	batch, results = b.batch(t, p, running)
	require.Equal(t, gateway.BatchCancelling, batch.Status)
	require.Equal(t, gateway.ItemInProgress, results[0].Status)
	require.Equal(t, gateway.ItemCancelled, results[1].Status)
	require.Equal(t, gateway.EBatchNotCancellable, gateway.ErrorCodeOf(b.store.CancelBatch(b.ctx, p.AccountID, running)))

	// The item in flight finishes and is billed; then the batch is cancelled.
	b.complete(t, owner, items, 30)
	batch, results = b.batch(t, p, running)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.Equal(t, gateway.ItemCompleted, results[0].Status)
	require.Equal(t, int64(30), batch.Usage.TotalRungs)
	require.Equal(t, int64(30), b.view(t, p).Daily.Charged)
}

// lockBatch holds batch id's row in a transaction, as a replica moving the
// batch does, until the caller commits it or the test ends.
func (b *testBundle) lockBatch(t *testing.T, id uuid.UUID) pgx.Tx {
	t.Helper()
	tx, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM batches WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)
	return tx
}

// claimedBatch creates a batch of n items of estimate est for p and has a
// new owner claim them all, the queue holding no other item: a claim of
// more finds n.
func (b *testBundle) claimedBatch(t *testing.T, p *gateway.Principal, n int, est int64) (id, owner uuid.UUID, items []store.ClaimedItem) {
	t.Helper()
	id, owner = b.newBatch(t, p, n, est, "", day()), uuid.Must(uuid.NewV7())
	items = b.claim(t, owner, n+1, time.Minute)
	require.Len(t, items, n)
	return id, owner, items
}

// startedBatch creates a batch of n items for p, in progress with its first
// item claimed by owner (the queue holding no other item), and returns them.
func (b *testBundle) startedBatch(t *testing.T, p *gateway.Principal, n int) (id, owner uuid.UUID, item store.ClaimedItem) {
	t.Helper()
	id, owner = b.newBatch(t, p, n, 50, "", day()), uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 1, time.Minute)
	require.Len(t, items, 1)
	require.Equal(t, id, items[0].BatchID)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{id}))
	return id, owner, items[0]
}

// TestBatchesForOperator: operators list the batches of every account (or
// of one, or of some statuses), newest first with their account, project and
// totals, and cancel any account's batch as its owner would.
func TestBatchesForOperator(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	running, owner, item := b.startedBatch(t, other, 2)
	b.complete(t, owner, []store.ClaimedItem{item}, 30)
	older := b.newBatch(t, acme, 3, 50, "", day())
	newest := b.newBatch(t, acme, 1, 50, "", day())

	ids := func(list []store.OperatorBatch) (out []uuid.UUID) {
		for _, x := range list {
			out = append(out, x.ID)
		}
		return out
	}
	all, err := b.store.BatchesForOperator(b.ctx, "", nil, nil, 10)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{newest, older, running}, ids(all), "every account's, newest first")
	require.Equal(t, store.OperatorBatch{ID: running, Account: "other", Project: "default", Status: "in_progress", TotalRequests: 2,
		CreatedAt: all[2].CreatedAt, ExpiresAt: all[2].ExpiresAt, CompletedRequests: 1, TotalRungs: 30}, all[2])
	limited, err := b.store.BatchesForOperator(b.ctx, "", nil, nil, 2)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{newest, older}, ids(limited))
	next, err := b.store.BatchesForOperator(b.ctx, "", nil, &limited[1].ID, 2)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{running}, ids(next), "the next page")
	next, err = b.store.BatchesForOperator(b.ctx, "acme", nil, &newest, 2)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{older}, ids(next), "the next page of one account's")
	acmes, err := b.store.BatchesForOperator(b.ctx, "acme", nil, nil, 10)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{newest, older}, ids(acmes))
	open, err := b.store.BatchesForOperator(b.ctx, "", []gateway.BatchStatus{gateway.BatchInProgress, gateway.BatchCancelling}, nil, 10)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{running}, ids(open))
	none, err := b.store.BatchesForOperator(b.ctx, "other", []gateway.BatchStatus{gateway.BatchQueued}, nil, 10)
	require.NoError(t, err)
	require.Empty(t, none, "an account with no such batches")
	_, err = b.store.BatchesForOperator(b.ctx, "nobody", nil, nil, 10)
	require.ErrorIs(t, err, store.ErrAccountNotFound, "an account that does not exist is not one without batches")

	status, err := b.store.CancelBatchForOperator(b.ctx, older)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCancelled, status)
	batch, results := b.batch(t, acme, older)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.Equal(t, gateway.ItemCancelled, results[2].Status)
	status, err = b.store.CancelBatchForOperator(b.ctx, running)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCancelled, status, "its last item was done: cancelled at once")
	batch, results = b.batch(t, other, running)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.Equal(t, gateway.ItemCompleted, results[0].Status)
	require.Equal(t, gateway.ItemCancelled, results[1].Status)
	_, err = b.store.CancelBatchForOperator(b.ctx, running)
	require.Equal(t, gateway.EBatchNotCancellable, gateway.ErrorCodeOf(err))
	_, err = b.store.CancelBatchForOperator(b.ctx, uuid.Must(uuid.NewV7()))
	require.Equal(t, gateway.EBatchNotFound, gateway.ErrorCodeOf(err))

	cancelled, err := b.store.BatchesForOperator(b.ctx, "", []gateway.BatchStatus{gateway.BatchCancelled}, nil, 10)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{older, running}, ids(cancelled))

	// A batch that ended in error is listed with its error's code.
	b.pastWindow(t, newest)
	_, err = b.store.ExpireBatches(b.ctx, 10)
	require.NoError(t, err)
	expired, err := b.store.BatchesForOperator(b.ctx, "acme", []gateway.BatchStatus{gateway.BatchExpired}, nil, 10)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{newest}, ids(expired))
	require.NotNil(t, expired[0].ErrorCode)
	require.Equal(t, string(gateway.EBatchExpired), *expired[0].ErrorCode)

	// A batch with an item running (nothing else is queued) is cancelling
	// until the item is done.
	busy := b.newBatch(t, other, 2, 50, "", day())
	items := b.claim(t, owner, 1, time.Minute)
	require.Len(t, items, 1)
	require.Equal(t, busy, items[0].BatchID)
	status, err = b.store.CancelBatchForOperator(b.ctx, busy)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCancelling, status)
	b.complete(t, owner, items, 20)
	batch, _ = b.batch(t, other, busy)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
}

// TestCancelAccountBatches: an operator cancels every open batch of one
// account: a queued one is cancelled, one with an item running is cancelling;
// one that cannot move is reported and the others go on; another account's
// batch is untouched; a batch cancelling or cancelled is not tried again.
func TestCancelAccountBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	running, _, _ := b.startedBatch(t, acme, 1)
	queued, stuck := b.newBatch(t, acme, 2, 50, "", day()), b.newBatch(t, acme, 2, 50, "", day())
	others := b.newBatch(t, other, 2, 50, "", day())
	b.refuseMoves(t, stuck)

	outcomes, err := b.store.CancelAccountBatches(b.ctx, "acme")
	require.NoError(t, err)
	got := map[uuid.UUID]store.CancelOutcome{}
	for _, o := range outcomes {
		got[o.ID] = o
	}
	require.Len(t, got, 3)
	require.NoError(t, got[queued].Err)
	require.Equal(t, gateway.BatchCancelled, got[queued].Status)
	require.NoError(t, got[running].Err)
	require.Equal(t, gateway.BatchCancelling, got[running].Status, "its item runs")
	require.ErrorContains(t, got[stuck].Err, "this batch cannot move")
	for id, want := range map[uuid.UUID]gateway.BatchStatus{queued: gateway.BatchCancelled, running: gateway.BatchCancelling, stuck: gateway.BatchQueued} {
		batch, _ := b.batch(t, acme, id)
		require.Equal(t, want, batch.Status)
	}
	batch, _ := b.batch(t, other, others)
	require.Equal(t, gateway.BatchQueued, batch.Status, "another account's batch")

	// Again: only the one that failed is tried.
	outcomes, err = b.store.CancelAccountBatches(b.ctx, "acme")
	require.NoError(t, err)
	require.Len(t, outcomes, 1)
	require.Equal(t, stuck, outcomes[0].ID)
	require.Error(t, outcomes[0].Err)
	outcomes, err = b.store.CancelAccountBatches(b.ctx, "other")
	require.NoError(t, err)
	require.Equal(t, []store.CancelOutcome{{ID: others, Status: gateway.BatchCancelled}}, outcomes)
	outcomes, err = b.store.CancelAccountBatches(b.ctx, "other")
	require.NoError(t, err)
	require.Empty(t, outcomes, "nothing left to cancel")
	_, err = b.store.CancelAccountBatches(b.ctx, "nobody")
	require.ErrorIs(t, err, store.ErrAccountNotFound)
}

// TestCancelAccountBatchesStopsWithItsContext: a cancel of an account's
// batches whose context ends stops there, with what it has done, rather than
// trying each batch left.
func TestCancelAccountBatchesStopsWithItsContext(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	for range 3 {
		b.newBatch(t, acme, 1, 50, "", day())
	}
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	traced := b.traced(t, &cancelAfter{name: "name: CancelQueuedItems", cancel: cancel})
	outcomes, err := traced.CancelAccountBatches(ctx, "acme")
	require.ErrorIs(t, err, context.Canceled)
	require.Len(t, outcomes, 1, "the batch being cancelled when the context ended is the last tried")
}

// cancelAfter calls cancel once a statement whose text holds name has run
// (a context's cancel, or anything that must happen right after it).
type cancelAfter struct {
	name   string
	cancel func()
}

// cancelling marks the context of the statement after which cancelAfter
// cancels.
type cancelling struct{}

func (c *cancelAfter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, c.name) {
		return context.WithValue(ctx, cancelling{}, true)
	}
	return ctx
}

func (c *cancelAfter) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(cancelling{}) != nil {
		c.cancel()
	}
}

// TestCancelAccountBatchesPastFailingPages: batches that fail to cancel,
// however many, do not keep an account's cancel from the batches listed
// after them: here a page is two batches, and the three newest fail.
func TestCancelAccountBatchesPastFailingPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	var ids []uuid.UUID
	for range 5 {
		ids = append(ids, b.newBatch(t, acme, 1, 50, "", day())) // ids grow: the last is the newest
	}
	b.refuseMoves(t, ids[2:]...)

	outcomes, err := b.store.CancelAccountBatchesPaged(b.ctx, "acme", 2)
	require.NoError(t, err)
	got := map[uuid.UUID]store.CancelOutcome{}
	for _, o := range outcomes {
		got[o.ID] = o
	}
	require.Len(t, outcomes, 5, "each tried once")
	require.Len(t, got, 5)
	for _, id := range ids[:2] {
		require.NoError(t, got[id].Err)
		require.Equal(t, gateway.BatchCancelled, got[id].Status)
		batch, _ := b.batch(t, acme, id)
		require.Equal(t, gateway.BatchCancelled, batch.Status)
	}
	for _, id := range ids[2:] {
		require.ErrorContains(t, got[id].Err, "this batch cannot move")
	}
}

func TestExpireBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	// The window ends once the claims below are done, moved into the past
	// (see pastWindow) rather than waited for, which a slow run would race.
	window := time.Now().Add(time.Hour)
	queued := b.newBatch(t, p, 2, 50, "", window)
	running := b.newBatch(t, p, 3, 50, "", window)
	owner := uuid.Must(uuid.NewV7())
	items, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.Equal(t, queued, items[0].BatchID, "the oldest batch first")
	// Make the running batch the one with the item in flight.
	_, err = b.store.RequeueItems(b.ctx, owner, []store.ItemKey{{BatchID: items[0].BatchID, Index: items[0].Index}})
	require.NoError(t, err)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, queued))
	queued = b.newBatch(t, p, 2, 50, "", window)
	items, err = b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.Equal(t, running, items[0].BatchID)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{running}))

	b.pastWindow(t, queued, running)
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute), "nothing past its window is claimed")
	n, err := b.store.ExpireBatches(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(2), n)

	batch, results := b.batch(t, p, queued)
	require.Equal(t, gateway.BatchExpired, batch.Status)
	require.Equal(t, gateway.EBatchExpired, batch.Error.Code)
	require.Equal(t, gateway.ItemCancelled, results[0].Status)

	batch, _ = b.batch(t, p, running)
	require.Equal(t, gateway.BatchInProgress, batch.Status, "waits for the item in flight")
	b.complete(t, owner, items, 25)
	batch, results = b.batch(t, p, running)
	require.Equal(t, gateway.BatchExpired, batch.Status)
	require.Equal(t, gateway.ItemCompleted, results[0].Status, "results already produced stay")
	require.Equal(t, gateway.ItemCancelled, results[1].Status)
	require.Equal(t, int64(25), b.view(t, p).Daily.Charged)

	// Retention removes terminal batches; their usage stays.
	deleted, err := b.store.DeleteOldBatches(b.ctx, time.Now().Add(time.Minute), 100)
	require.NoError(t, err)
	require.Equal(t, int64(3), deleted)
	_, err = b.store.Batch(b.ctx, p.AccountID, running)
	require.Equal(t, gateway.EBatchNotFound, gateway.ErrorCodeOf(err))
	require.Equal(t, int64(25), b.view(t, p).Totals.TotalRungs)
}

// TestABatchWhoseItemsEndedIsNotExpired: a batch whose items all ended
// before its window did, its finish missed (here it was still queued: its
// start was never recorded), is finished by its items when the window's end
// finds it, not made expired: expired says the window ended before every
// item ran.
func TestABatchWhoseItemsEndedIsNotExpired(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 50, "", day())
	owner := uuid.Must(uuid.NewV7())
	b.completeItems(t, owner, b.claim(t, owner, 10, time.Minute), 25)
	b.pastWindow(t, id)

	n, err := b.store.ExpireBatches(b.ctx, 10)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.Nil(t, batch.Error)
	require.Equal(t, 2, batch.Completed)
	for _, r := range results {
		require.Equal(t, gateway.ItemCompleted, r.Status)
	}
}

// pastWindow ends the completion window of batches and their items a
// second ago.
func (b *testBundle) pastWindow(t *testing.T, batches ...uuid.UUID) {
	t.Helper()
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE batches SET expires_at = now() - interval '1 second' WHERE id = ANY($1)`, batches)
	require.NoError(t, err)
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE batch_items SET expires_at = now() - interval '1 second' WHERE batch_id = ANY($1)`, batches)
	require.NoError(t, err)
}

// startTracer is a pgx.QueryTracer that looks only at statements' starts.
type startTracer struct{}

func (startTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestStartAndFinishLockOnlyBatchesThatCanMove: every lock of a batch is a
// durable commit, and replicas often ask to start or finish the same batch:
// StartBatches locks only batches still queued, FinishBatches only batches not
// yet terminal whose items are all done.
func TestStartAndFinishLockOnlyBatchesThatCanMove(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	queued := b.newBatch(t, p, 2, 10, "", day())
	running := b.newBatch(t, p, 2, 10, "", day())
	done := b.newBatch(t, p, 1, 10, "", day())
	owner := uuid.Must(uuid.NewV7())
	var items []store.ClaimedItem
	for _, it := range b.claim(t, owner, 10, time.Minute) {
		if it.BatchID != queued {
			items = append(items, it)
		}
	}
	require.Len(t, items, 3)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{running, done}))
	for _, it := range items {
		if it.BatchID == done {
			b.complete(t, owner, []store.ClaimedItem{it}, 10)
		}
	}
	batch, _ := b.batch(t, p, done)
	require.Equal(t, gateway.BatchCompleted, batch.Status)

	names := &statementNames{}
	traced := b.traced(t, names)
	all := []uuid.UUID{queued, running, done}

	require.NoError(t, traced.StartBatches(b.ctx, all))
	require.Equal(t, 1, names.takeCount("LockBatch"), "only the queued batch is locked to start")
	batch, _ = b.batch(t, p, queued)
	require.Equal(t, gateway.BatchInProgress, batch.Status)

	require.NoError(t, traced.FinishBatches(b.ctx, all))
	require.Zero(t, names.takeCount("LockBatch"), "no batch can finish: items unfinished, or already terminal")
	for id, want := range map[uuid.UUID]gateway.BatchStatus{running: gateway.BatchInProgress, done: gateway.BatchCompleted} {
		batch, _ = b.batch(t, p, id)
		require.Equal(t, want, batch.Status)
	}
}

// traced is a store on a pool of its own whose statements tracer sees.
func (b *testBundle) traced(t *testing.T, tracer pgx.QueryTracer) *store.Store {
	t.Helper()
	return store.New(b.poolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tracer }))
}

// holdingTracer holds a transition that locked its batch before it writes
// the new status, until released.
type holdingTracer struct {
	startTracer
	holding, release chan struct{}
}

func (h *holdingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "name: SetBatchStatus") {
		close(h.holding)
		<-h.release
	}
	return ctx
}

// endTracer tells when a transition begins to lock its batch, and records how
// transactions end.
type endTracer struct {
	startTracer
	locking chan struct{}
	once    sync.Once
	mu      sync.Mutex
	ends    []string
}

func (e *endTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch sql := strings.ToLower(strings.TrimSpace(d.SQL)); {
	case strings.Contains(d.SQL, "name: LockBatch"):
		e.once.Do(func() { close(e.locking) })
	case sql == "commit" || sql == "rollback":
		e.mu.Lock()
		e.ends = append(e.ends, sql)
		e.mu.Unlock()
	}
	return ctx
}

// TestBatchesMoveTogether: the batches a start or a finish is given move in
// one transaction, one disk sync for them all.
func TestBatchesMoveTogether(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, ids, owner, items := b.oneItemBatchesClaimed(t, 5)
	ends := &endTracer{locking: make(chan struct{})}
	traced := b.traced(t, ends)

	require.NoError(t, traced.StartBatches(b.ctx, ids))
	require.Equal(t, []string{"commit"}, ends.ends, "five batches started in one transaction")
	b.completeItems(t, owner, items, 10)
	require.NoError(t, traced.FinishBatches(b.ctx, ids))
	require.Equal(t, []string{"commit", "commit"}, ends.ends, "and finished in one")
	for _, id := range ids {
		batch, _ := b.batch(t, p, id)
		require.Equal(t, gateway.BatchCompleted, batch.Status)
	}
}

// oneItemBatchesClaimed creates n batches of one item for a key of its own,
// and claims their items for owner.
func (b *testBundle) oneItemBatchesClaimed(t *testing.T, n int) (p *gateway.Principal, ids []uuid.UUID, owner uuid.UUID, items []store.ClaimedItem) {
	t.Helper()
	_, p = b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	ids = make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = b.newBatch(t, p, 1, 10, "", day())
	}
	owner = uuid.Must(uuid.NewV7())
	items = b.claim(t, owner, n, time.Minute)
	require.Len(t, items, n)
	return p, ids, owner, items
}

// refuseMoves makes every update of the batches ids fail ("this batch cannot
// move"), for tests of a failing member.
func (b *testBundle) refuseMoves(t *testing.T, ids ...uuid.UUID) {
	t.Helper()
	list := make([]string, len(ids))
	for i, id := range ids {
		list[i] = id.String()
	}
	_, err := b.store.Pool().Exec(b.ctx, fmt.Sprintf(`CREATE FUNCTION refuse_batch() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN IF NEW.id = ANY ('{%s}'::uuid[]) THEN RAISE EXCEPTION 'this batch cannot move'; END IF; RETURN NEW; END $$;
		CREATE TRIGGER refuse_batch BEFORE UPDATE ON batches FOR EACH ROW EXECUTE FUNCTION refuse_batch()`, strings.Join(list, ",")))
	require.NoError(t, err)
}

// TestAFailingMoveIsIsolated: when one batch of a group cannot move, the
// group's transaction fails, and every batch moves again on its own: that
// one is reported, the others move.
func TestAFailingMoveIsIsolated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, ids, owner, items := b.oneItemBatchesClaimed(t, 3)
	require.NoError(t, b.store.StartBatches(b.ctx, ids))
	b.completeItems(t, owner, items, 10)
	stuck := ids[1]
	b.refuseMoves(t, stuck)

	err := b.store.FinishBatches(b.ctx, ids)
	require.ErrorContains(t, err, "batch "+stuck.String())
	require.ErrorContains(t, err, "this batch cannot move")
	for _, id := range ids {
		want := gateway.BatchCompleted
		if id == stuck {
			want = gateway.BatchInProgress
		}
		batch, _ := b.batch(t, p, id)
		require.Equal(t, want, batch.Status)
	}

	_, err = b.store.Pool().Exec(b.ctx, `DROP TRIGGER refuse_batch ON batches`)
	require.NoError(t, err)
	require.NoError(t, b.store.FinishBatches(b.ctx, ids))
	batch, _ := b.batch(t, p, stuck)
	require.Equal(t, gateway.BatchCompleted, batch.Status, "finished once it can move")
}

// TestMoveAnotherReplicaMadeIsRolledBack: two replicas start the same batch at
// once; the one that finds it started when it gets the lock wrote nothing,
// and rolls back instead of waiting for a durable commit.
func TestMoveAnotherReplicaMadeIsRolledBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 1, 10, "", day())
	first := &holdingTracer{holding: make(chan struct{}), release: make(chan struct{})}
	second := &endTracer{locking: make(chan struct{})}
	firstDone, secondDone := make(chan error, 1), make(chan error, 1)
	go func() { firstDone <- b.traced(t, first).StartBatches(b.ctx, []uuid.UUID{id}) }()
	<-first.holding // the first holds the batch's lock, about to start it
	go func() { secondDone <- b.traced(t, second).StartBatches(b.ctx, []uuid.UUID{id}) }()
	<-second.locking // the second found it queued, and waits for the lock
	close(first.release)
	require.NoError(t, <-firstDone)
	require.NoError(t, <-secondDone)
	require.Equal(t, []string{"rollback"}, second.ends, "nothing to commit")
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchInProgress, batch.Status)
}

// TestAStartOfABatchCancelledMeanwhileIsNone: a batch found queued, then
// cancelled before the start locks it, is left cancelled without an error;
// a start of no batch sends nothing.
func TestAStartOfABatchCancelledMeanwhileIsNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 1, 10, "", day())
	traced := b.traced(t, &cancelAfter{name: "name: QueuedBatches", cancel: func() {
		require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id))
	}})
	require.NoError(t, traced.StartBatches(b.ctx, []uuid.UUID{id}))
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCancelled, batch.Status)

	names := &statementNames{}
	traced = b.traced(t, names)
	require.NoError(t, traced.StartBatches(b.ctx, nil))
	require.NoError(t, traced.FinishBatches(b.ctx, nil))
	require.Empty(t, names.take())
}

// explained returns a store on the test's database, as its owner, whose
// every statement, nested ones included, has its plan logged by auto_explain,
// and the plans logged so far. It skips the test where the server has no
// auto_explain or will not load it.
func (b *testBundle) explained(t *testing.T) (*store.Store, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var plans []string
	cfg, err := pgxpool.ParseConfig(testdb.AsAdmin(t, b.store.Pool().Config().ConnString()))
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		plans = append(plans, n.Message)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;
			SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice`)
		return err
	}
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	if err := pool.Ping(b.ctx); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "58P01") {
			t.Skipf("auto_explain is not installed, or needs a superuser, on the test server: %v", err)
		}
		require.NoError(t, err)
	}
	return store.New(pool), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), plans...)
	}
}

// TestQueueStatementsFindRowsByKeyAfterAnEmptyQueueWasAnalyzed: statistics
// taken while the queue was empty (every item finished, as after a drain) make
// the claim index look empty; the claim's update then read every queued item
// through it to find the few it had locked (42 ms a claim, 650 items/s, in a
// drain of 20,000 items started after such an ANALYZE). It finds them by
// address; the claim reads that index only with each account's bounds (not
// whole, once for each account, to tell which have work); and nothing else
// reads it: not the claim's look-ups by key of a capped project's items, nor a
// cancel. The drainer's check for a finished batch reads the batch's items
// (not every item, which the few batches such statistics counted made look
// cheaper).
func TestQueueStatementsFindRowsByKeyAfterAnEmptyQueueWasAnalyzed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, capped := b.key(t, "capped", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "capped", nil, ptr(int64(150)))
	owner := uuid.Must(uuid.NewV7())
	explained, plans := b.explained(t)
	// No analyze but the test's own.
	_, err := explained.Pool().Exec(b.ctx, `ALTER TABLE batch_items SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	for range 5 {
		b.newBatch(t, p, 100, 10, "", day())
		b.complete(t, owner, b.claim(t, owner, 100, time.Minute), 10)
	}
	_, err = explained.Pool().Exec(b.ctx, `ANALYZE batch_items`)
	require.NoError(t, err)

	// A capped project's items reserve their estimates in claim order: the
	// first fits the cap, the second does not and fails with the rest of its
	// batch.
	b.newBatch(t, capped, 100, 100, "", day())
	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 2, PerAccount: 2, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 2)
	require.True(t, items[1].BudgetRefused)

	// The queue grows past what was analyzed: many more batches, in a table
	// large enough that reading it all costs more than a batch's items.
	ids := make([]uuid.UUID, 40)
	for i := range ids {
		ids[i] = b.newBatch(t, p, 100, 10, "", day())
	}
	items, err = explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 32, PerAccount: 32, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 32)
	// The drainer's moves of the batches it dispatched and finished items of
	// read the batches by key and their items by batch.
	require.NoError(t, explained.StartBatches(b.ctx, ids[:1]))
	require.NoError(t, explained.FinishBatches(b.ctx, ids[:1]))
	require.NoError(t, explained.CancelBatch(b.ctx, p.AccountID, ids[len(ids)-1]))

	chose, byAddress, moves := 0, 0, 0
	for _, plan := range plans() {
		switch {
		case strings.Contains(plan, "open_since"):
			chose++ // the claim's choice of items, through the claim index,
			// each account's from where its items start
			require.Empty(t, scansWithoutCond(plan, "batch_items_claim_idx"), plan)
			continue
		case strings.Contains(plan, "Update on batch_items") && strings.Contains(plan, "Tid Scan on batch_items"):
			byAddress++
		case strings.Contains(plan, doneBatchesStatement):
			moves++ // the finish's choice, in done_batches (migrations 00026, 00042)
			require.NotContains(t, plan, "Seq Scan on batch_items", plan)
			require.Empty(t, scansWithoutCond(plan, "batch_items_pkey"), plan)
		}
		require.NotContains(t, plan, "batch_items_claim_idx", plan)
	}
	require.Equal(t, 2, chose, "both claims' choices of items were explained: %q", plans())
	require.Equal(t, 3, byAddress, "both claims updated the items they locked by address, the first its capped project's too: %q", plans())
	require.Equal(t, 1, moves, "the finish's choice of batches was explained: %q", plans())
}

// TestBatchMovesFindBatchesByKeyAfterNoneWasOpen: statistics of the batches
// taken while none was open make the index of open batches look empty; the
// drainer's choices of batches to start and to finish read every open batch
// through it to find the few they were given, and a claim did so for each item
// it considered. They find them by key (or, in a table this small, read it
// whole).
func TestBatchMovesFindBatchesByKeyAfterNoneWasOpen(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	owner := uuid.Must(uuid.NewV7())
	explained, plans := b.explained(t)
	_, err := explained.Pool().Exec(b.ctx, `ALTER TABLE batches SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	for range 300 {
		b.newBatch(t, p, 1, 10, "", day())
	}
	b.complete(t, owner, b.claim(t, owner, 300, time.Minute), 10)
	_, err = explained.Pool().Exec(b.ctx, `ANALYZE batches`)
	require.NoError(t, err)
	ids := make([]uuid.UUID, 40)
	for i := range ids {
		ids[i] = b.newBatch(t, p, 2, 10, "", day())
	}

	require.NoError(t, explained.StartBatches(b.ctx, ids[:2]))
	require.NoError(t, explained.FinishBatches(b.ctx, ids[:2]))
	// Both choices are functions (migrations 00026, 00030): their statements.
	moves := plansOf(t, plans(), []string{queuedBatchesStatement, doneBatchesStatement}, "batches_open_expires_idx", "batches_drainable_idx")
	require.Len(t, moves, 2, "the start's and the finish's choices of batches were explained: %q", plans())

	// A claim reads each item's batch by key too (ib, in claim_batch_items).
	items, err := explained.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, Max: 32, PerAccount: 32, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, items, 32)
	claims := plansOf(t, plans(), []string{"open_since"}, "using batches_open_expires_idx on batches ib", "using batches_drainable_idx on batches ib")
	require.Len(t, claims, 1, "the claim's choice of items was explained: %q", plans())
}

// TestFinishReadsEachBatchsItemsAfterAFinishedQueueWasAnalyzed: statistics
// taken when every batch and item was finished (after a drain) make the
// batches the finish is given, and their unfinished items, look like none. A
// plan of done_batches made then, while the tables were small, and kept
// (migration 00042) read the whole primary key of the items for each batch
// once the tables had grown, as a join filter: 13 ms a call of 64 one-item
// batches. It reads each batch's items by key.
func TestFinishReadsEachBatchsItemsAfterAFinishedQueueWasAnalyzed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	owner := uuid.Must(uuid.NewV7())
	for range 20 {
		b.newBatch(t, p, 1, 10, "", day())
	}
	b.complete(t, owner, b.claim(t, owner, 20, time.Minute), 10)
	b.analyzeOnce(t)
	explained, plans := b.explained(t)
	first := b.newBatch(t, p, 1, 10, "", day())
	b.completeItems(t, owner, b.claim(t, owner, 1, time.Minute), 10)
	require.NoError(t, explained.FinishBatches(b.ctx, []uuid.UUID{first})) // planned now

	ids := make([]uuid.UUID, 300)
	for i := range ids {
		ids[i] = b.newBatch(t, p, 1, 10, "", day())
	}
	b.completeItems(t, owner, b.claim(t, owner, len(ids), time.Minute), 10)
	_, err := explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on`)
	require.NoError(t, err)
	before := len(plans())
	require.NoError(t, explained.FinishBatches(b.ctx, ids))
	choices := plansOf(t, plans()[before:], []string{doneBatchesStatement})
	require.Len(t, choices, 1, "the finish's choice of batches was explained: %q", plans())
	require.Contains(t, choices[0], "rows=300 loops=1", "every batch was done: %s", choices[0])
	require.Empty(t, scansWithoutCond(choices[0], "batch_items_pkey"), choices[0])
	for _, id := range append(ids, first) {
		batch, _ := b.batch(t, p, id)
		require.Equal(t, gateway.BatchCompleted, batch.Status)
	}
}

// scansWithoutCond returns the lines of plan that scan index with no index
// condition: the whole index, read once for each row of the outer side.
func scansWithoutCond(plan, index string) []string {
	var bare []string
	lines := strings.Split(plan, "\n")
	for i, line := range lines {
		if !strings.Contains(line, "using "+index) {
			continue
		}
		if i+1 == len(lines) || !strings.Contains(lines[i+1], "Index Cond:") {
			bare = append(bare, line)
		}
	}
	return bare
}

// What names, in a plan auto_explain logged, the statement of a batch
// function (migrations 00026, 00028, 00030).
const (
	doneBatchesStatement     = "b.status IS NOT DISTINCT FROM 'cancelling')"                         // done_batches
	queuedBatchesStatement   = "WHERE b.id = ANY (p_ids) AND b.status IS NOT DISTINCT FROM 'queued'" // queued_batches
	lockBatchStatement       = "FOR UPDATE OF b"                                                     // lock_batch
	batchItemTotalsStatement = "FILTER (WHERE i.status = 'cancelled')::integer,"                     // batch_item_totals
)

// plansOf returns the plans that hold any of the strings in match, having
// required that none of those goes through an index of avoid.
func plansOf(t *testing.T, plans, match []string, avoid ...string) []string {
	t.Helper()
	var of []string
	for _, plan := range plans {
		if !slices.ContainsFunc(match, func(m string) bool { return strings.Contains(plan, m) }) {
			continue
		}
		for _, index := range avoid {
			require.NotContains(t, plan, index, plan)
		}
		of = append(of, plan)
	}
	return of
}

// TestRenewalSkipsItemsLockedElsewhere: a renewal does not wait for an item
// another statement holds (the completion of a group that has it, which
// locks its items in an order of its own): waiting, the two deadlocked.
func TestRenewalSkipsItemsLockedElsewhere(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 3, 10, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 3, time.Minute)
	require.Len(t, items, 3)

	tx, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = tx.Exec(b.ctx, "SELECT 1 FROM batch_items WHERE batch_id = $1 AND idx = $2 FOR NO KEY UPDATE",
		items[1].BatchID, items[1].Index)
	require.NoError(t, err)

	// Waiting for the locked item, the renewal would run into its lock
	// timeout.
	renewed, err := b.impatient(t).RenewLeases(b.ctx, owner, keysOf(items), time.Minute)
	require.NoError(t, err)
	require.Equal(t, int64(2), renewed, "the two items no one else holds")
	require.NoError(t, tx.Rollback(b.ctx))
	renewed, err = b.store.RenewLeases(b.ctx, owner, keysOf(items), time.Minute)
	require.NoError(t, err)
	require.Equal(t, int64(3), renewed, "the next beat renews it")
}

// TestCompletionAndRenewalFindItemsByKey: completing outcomes, renewing
// leases and handing items back find each item by its primary key, never
// through the partial indexes on running items. The lease owner's index
// keeps an entry for every item the owner ran until the table is vacuumed; a
// completion that went through it read them all, and a long drain slowed as
// it went. The plans are read from auto_explain, sent back as notices.
func TestCompletionAndRenewalFindItemsByKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	owner := uuid.Must(uuid.NewV7())
	// History: the table holds a few thousand items, all run by owner.
	for range 30 {
		b.newBatch(t, p, 100, 10, "", day())
		b.complete(t, owner, b.claim(t, owner, 100, time.Minute), 10)
	}

	explained, plans := b.explained(t)

	b.newBatch(t, p, 10, 10, "", day())
	items := b.claim(t, owner, 10, time.Minute)
	require.Len(t, items, 10)
	results := make([]store.ItemResult, len(items))
	for i, it := range items {
		results[i] = store.ItemResult{BatchID: it.BatchID, Index: it.Index, Status: "failed", ErrorCode: "INFERENCE_BUSY", ErrorMessage: "x"}
	}
	renewed, err := explained.RenewLeases(b.ctx, owner, keysOf(items), time.Minute)
	require.NoError(t, err)
	require.Equal(t, int64(10), renewed)
	applied, err := explained.CompleteItems(b.ctx, owner, results)
	require.NoError(t, err)
	require.Len(t, applied, 10)
	b.newBatch(t, p, 5, 10, "", day())
	handBack := b.claim(t, owner, 5, time.Minute)
	require.Len(t, handBack, 5)
	requeued, err := explained.RequeueItems(b.ctx, owner, keysOf(handBack))
	require.NoError(t, err)
	require.Len(t, requeued.Queued, 5)

	lookups := plansOf(t, plans(), []string{"Update on batch_items", "LockRows"}, "batch_items_owner_idx", "batch_items_lease_idx")
	for _, plan := range lookups {
		require.Contains(t, plan, "batch_items_pkey", plan)
	}
	require.Len(t, lookups, 4, "the renewal's, the completion's and the requeue's lock and update: %q", plans())
}

// TestRequeueWaitsForACancelOfItsBatch: an item handed back while its batch
// is being cancelled waits for the cancel and is cancelled with it, instead of
// going back to the queue of a batch no claim drains again. The cancel is
// played by hand: it holds the batch's row while it cancels the queued items.
func TestRequeueWaitsForACancelOfItsBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 3, 10, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 1, time.Minute)
	require.Len(t, items, 1)
	keys := keysOf(items)

	cancel := b.lockBatch(t, id)

	done := make(chan store.Requeued, 1)
	go func() {
		r, err := b.store.RequeueItems(b.ctx, owner, keys)
		assert.NoError(t, err)
		done <- r
	}()
	time.Sleep(300 * time.Millisecond) // a requeue that does not wait has finished by now
	_, err := cancel.Exec(b.ctx, `UPDATE batch_items SET status = 'cancelled', cancel_reason = 'owner', completed_at = now() WHERE batch_id = $1 AND status = 'queued'`, id)
	require.NoError(t, err)
	_, err = cancel.Exec(b.ctx, `UPDATE batches SET status = 'cancelling' WHERE id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, cancel.Commit(b.ctx))

	r := <-done
	require.Empty(t, r.Queued, "handed back to the queue of a batch being cancelled")
	require.Equal(t, keys, r.Cancelled)
	_, results := b.batch(t, p, id)
	for _, it := range results {
		require.Equal(t, gateway.ItemCancelled, it.Status)
	}
}

// TestExpiryWaitsForAnItemOfAQueuedBatch: a batch still queued when its
// window ends, with an item claimed (its start not yet recorded, or the item
// waiting for a worker), is not made terminal with that item running: its
// unrun items are cancelled and it waits for the item, then is expired with
// the item's outcome counted, never changed once terminal.
func TestExpiryWaitsForAnItemOfAQueuedBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 3, 50, "", time.Now().Add(time.Hour))
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 1, time.Minute)
	require.Len(t, items, 1)
	b.pastWindow(t, id)
	_, err := b.store.ExpireBatches(b.ctx, 10)
	require.NoError(t, err)
	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchQueued, batch.Status, "waits for the item claimed")
	require.Equal(t, gateway.ItemInProgress, results[0].Status)
	require.Equal(t, gateway.ItemCancelled, results[1].Status)
	require.Equal(t, gateway.ItemCancelled, results[2].Status)

	b.complete(t, owner, items, 25)
	batch, results = b.batch(t, p, id)
	require.Equal(t, gateway.BatchExpired, batch.Status)
	require.Equal(t, gateway.ItemCompleted, results[0].Status)
	require.Equal(t, 1, batch.Completed)
	require.Equal(t, int64(25), batch.Usage.TotalRungs)
}

// TestListenBatches: a listener hears every batch created, and the id of a
// batch cancelled or past its window while an item of it is claimed (so that
// the replica holding the item does not start it), and of no batch cancelled
// or expired with nothing claimed.
func TestListenBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	var created atomic.Int64
	stopped := make(chan uuid.UUID, 10)
	ctx, cancel := context.WithCancel(b.ctx)
	t.Cleanup(cancel) // before the database goes: the listener holds a connection
	listened := make(chan error, 1)
	go func() {
		listened <- b.store.ListenBatches(ctx, func() {}, func() { created.Add(1) }, func(id uuid.UUID) { stopped <- id })
	}()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%LISTEN batch_stopped%'`).Scan(&n))
		return n == 1
	}, 10*time.Second, 10*time.Millisecond, "listening")

	queued := b.newBatch(t, p, 2, 50, "", day())
	require.Eventually(t, func() bool { return created.Load() == 1 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, queued), "nothing of it claimed: no word")

	running, _, _ := b.startedBatch(t, p, 3)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, running))
	select {
	case id := <-stopped:
		require.Equal(t, running, id, "notifications come in the order of their commits")
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no word of the batch cancelled with an item claimed")
	}

	idle := b.newBatch(t, p, 2, 50, "", time.Now().Add(time.Hour))
	b.pastWindow(t, idle)
	_, err := b.store.ExpireBatches(b.ctx, 10)
	require.NoError(t, err)
	expiring := b.newBatch(t, p, 2, 50, "", time.Now().Add(time.Hour))
	require.Len(t, b.claim(t, uuid.Must(uuid.NewV7()), 1, time.Minute), 1)
	b.pastWindow(t, expiring)
	_, err = b.store.ExpireBatches(b.ctx, 10)
	require.NoError(t, err)
	select {
	case id := <-stopped:
		require.Equal(t, expiring, id, "no word of the batch expired with nothing claimed")
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no word of the batch past its window with an item claimed")
	}

	cancel()
	require.ErrorIs(t, <-listened, context.Canceled)
	require.Equal(t, int64(4), created.Load(), "every creation heard")
}

// TestABatchDoneBeforeItsStartKeepsOne: a batch whose items all finish
// before its start is recorded (the drainer starts batches in the
// background, after an item is sent) ends with the time its first item that
// ran was claimed as its start, before its end; one none of whose items ran
// (cancelled while queued) ends without a start.
func TestABatchDoneBeforeItsStartKeepsOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	ran := b.newBatch(t, p, 2, 1, "", day())
	owner := uuid.Must(uuid.NewV7())
	before := time.Now()
	b.complete(t, owner, b.claim(t, owner, 2, time.Minute), 3)
	batch, _ := b.batch(t, p, ran)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.NotNil(t, batch.StartedAt, "its items ran")
	require.WithinRange(t, *batch.StartedAt, before.Add(-time.Second), *batch.CompletedAt)

	unrun := b.newBatch(t, p, 1, 1, "", day())
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, unrun))
	batch, _ = b.batch(t, p, unrun)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.Nil(t, batch.StartedAt, "none of its items ran")
}

// TestABatchsStartIsItsFirstItemThatRan: a batch ending without its start
// recorded takes the start of the earliest of its items that ran, failed or
// completed, and not of one handed back unsent; a batch whose start was
// recorded keeps it.
func TestABatchsStartIsItsFirstItemThatRan(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id, owner, items := b.claimedBatch(t, p, 3, 1)
	// Claimed an hour apart: the first three hours ago.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE batch_items SET started_at = now() - (3 - idx) * interval '1 hour' WHERE batch_id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id))
	back, err := b.store.RequeueItems(b.ctx, owner, []store.ItemKey{{BatchID: id, Index: 0}})
	require.NoError(t, err)
	require.Len(t, back.Cancelled, 1)
	_, err = b.store.CompleteItems(b.ctx, owner, []store.ItemResult{{BatchID: id, Index: 1, Status: "failed", ErrorCode: string(gateway.EInferenceBusy), ErrorMessage: "busy"}})
	require.NoError(t, err)
	b.complete(t, owner, []store.ClaimedItem{items[2]}, 3)
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.NotNil(t, batch.StartedAt)
	require.WithinDuration(t, time.Now().Add(-2*time.Hour), *batch.StartedAt, time.Minute, "the failed item's")

	started := b.newBatch(t, p, 1, 1, "", day())
	items = b.claim(t, owner, 1, time.Minute)
	require.NoError(t, b.store.StartBatches(b.ctx, []uuid.UUID{started}))
	batch, _ = b.batch(t, p, started)
	require.NotNil(t, batch.StartedAt)
	start := *batch.StartedAt
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE batch_items SET started_at = now() - interval '1 hour' WHERE batch_id = $1`, started)
	require.NoError(t, err)
	b.complete(t, owner, items, 3)
	batch, _ = b.batch(t, p, started)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.Equal(t, start, *batch.StartedAt, "its recorded start")
}

// TestABatchEndsAfterAStartItWaitedFor: a finish that waits for the
// batch's lock while another replica starts the batch ends it after that
// start, not at the moment its own transaction began.
func TestABatchEndsAfterAStartItWaitedFor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 1, 1, "", day())
	owner := uuid.Must(uuid.NewV7())
	b.completeItems(t, owner, b.claim(t, owner, 1, time.Minute), 3)
	holder := b.lockBatch(t, id)
	done := make(chan error, 1)
	go func() { done <- b.store.FinishBatches(b.ctx, []uuid.UUID{id}) }()
	b.requireOneWaiting(t, "the finish waits for the batch")
	// The start of another replica, which took the lock first.
	_, err := holder.Exec(b.ctx, `UPDATE batches SET status = 'in_progress', started_at = clock_timestamp() WHERE id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, holder.Commit(b.ctx))
	require.NoError(t, <-done)
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.False(t, batch.CompletedAt.Before(*batch.StartedAt), "completed %s, started %s", batch.CompletedAt, batch.StartedAt)
}
