package drainer_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/syncbuf"
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

// TestAnUnstorableOutcomeIsIsolated: a group of outcomes one of which
// PostgreSQL cannot hold (an output with U+0000, as one the guard had not
// cleaned) is committed member by member: the others as they ran, billed,
// and the one failed INFERENCE_BUSY without its output or usage; its batch
// finishes, and the operator is told (D11). Nothing is retried past that.
func TestAnUnstorableOutcomeIsIsolated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "isolated", 3)
	owner := uuid.Must(uuid.NewV7())
	claimed, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 10, PerAccount: 10, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	slices.SortFunc(claimed, func(x, y store.ClaimedItem) int { return x.Index - y.Index })
	contents := []string{"first", "un\x00storable", "third"}
	group := make([]store.ItemResult, 3)
	for i, it := range claimed {
		group[i] = store.ItemResult{
			BatchID: it.BatchID, Index: it.Index, Status: string(gateway.ItemCompleted), Content: contents[i],
			InputTokens: 4, OutputTokens: 6, InputRungs: 2, OutputRungs: 3 + int64(i), TotalRungs: 5 + int64(i),
			EvidenceExpiresAt: time.Now().Add(time.Hour), Model: gateway.ModelInstant,
		}
	}
	rec := &groupRecorder{Store: b.store}
	logs := &syncbuf.Buffer{}
	d := drainer.New(drainer.Config{Owner: owner, EvidenceRetention: time.Hour}, rec, b.provider, b.estimator, slog.New(slog.NewJSONHandler(logs, nil)))

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
	usage, err := b.store.Usage(b.ctx, b.principal, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, int64(5+7), usage.Totals.TotalRungs, "the two stored outcomes billed, the unstorable one not")

	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a group of batch item outcomes failed; committing them one by one"`))
	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a batch item's outcome cannot be stored; failing the item"`))
	require.NotContains(t, logs.String(), "the rescuer will take")
}

// awayStore is a Store whose commits of outcomes fail, as while the
// database is away, for as long as fails says (-1: for good): before the
// statement reaches the database, or, when lost is set, after it committed,
// its reply lost on the way back.
type awayStore struct {
	drainer.Store
	mu    sync.Mutex
	fails int
	lost  bool
	calls int
}

func (a *awayStore) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	a.mu.Lock()
	a.calls++
	fail := a.fails != 0
	if a.fails > 0 {
		a.fails--
	}
	a.mu.Unlock()
	switch {
	case !fail:
		return a.Store.CompleteItems(ctx, owner, results)
	case a.lost:
		if _, err := a.Store.CompleteItems(ctx, owner, results); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("error completing batch items: %w", io.ErrUnexpectedEOF)
	default:
		return nil, fmt.Errorf("error completing batch items: %w", &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"})
	}
}

// TestOutcomesWaitOutTheDatabase: outcomes whose commit finds the database
// away are committed once it is back, within a lease, and once only when
// the replies of commits that went through were lost on the way back: each
// item ran once, and its usage is billed once.
func TestOutcomesWaitOutTheDatabase(t *testing.T) {
	t.Parallel()
	for name, lost := range map[string]bool{"away": false, "replies lost after their commits": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			id := b.newBatch(t, "outage", 4)
			away := &awayStore{Store: b.store, fails: 3, lost: lost}
			b.run(t, away, drainer.Config{Concurrency: 4, Lease: time.Minute})
			b.completed(t, id)

			require.Len(t, b.fake.Calls(), 4, "each item reached the upstream once")
			away.mu.Lock()
			require.Greater(t, away.calls, 3, "the failed commits, then the ones that went through")
			away.mu.Unlock()
			var billed int64
			for _, it := range b.items(t, id) {
				require.Positive(t, it.Usage.TotalRungs)
				billed += it.Usage.TotalRungs
			}
			usage, err := b.store.Usage(b.ctx, b.principal, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
			require.NoError(t, err)
			require.Equal(t, int64(4), usage.Totals.Requests, "each item counted once")
			require.Equal(t, billed, usage.Totals.TotalRungs, "each item billed once")
			batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
			require.NoError(t, err)
			require.Equal(t, gateway.BatchCompleted, batch.Status)
			require.Equal(t, billed, batch.Usage.TotalRungs)
		})
	}
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
	d := drainer.New(drainer.Config{Concurrency: 2, Lease: time.Second, PollInterval: 50 * time.Millisecond, Grace: time.Second, EvidenceRetention: time.Hour},
		&awayStore{Store: b.store, fails: -1}, b.provider, b.estimator, slog.New(slog.NewJSONHandler(logs, nil)))
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	require.Eventually(t, func() bool {
		_, err := b.store.RescueExpiredLeases(b.ctx, 100)
		require.NoError(t, err)
		batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
		require.NoError(t, err)
		return batch.Status.Terminal()
	}, 20*time.Second, 100*time.Millisecond)
	for _, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemFailed, it.Status)
		require.Equal(t, gateway.EInterrupted, it.Error.Code)
		require.Zero(t, it.Usage.TotalRungs)
	}
	require.Len(t, b.fake.Calls(), 2, "each item reached the upstream once, and never again")
	usage, err := b.store.Usage(b.ctx, b.principal, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.Zero(t, usage.Totals.TotalRungs)
	require.Contains(t, logs.String(), `"msg":"error committing batch item outcomes; the rescuer will take the items"`)
}
