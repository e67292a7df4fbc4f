package drainer_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

// groupRecorder is a Store that notes each group of outcomes the drainer
// commits, by item index, before committing it.
type groupRecorder struct {
	drainer.Store
	groups [][]int
}

func (g *groupRecorder) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	idx := make([]int, len(results))
	for i, r := range results {
		idx[i] = r.Index
	}
	g.groups = append(g.groups, idx)
	return g.Store.CompleteItems(ctx, owner, results)
}

// claimedOutcomes claims, for owner, the items of a new batch of one item
// for each of contents, and returns the batch and the items' outcomes in
// index order: completed with their content, the item of index i billed 5 +
// i rungs.
func (b *testBundle) claimedOutcomes(t *testing.T, owner uuid.UUID, contents ...string) (uuid.UUID, []store.ItemResult) {
	t.Helper()
	id := b.newBatch(t, "claimed", len(contents))
	claimed, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 100, PerAccount: 100, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, claimed, len(contents))
	slices.SortFunc(claimed, func(x, y store.ClaimedItem) int { return x.Index - y.Index })
	group := make([]store.ItemResult, len(claimed))
	for i, it := range claimed {
		group[i] = store.ItemResult{
			BatchID: it.BatchID, Index: it.Index, Status: string(gateway.ItemCompleted), Content: contents[i],
			InputTokens: 4, OutputTokens: 6, InputRungs: 2, OutputRungs: 3 + int64(i), TotalRungs: 5 + int64(i),
			EvidenceExpiresAt: time.Now().Add(time.Hour), Model: gateway.ModelInstant,
		}
	}
	return id, group
}

// TestAnUnstorableOutcomeIsIsolated: a group of outcomes one of which
// PostgreSQL cannot hold (an output with U+0000, as one the guard had not
// cleaned) is committed member by member: the others as they ran, billed,
// and the one failed INFERENCE_BUSY without its output or usage; its batch
// finishes, and the operator is told (D11). Nothing is retried past that.
func TestAnUnstorableOutcomeIsIsolated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	owner := uuid.Must(uuid.NewV7())
	contents := []string{"first", "un\x00storable", "third"}
	id, group := b.claimedOutcomes(t, owner, contents...)
	rec := &groupRecorder{Store: b.store}
	logs := &syncbuf.Buffer{}
	d := b.newDrainer(drainer.Config{Owner: owner, EvidenceRetention: time.Hour}, rec, logs)

	d.Commit(b.ctx, group)

	require.Equal(t, [][]int{{0, 1, 2}, {0}, {1}, {1}, {2}}, rec.groups,
		"the group, then each member alone, the unstorable one again as failed")
	stored := b.items(t, id)
	require.Len(t, stored, 3)
	for _, i := range []int{0, 2} {
		require.Equal(t, gateway.ItemCompleted, stored[i].Status)
		require.Equal(t, contents[i], stored[i].Content)
		require.Equal(t, 5+int64(i), stored[i].Usage.TotalRungs)
	}
	require.Equal(t, gateway.ItemFailed, stored[1].Status)
	require.Equal(t, gateway.EInferenceBusy, stored[1].Error.Code)
	require.Equal(t, "the item's output could not be stored; it is not retried", stored[1].Error.Message)
	require.Empty(t, stored[1].Content)
	require.Zero(t, stored[1].Usage.TotalRungs)

	batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCompleted, batch.Status, "every item ended: the batch finished")
	usage := b.usage(t)
	require.Equal(t, int64(5+7), usage.Totals.TotalRungs, "the two stored outcomes billed, the unstorable one not")

	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a group of batch item outcomes failed; committing them one by one"`))
	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a batch item's outcome cannot be stored; failing the item"`))
	require.NotContains(t, logs.String(), "the rescuer will take")
}

// outage counts the writes of a test store still to fail, as while the
// database is away (-1: all of them).
type outage struct {
	mu    sync.Mutex
	fails int
}

// fail says whether this write fails, and counts it.
func (o *outage) fail() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.fails == 0 {
		return false
	}
	if o.fails > 0 {
		o.fails--
	}
	return true
}

// awayStore is a Store whose commits of outcomes fail during its outage:
// before the statement reaches the database, or, when lost is set, after it
// committed, its reply lost on the way back; so do its hand-backs, when lost
// is set.
type awayStore struct {
	drainer.Store
	outage
	lost     bool
	returned atomic.Int32 // commits that returned, failed or not
}

func (a *awayStore) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	defer a.returned.Add(1)
	switch {
	case !a.fail():
		return a.Store.CompleteItems(ctx, owner, results)
	case a.lost:
		if _, err := a.Store.CompleteItems(ctx, owner, results); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("error completing batch items: %w", io.ErrUnexpectedEOF)
	default:
		return nil, fmt.Errorf("error completing batch items: %w", errStartingUp)
	}
}

// RequeueItems hands items back, its reply lost during the outage when lost
// is set.
func (a *awayStore) RequeueItems(ctx context.Context, owner uuid.UUID, keys []store.ItemKey) (store.Requeued, error) {
	fail := a.lost && a.fail()
	r, err := a.Store.RequeueItems(ctx, owner, keys)
	if err == nil && fail {
		return store.Requeued{}, fmt.Errorf("error requeueing batch items: %w", io.ErrUnexpectedEOF)
	}
	return r, err
}

// commits is how many commits of outcomes have returned.
func (a *awayStore) commits() int { return int(a.returned.Load()) }

// errStartingUp is what PostgreSQL answers while it starts: the database
// away for a moment.
var errStartingUp = &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}

// unmovedStore is a Store whose moves of batches (their start and their
// finish) fail during its outage.
type unmovedStore struct {
	drainer.Store
	outage
}

func (u *unmovedStore) StartBatches(ctx context.Context, ids []uuid.UUID) error {
	if u.fail() {
		return fmt.Errorf("error finding the batches to move: %w", errStartingUp)
	}
	return u.Store.StartBatches(ctx, ids)
}

func (u *unmovedStore) FinishBatches(ctx context.Context, ids []uuid.UUID) error {
	if u.fail() {
		return fmt.Errorf("error finding the batches to move: %w", errStartingUp)
	}
	return u.Store.FinishBatches(ctx, ids)
}

// TestBatchesMoveOnceTheDatabaseIsBack: a batch whose start finds the
// database away starts once it is back, while its item still runs, and one
// whose finish finds it away is finished once it is back, not left for the
// housekeeping to find: after its last outcome's commit, and after a claim
// that refused its items their budget.
func TestBatchesMoveOnceTheDatabaseIsBack(t *testing.T) {
	t.Parallel()
	t.Run("start", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.fake.SetDelay(20 * time.Second) // running until the test ends
		id := b.newBatch(t, "slow", 1)
		b.run(t, &unmovedStore{Store: b.store, outage: outage{fails: 2}}, drainer.Config{Lease: time.Minute})
		b.batchReaches(t, id, gateway.BatchInProgress)
		require.Equal(t, gateway.ItemInProgress, b.items(t, id)[0].Status, "started while its item runs")
	})
	t.Run("finish", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		owner := uuid.Must(uuid.NewV7())
		id, group := b.claimedOutcomes(t, owner, "first", "second")
		m := metrics.New()
		d := b.newDrainer(drainer.Config{Owner: owner, Lease: time.Minute, EvidenceRetention: time.Hour, Metrics: m},
			&unmovedStore{Store: b.store, outage: outage{fails: 2}}, io.Discard)

		d.Commit(b.ctx, group)

		batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
		require.NoError(t, err)
		require.Equal(t, gateway.BatchCompleted, batch.Status)
		require.Contains(t, metricstest.Scrape(m), `gateway_database_retries_total{work="batch_states"} 2`+"\n", "tried again twice")
	})
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		// A budget below one item's estimate (60): the claim refuses the
		// first item and fails the batch's others with it.
		budget := int64(10)
		require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", Project: "default", BudgetRungs: &budget}))
		id := b.newBatch(t, "refused", 3)
		b.run(t, &unmovedStore{Store: b.store, outage: outage{fails: 2}}, drainer.Config{Lease: time.Minute})
		b.batchReaches(t, id, gateway.BatchFailed)
		for _, it := range b.items(t, id) {
			require.Equal(t, gateway.ItemFailed, it.Status)
			require.Equal(t, gateway.EBudgetExceeded, it.Error.Code)
		}
		require.Empty(t, b.fake.Calls(), "nothing reached the upstream")
	})
}

// refusedStarts is a Store that refuses to start batches, for a reason other
// than the database being away.
type refusedStarts struct{ drainer.Store }

func (refusedStarts) StartBatches(context.Context, []uuid.UUID) error {
	return errors.New("error starting batches: refused")
}

// TestABatchWhoseStartIsRefusedStillFinishes: a batch the database refuses
// to start (not away: the start is not retried) is finished when its items
// are, and the operator is told of the refusal.
func TestABatchWhoseStartIsRefusedStillFinishes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "unstarted", 2)
	logs := &syncbuf.Buffer{}
	b.runLogging(t, refusedStarts{b.store}, drainer.Config{Lease: time.Minute}, logs)
	b.batchReaches(t, id, gateway.BatchCompleted)
	b.completed(t, id)
	require.Contains(t, logs.String(), `"msg":"error starting batches; each starts at its next item's dispatch, or finishes","error":"error starting batches: refused"`)
}

// TestOutcomesWaitOutTheDatabase: outcomes whose commit finds the database
// away are committed once it is back, within a lease: each item ran once,
// and its usage is billed once.
func TestOutcomesWaitOutTheDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "outage", 4)
	away := &awayStore{Store: b.store, outage: outage{fails: 3}}
	b.run(t, away, drainer.Config{Concurrency: 4, Lease: time.Minute})
	b.completed(t, id)

	require.Eventually(t, func() bool { return away.commits() > 3 }, 10*time.Second, 10*time.Millisecond,
		"the failed commits, then the ones that went through")
	require.Len(t, b.fake.Calls(), 4, "each item reached the upstream once")
	var billed int64
	for _, it := range b.items(t, id) {
		require.Positive(t, it.Usage.TotalRungs)
		billed += it.Usage.TotalRungs
	}
	usage := b.usage(t)
	require.Equal(t, int64(4), usage.Totals.Requests, "each item counted once")
	require.Equal(t, billed, usage.Totals.TotalRungs, "each item billed once")
	require.Eventually(t, func() bool {
		batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
		require.NoError(t, err)
		return batch.Status == gateway.BatchCompleted && batch.Usage.TotalRungs == billed
	}, 10*time.Second, 10*time.Millisecond)
}

// TestOutcomesWhoseRepliesWereLostAreStoredOnce: a group of outcomes whose
// commit went through but whose reply was lost, twice, is sent again until a
// reply comes, which applies nothing more: each item is stored and billed
// once, and the batch, whose last items they were, is finished then, not
// left in progress for the housekeeping to find. The outcomes the lost
// attempt stored are counted in the metrics, once, not reported refused.
func TestOutcomesWhoseRepliesWereLostAreStoredOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	owner := uuid.Must(uuid.NewV7())
	id, group := b.claimedOutcomes(t, owner, "first", "second", "third")
	away := &awayStore{Store: b.store, outage: outage{fails: 2}, lost: true}
	logs := &syncbuf.Buffer{}
	m := metrics.New()
	d := b.newDrainer(drainer.Config{Owner: owner, Lease: time.Minute, EvidenceRetention: time.Hour, Metrics: m}, away, logs)

	d.Commit(b.ctx, group)

	require.Equal(t, 3, away.commits(), "stored with its reply lost, sent again with its reply lost, then answered")
	for i, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemCompleted, it.Status)
		require.Equal(t, 5+int64(i), it.Usage.TotalRungs)
	}
	usage := b.usage(t)
	require.Equal(t, int64(3), usage.Totals.Requests, "each item counted once")
	require.Equal(t, int64(5+6+7), usage.Totals.TotalRungs, "each item billed once")
	batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.Equal(t, int64(5+6+7), batch.Usage.TotalRungs)
	scraped := metricstest.Scrape(m)
	require.Contains(t, scraped, `gateway_batch_items_total{outcome="completed"} 3`+"\n")
	require.Contains(t, scraped, `gateway_rungs_total{entry_point="batch",model="instant",side="input"} 6`+"\n")
	require.Contains(t, scraped, `gateway_rungs_total{entry_point="batch",model="instant",side="output"} 12`+"\n")
	require.Contains(t, scraped, `gateway_database_retries_total{work="batch_outcomes"} 2`+"\n", "the two sends after the first")
	require.NotContains(t, logs.String(), "outcomes refused")
}

// TestOutcomesPastALeaseOfOutageAreInterrupted: outcomes whose commit finds
// the database away for longer than a lease are given up on and left to the
// rescuer, which fails their items INTERRUPTED once their leases run out
// (D12): never run again, nothing billed, and the operator told.
func TestOutcomesPastALeaseOfOutageAreInterrupted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "outage", 2)
	logs := &syncbuf.Buffer{}
	b.runLogging(t, &awayStore{Store: b.store, outage: outage{fails: -1}}, drainer.Config{Concurrency: 2, Lease: time.Second}, logs)

	require.Eventually(t, func() bool {
		_, err := b.store.RescueExpiredLeases(b.ctx, 100)
		require.NoError(t, err)
		batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
		require.NoError(t, err)
		return batch.Status.Terminal()
	}, 20*time.Second, 100*time.Millisecond)
	b.failedUnbilled(t, id, gateway.EInterrupted)
	require.Len(t, b.fake.Calls(), 2, "each item reached the upstream once, and never again")
	usage := b.usage(t)
	require.Zero(t, usage.Totals.TotalRungs)
	require.Contains(t, logs.String(), `"msg":"error committing batch item outcomes; the rescuer will take the items"`)
}

// TestARequeueWhoseReplyWasLostFinishesItsBatch: an item handed back while
// its batch is being cancelled is cancelled, the batch's last; when the
// reply of that hand-back is lost, the one sent again finds nothing to hand
// back, and the batch is cancelled all the same, not left cancelling for the
// housekeeping to find.
func TestARequeueWhoseReplyWasLostFinishesItsBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	owner := uuid.Must(uuid.NewV7())
	id := b.newBatch(t, "cancelled", 1)
	claimed, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.NoError(t, b.store.CancelBatch(b.ctx, b.principal.AccountID, id))
	batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCancelling, batch.Status, "its item is running")
	away := &awayStore{Store: b.store, outage: outage{fails: 1}, lost: true}
	m := metrics.New()
	d := b.newDrainer(drainer.Config{Owner: owner, Lease: time.Minute, Metrics: m}, away, io.Discard)

	d.Requeue(b.ctx, claimed[0])

	require.Equal(t, 0, away.fails, "the first hand-back's reply was lost")
	require.Contains(t, metricstest.Scrape(m), `gateway_database_retries_total{work="batch_items"} 1`+"\n", "sent again once")
	batch, err = b.store.Batch(b.ctx, b.principal.AccountID, id)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	require.Equal(t, gateway.ItemCancelled, b.items(t, id)[0].Status)
}

// TestOutcomesWhoseLeasesWereLostAreRefused: outcomes committed by a replica
// that no longer holds their items' leases (another owns them) are refused:
// nothing is stored or billed, the metrics count none of them, and the
// operator is told.
func TestOutcomesWhoseLeasesWereLostAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, group := b.claimedOutcomes(t, uuid.Must(uuid.NewV7()), "first", "second")
	logs := &syncbuf.Buffer{}
	m := metrics.New()
	d := b.newDrainer(drainer.Config{Owner: uuid.Must(uuid.NewV7()), Lease: time.Minute, EvidenceRetention: time.Hour, Metrics: m}, b.store, logs)

	d.Commit(b.ctx, group)

	for _, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemInProgress, it.Status, "still its owner's")
	}
	require.Zero(t, b.usage(t).Totals.TotalRungs)
	scraped := metricstest.Scrape(m)
	require.Contains(t, scraped, `gateway_batch_items_total{outcome="completed"} 0`+"\n")
	require.NotContains(t, scraped, `gateway_rungs_total{entry_point="batch"`)
	require.Contains(t, logs.String(), `"msg":"outcomes refused: their leases were lost","refused":2`)
}
