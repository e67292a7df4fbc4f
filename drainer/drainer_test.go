package drainer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type testBundle struct {
	ctx       context.Context
	store     *store.Store
	fake      *fakeupstream.Server
	principal *gateway.Principal
	provider  upstream.Provider
	estimator *metering.Estimator
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	ctx := context.Background()
	st := store.New(testdb.New(t))
	p := principal(t, st, "acme")
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}, "0.5")
	require.NoError(t, err)
	return &testBundle{
		ctx: ctx, store: st, fake: fake, principal: p,
		provider:  upstream.Guard(openai.New(openai.Config{BaseURL: fake.BaseURL(), Timeout: 5 * time.Second}), nil),
		estimator: &metering.Estimator{Tokenizer: tok, RateCard: rc},
	}
}

// principal is the principal of a new developer key of account, with the
// inference scope.
func principal(t *testing.T, st *store.Store, account string) *gateway.Principal {
	t.Helper()
	tier := gateway.TierDeveloper
	token, err := st.CreateKey(context.Background(), store.CreateKeyParams{Account: account, Project: "default", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	p, err := st.LookupKey(context.Background(), token)
	require.NoError(t, err)
	return p
}

func (b *testBundle) newBatch(t *testing.T, prefix string, n int) uuid.UUID {
	t.Helper()
	prompts := make([]string, n)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("%s %d", prefix, i)
	}
	return b.newBatchOf(t, prompts)
}

// newBatchOf creates a batch of one item per prompt, in their order.
func (b *testBundle) newBatchOf(t *testing.T, prompts []string) uuid.UUID {
	t.Helper()
	return b.newBatchFor(t, b.principal, prompts)
}

// newBatchFor creates p's batch of one item per prompt, in their order.
func (b *testBundle) newBatchFor(t *testing.T, p *gateway.Principal, prompts []string) uuid.UUID {
	t.Helper()
	return b.newBatchOfModel(t, p, gateway.ModelInstant, prompts)
}

// newBatchOfModel creates p's batch of one item of model per prompt, in
// their order.
func (b *testBundle) newBatchOfModel(t *testing.T, p *gateway.Principal, model gateway.Model, prompts []string) uuid.UUID {
	t.Helper()
	items := make([]store.NewItem, len(prompts))
	for i, prompt := range prompts {
		items[i] = store.NewItem{Request: store.ItemRequest{Prompt: prompt, Model: model, MaxOutputRungs: 100}, Estimate: 60}
	}
	now := time.Now().UTC()
	res, err := b.store.CreateBatch(b.ctx, store.NewBatch{Principal: p, RequestHash: []byte(strings.Join(prompts, "\n")), Items: items, CreatedAt: now, ExpiresAt: now.Add(time.Hour)})
	require.NoError(t, err)
	return res.BatchID
}

// run starts a drainer on st until the test ends.
func (b *testBundle) run(t *testing.T, st drainer.Store, cfg drainer.Config) {
	t.Helper()
	b.runLogging(t, st, cfg, io.Discard)
}

// newDrainer is a drainer on st with cfg, logging JSON lines to logs, not
// started: for tests that start it or call its parts.
func (b *testBundle) newDrainer(cfg drainer.Config, st drainer.Store, logs io.Writer) *drainer.Drainer {
	return drainer.New(cfg, st, b.provider, b.estimator, slog.New(slog.NewJSONHandler(logs, nil)))
}

// runLogging starts a drainer on st, polling every 50 ms with a second's
// grace, logging JSON lines to logs, until the test ends.
func (b *testBundle) runLogging(t *testing.T, st drainer.Store, cfg drainer.Config, logs io.Writer) {
	t.Helper()
	cfg.PollInterval, cfg.Grace, cfg.EvidenceRetention = 50*time.Millisecond, time.Second, time.Hour
	b.start(t, st, cfg, logs)
}

// start runs a drainer on st with cfg as given, logging JSON lines to logs,
// until the test ends or stop, which stops it and waits for it to return.
func (b *testBundle) start(t *testing.T, st drainer.Store, cfg drainer.Config, logs io.Writer) (stop func()) {
	t.Helper()
	d := b.newDrainer(cfg, st, logs)
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx) }()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

func (b *testBundle) items(t *testing.T, id uuid.UUID) []gateway.BatchItem {
	t.Helper()
	return b.itemsOf(t, b.principal, id)
}

// failedUnbilled requires every item of batch id failed with code, billed
// nothing.
func (b *testBundle) failedUnbilled(t *testing.T, id uuid.UUID, code gateway.ErrorCode) {
	t.Helper()
	for _, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemFailed, it.Status)
		require.Equal(t, code, it.Error.Code)
		require.Zero(t, it.Usage.TotalRungs)
	}
}

// usage is the test principal's committed usage of the last hour.
func (b *testBundle) usage(t *testing.T) *gateway.UsageView {
	t.Helper()
	v, err := b.store.Usage(b.ctx, b.principal, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	require.NoError(t, err)
	return v
}

// itemsOf is the items of p's batch id.
func (b *testBundle) itemsOf(t *testing.T, p *gateway.Principal, id uuid.UUID) []gateway.BatchItem {
	t.Helper()
	items, err := b.store.BatchItems(b.ctx, p.AccountID, id, -1, 1<<30)
	require.NoError(t, err)
	return items
}

// TestConcurrencyBoundsUpstreamCalls: a replica never has more items at the
// upstream than its drain concurrency, and its workers run every item, whose
// outcomes the metrics count once each, in their groups.
func TestConcurrencyBoundsUpstreamCalls(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(100 * time.Millisecond) // long enough for every slot to overlap
	id := b.newBatch(t, "bounded", 30)
	m := metrics.New()
	b.run(t, b.store, drainer.Config{Concurrency: 4, Lease: time.Minute, Metrics: m})
	b.completed(t, id)
	require.Len(t, b.fake.Calls(), 30, "each item reaches the upstream once")
	require.Equal(t, 4, b.fake.PeakInFlight(), "four at a time, no more")
	// The items are seen completed as their commit ends, a moment before
	// the drainer measures it.
	require.Eventually(t, func() bool {
		return strings.Contains(metricstest.Scrape(m), `gateway_group_commit_size_sum{work="batch_outcomes"} 30`+"\n")
	}, 5*time.Second, 10*time.Millisecond)
}

// TestOrphanedClaimRunsOutItsLease: an item leased to a live replica that
// does not hold it (a claim whose reply it never got) is not renewed by its
// heartbeat, so the rescuer takes it when its lease runs out (D12), while the
// items the replica holds are renewed and finish.
func TestOrphanedClaimRunsOutItsLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetSlow("held", 2*time.Second)
	owner := uuid.Must(uuid.NewV7())
	orphanBatch := b.newBatch(t, "orphan", 1)
	// The orphan: leased to owner, as by a claim whose reply was lost.
	orphan, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 1, PerAccount: 1, Lease: 600 * time.Millisecond})
	require.NoError(t, err)
	require.Len(t, orphan, 1)
	heldBatch := b.newBatch(t, "held", 1)
	b.run(t, b.store, drainer.Config{Owner: owner, Lease: 600 * time.Millisecond})

	require.Eventually(t, func() bool {
		_, err := b.store.RescueExpiredLeases(b.ctx, 100)
		require.NoError(t, err)
		return b.items(t, orphanBatch)[0].Status == gateway.ItemFailed
	}, 10*time.Second, 100*time.Millisecond)
	require.Equal(t, gateway.EInterrupted, b.items(t, orphanBatch)[0].Error.Code)
	require.Eventually(t, func() bool {
		_, err := b.store.RescueExpiredLeases(b.ctx, 100)
		require.NoError(t, err)
		return b.items(t, heldBatch)[0].Status == gateway.ItemCompleted
	}, 10*time.Second, 100*time.Millisecond, "a held item outlives three leases: its lease is renewed")
	require.Len(t, b.fake.Calls(), 1, "the orphan never reached the upstream")
}

// hangingStore's next renewal of leases, or next commit of outcomes, when
// armed, answers nothing until its context ends, as one sent on a connection
// the network lost without closing it.
type hangingStore struct {
	*store.Store
	renewal, completion atomic.Bool
}

// hang waits for ctx to end if armed was set, and unsets it.
func hang(ctx context.Context, armed *atomic.Bool) error {
	if armed.Swap(false) {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

func (s *hangingStore) RenewLeases(ctx context.Context, owner uuid.UUID, keys []store.ItemKey, lease time.Duration) (int64, error) {
	if err := hang(ctx, &s.renewal); err != nil {
		return 0, err
	}
	return s.Store.RenewLeases(ctx, owner, keys, lease)
}

func (s *hangingStore) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	if err := hang(ctx, &s.completion); err != nil {
		return nil, err
	}
	return s.Store.CompleteItems(ctx, owner, results)
}

// completesDespite runs a drainer with lease on st and requires the item of
// a new batch whose prompt holds marker to complete, the test rescuing
// expired leases meanwhile, as any replica's maintenance does; it returns
// the drainer's log.
func (b *testBundle) completesDespite(t *testing.T, st *hangingStore, marker string, lease time.Duration) string {
	t.Helper()
	id := b.newBatch(t, marker, 1)
	logs := &syncbuf.Buffer{}
	b.runLogging(t, st, drainer.Config{Owner: uuid.Must(uuid.NewV7()), Lease: lease}, logs)
	require.Eventually(t, func() bool {
		_, err := b.store.RescueExpiredLeases(b.ctx, 100)
		require.NoError(t, err)
		status := b.items(t, id)[0].Status
		return status != gateway.ItemInProgress && status != gateway.ItemQueued
	}, 15*time.Second, 50*time.Millisecond)
	it := b.items(t, id)[0]
	require.Equal(t, gateway.ItemCompleted, it.Status, "%+v", it.Error)
	return logs.String()
}

// TestARenewalThatHangsLeavesTheNextToItsBeat: a renewal of leases that
// answers nothing ends by the next beat, which renews them: a held item
// outlives several leases and completes, where a renewal waiting on would
// have let its lease run out (the item failed INTERRUPTED). The operator is
// told of the failed renewal, and of the next that succeeded.
func TestARenewalThatHangsLeavesTheNextToItsBeat(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetSlow("held", 2*time.Second)
	st := &hangingStore{Store: b.store}
	st.renewal.Store(true)
	logs := b.completesDespite(t, st, "held", 600*time.Millisecond)
	failed := strings.Index(logs, `"msg":"error renewing leases"`)
	require.GreaterOrEqual(t, failed, 0, logs)
	require.Contains(t, logs[failed:], `"msg":"leases renewed again"`)
}

// TestACommitThatHangsIsSentAgain: a commit of outcomes that answers nothing
// ends within a quarter of a lease (a second at least), and the next attempt
// stores them, where the one attempt used to last the whole window of a
// lease, after which the item was left to the rescuer (failed INTERRUPTED,
// its output lost).
func TestACommitThatHangsIsSentAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &hangingStore{Store: b.store}
	st.completion.Store(true)
	b.completesDespite(t, st, "committed", 4*time.Second)
}

// lossyStore loses the reply of the first claims: they commit, but the
// drainer sees an error, as when PostgreSQL restarts after the commit.
type lossyStore struct {
	*store.Store
	lose atomic.Int32
}

func (s *lossyStore) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	items, err := s.Store.ClaimItems(ctx, p)
	if err == nil && len(items) > 0 && s.lose.Add(-1) >= 0 {
		return nil, fmt.Errorf("error claiming batch items: %w", io.ErrUnexpectedEOF)
	}
	return items, err
}

// TestLostClaimReplyIsHandedBack: the items of a claim whose reply was lost
// go back to the queue at once (they were never dispatched) and then run,
// each exactly once.
func TestLostClaimReplyIsHandedBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "lost", 4)
	lossy := &lossyStore{Store: b.store}
	lossy.lose.Store(2)
	b.run(t, lossy, drainer.Config{Lease: time.Minute})
	require.Eventually(t, func() bool {
		for _, it := range b.items(t, id) {
			if it.Status != gateway.ItemCompleted {
				return false
			}
		}
		return true
	}, 20*time.Second, 100*time.Millisecond, "handed back long before the minute-long lease runs out")
	calls := map[string]int{}
	for _, c := range b.fake.Calls() {
		calls[c.Prompt]++
	}
	require.Len(t, calls, 4)
	for p, n := range calls {
		require.Equal(t, 1, n, p)
	}
}

// stoppingStore stops the drainer while its first claim runs, as a SIGTERM
// arriving at that moment would, and notes whether that claim was bounded.
type stoppingStore struct {
	*store.Store
	stop    func()
	once    atomic.Bool
	bounded atomic.Bool
	claimed atomic.Bool
}

func (s *stoppingStore) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	if s.once.CompareAndSwap(false, true) {
		_, bounded := ctx.Deadline()
		s.bounded.Store(bounded)
		s.stop()
		select { // a claim on the stopped context would be cancelled by now
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
		items, err := s.Store.ClaimItems(ctx, p)
		s.claimed.Store(err == nil && len(items) > 0)
		return items, err
	}
	return s.Store.ClaimItems(ctx, p)
}

// TestClaimInFlightAtShutdownIsHandedBack: a shutdown that begins while a
// claim runs does not cancel it (it may commit while its reply is lost, and
// its items would wait for their lease to run out and fail INTERRUPTED); the
// claim finishes and its items, never started, go back to the queue at once.
// The claim has a deadline of its own, so a hung database cannot hold up the
// shutdown.
func TestClaimInFlightAtShutdownIsHandedBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "shutdown", 3)
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	st := &stoppingStore{Store: b.store, stop: cancel}
	d := b.newDrainer(drainer.Config{PollInterval: 50 * time.Millisecond, Grace: 10 * time.Second, EvidenceRetention: time.Hour, Lease: time.Minute},
		st, io.Discard)
	d.Run(ctx)
	require.True(t, st.claimed.Load(), "the claim ran to its end")
	for _, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemQueued, it.Status, "item %d", it.Index)
	}
	require.Empty(t, b.fake.Calls(), "nothing was started after the shutdown began")
	require.True(t, st.bounded.Load(), "the claim has a deadline")
}

// TestNoItemStartsAfterShutdown: items claimed ahead, waiting for a worker
// when a shutdown begins, go back to the queue then, not when a worker frees
// up within the grace: an item started late would have less than the grace
// to run, and fail INTERRUPTED for good. The items at the upstream finish.
func TestNoItemStartsAfterShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &syncbuf.Buffer{}
	id, prompts, stop := b.claimAheadOfSlowItems(t, 2*time.Second, time.Minute, logs)
	stop()

	require.Contains(t, logs.String(), "handed back the batch items claimed and not started", "the operator is told")
	b.requireOnlyTheItemsAfterUnstarted(t, id, prompts, gateway.ItemQueued)
}

// TestCancelledBatchStartsNoClaimedItem: items claimed ahead, waiting for a
// worker when their batch is cancelled, were not started: they are cancelled
// then (the store's word reaches every replica), not started once a worker
// frees up; the items at the upstream finish and are billed.
func TestCancelledBatchStartsNoClaimedItem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, prompts, _ := b.claimAheadOfSlowItems(t, 2*time.Second, time.Minute, io.Discard)
	require.NoError(t, b.store.CancelBatch(b.ctx, b.principal.AccountID, id))
	b.batchReaches(t, id, gateway.BatchCancelled)

	b.requireOnlyTheItemsAfterUnstarted(t, id, prompts, gateway.ItemCancelled)
}

// requireOnlyTheItemsAfterUnstarted checks the items of batch id (of
// claimAheadOfSlowItems): those whose prompts begin "after" have status and
// never reached the upstream; every other one reached it once, completed,
// and was billed.
func (b *testBundle) requireOnlyTheItemsAfterUnstarted(t *testing.T, id uuid.UUID, prompts []string, status gateway.ItemStatus) {
	t.Helper()
	calls := map[string]int{}
	for _, c := range b.fake.Calls() {
		calls[c.Prompt]++
	}
	for i, it := range b.items(t, id) {
		switch prompt := prompts[i]; {
		case strings.HasPrefix(prompt, "after"):
			require.Equal(t, status, it.Status, "%s was not started", prompt)
			require.Zero(t, calls[prompt], prompt)
		default:
			require.Equal(t, gateway.ItemCompleted, it.Status, "%s, started, ran to its end", prompt)
			require.Positive(t, it.Usage.TotalRungs, "%s was billed", prompt)
			require.Equal(t, 1, calls[prompt], prompt)
		}
	}
}

// claimStore records the most items a claim asked for, and makes every claim
// take at least delay.
type claimStore struct {
	*store.Store
	delay   time.Duration
	largest atomic.Int64
}

func (s *claimStore) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	time.Sleep(s.delay)
	for {
		old := s.largest.Load()
		if int64(p.Max) <= old || s.largest.CompareAndSwap(old, int64(p.Max)) {
			break
		}
	}
	return s.Store.ClaimItems(ctx, p)
}

// batchReaches waits until batch id is status.
func (b *testBundle) batchReaches(t *testing.T, id uuid.UUID, status gateway.BatchStatus) {
	t.Helper()
	require.Eventually(t, func() bool {
		batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
		require.NoError(t, err)
		return batch.Status == status
	}, 30*time.Second, 20*time.Millisecond)
}

// completed waits until every item of batch id is completed.
func (b *testBundle) completed(t *testing.T, id uuid.UUID) {
	t.Helper()
	b.itemsReach(t, id, gateway.ItemCompleted)
}

// failedItem waits until the first item of batch id has failed, and returns
// it.
func (b *testBundle) failedItem(t *testing.T, id uuid.UUID) gateway.BatchItem {
	t.Helper()
	var item gateway.BatchItem
	require.Eventually(t, func() bool {
		item = b.items(t, id)[0]
		return item.Status == gateway.ItemFailed
	}, 10*time.Second, 10*time.Millisecond)
	return item
}

// itemsReach waits until every item of batch id is status.
func (b *testBundle) itemsReach(t *testing.T, id uuid.UUID, status gateway.ItemStatus) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, it := range b.items(t, id) {
			if it.Status != status {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond)
}

// TestFastItemsAreClaimedAhead: when items take less time than a claim, a
// replica claims more items than it has workers (the rest wait for one), and
// still has no more items at the upstream than workers.
func TestFastItemsAreClaimedAhead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "ahead", 100)
	st := &claimStore{Store: b.store, delay: 200 * time.Millisecond}
	b.run(t, st, drainer.Config{Concurrency: 4, Lease: time.Minute})
	b.completed(t, id)
	require.Greater(t, st.largest.Load(), int64(4), "a claim asked for more items than workers")
	require.LessOrEqual(t, b.fake.PeakInFlight(), 4, "no more at the upstream than workers")
	require.Len(t, b.fake.Calls(), 100, "each item reaches the upstream once")
}

// TestSlowItemsAreNotClaimedAhead: when its workers finish fewer than one
// item during a claim, a replica claims no more items than it has workers,
// so another replica idle meanwhile can take the rest of the queue.
func TestSlowItemsAreNotClaimedAhead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(time.Second)
	id := b.newBatch(t, "behind", 6)
	st := &claimStore{Store: b.store}
	b.run(t, st, drainer.Config{Concurrency: 2, Lease: time.Minute})
	b.completed(t, id)
	require.LessOrEqual(t, st.largest.Load(), int64(2), "none to wait for a worker")
	require.Len(t, b.fake.Calls(), 6, "each item reaches the upstream once")
}

// TestItemsClaimedAheadGoBackAtShutdown: items claimed ahead, waiting for a
// worker when a shutdown begins, were never dispatched: they go back to the
// queue, while the items at the upstream when the grace ends fail
// INTERRUPTED, and no prompt reaches the upstream twice (D12).
func TestItemsClaimedAheadGoBackAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id, prompts, stop := b.claimAheadOfSlowItems(t, time.Minute, 500*time.Millisecond, io.Discard)
	stop()

	calls := map[string]int{}
	for _, c := range b.fake.Calls() {
		calls[c.Prompt]++
	}
	for p, n := range calls {
		require.Equal(t, 1, n, "%s reached the upstream once", p)
	}
	for i, it := range b.items(t, id) {
		switch prompt := prompts[i]; {
		case strings.HasPrefix(prompt, "first"):
			require.Equal(t, gateway.ItemCompleted, it.Status, prompt)
		case strings.HasPrefix(prompt, "slow"):
			require.Equal(t, gateway.ItemFailed, it.Status, prompt)
			require.Equal(t, gateway.EInterrupted, it.Error.Code, prompt)
		default:
			require.Equal(t, gateway.ItemQueued, it.Status, "%s, never dispatched, is queued again", prompt)
			require.Zero(t, calls[prompt], prompt)
		}
	}
}

// claimAheadOfSlowItems creates a batch of 30 items ("first …"), two that
// take slow at the upstream ("slow a", "slow b") and 10 more ("after …"),
// and drains it with two workers and claims slower than its items, so that
// the drainer claims ahead; the drainer has the grace given and logs to
// logs. It returns once both workers are at the slow items and an item after
// them waits, claimed, for one, with the batch, its prompts, and stop, which
// stops the drainer and waits for it to return.
func (b *testBundle) claimAheadOfSlowItems(t *testing.T, slow, grace time.Duration, logs io.Writer) (id uuid.UUID, prompts []string, stop func()) {
	t.Helper()
	b.fake.SetSlow("slow", slow)
	for i := range 30 {
		prompts = append(prompts, fmt.Sprintf("first %d", i))
	}
	prompts = append(prompts, "slow a", "slow b")
	for i := range 10 {
		prompts = append(prompts, fmt.Sprintf("after %d", i))
	}
	id = b.newBatchOf(t, prompts)
	st := &claimStore{Store: b.store, delay: 200 * time.Millisecond}
	stop = b.start(t, st, drainer.Config{Concurrency: 2, PollInterval: 50 * time.Millisecond, Grace: grace, EvidenceRetention: time.Hour, Lease: time.Minute}, logs)
	require.Eventually(t, func() bool {
		slow := 0
		for _, c := range b.fake.Calls() {
			if strings.HasPrefix(c.Prompt, "slow") {
				slow++
			}
		}
		for i, it := range b.items(t, id) {
			if slow == 2 && strings.HasPrefix(prompts[i], "after") && it.Status == gateway.ItemInProgress {
				return true
			}
		}
		return false
	}, 30*time.Second, 20*time.Millisecond)
	return id, prompts, stop
}

// accountClaims counts the items of one account that claims return.
type accountClaims struct {
	*store.Store
	account uuid.UUID
	claimed atomic.Int64
}

func (s *accountClaims) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	items, err := s.Store.ClaimItems(ctx, p)
	for _, it := range items {
		if it.AccountID == s.account {
			s.claimed.Add(1)
		}
	}
	return items, err
}

// TestAHeldOffAccountWaitsWhileOthersDrain: when the upstream fails one
// account's items after dispatch while it answers the others', the router
// holds off that account's calls alone. Its items not yet sent wait in the
// queue, neither failed nor sent, and the replica stops claiming them (no
// claim-and-hand-back loop) while the other account's batch drains.
func TestAHeldOffAccountWaitsWhileOthersDrain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("POISON", fakeupstream.Hostile{Status: http.StatusInternalServerError})
	router, err := routing.New(routing.Config{
		Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{
			{Provider: "fake", UpstreamModel: "fake-model", Client: b.provider},
		}}},
		Circuit: routing.CircuitConfig{Failures: 2, Cooldown: time.Hour},
	})
	require.NoError(t, err)
	b.provider = router
	bystander := principal(t, b.store, "bystander")

	poisoned := b.newBatch(t, "POISON", 50)
	clean := make([]string, 20)
	for i := range clean {
		clean[i] = fmt.Sprintf("clean %d", i)
	}
	cleanBatch := b.newBatchFor(t, bystander, clean)
	counting := &accountClaims{Store: b.store, account: b.principal.AccountID}
	b.run(t, counting, drainer.Config{Concurrency: 2, Lease: time.Minute, Health: router})

	require.Eventually(t, func() bool {
		for _, it := range b.itemsOf(t, bystander, cleanBatch) {
			if it.Status != gateway.ItemCompleted {
				return false
			}
		}
		// A poisoned item sent or claimed before the hold began may still
		// be ending: failed once its failure is stored, queued once handed
		// back.
		for _, it := range b.items(t, poisoned) {
			if it.Status == gateway.ItemInProgress {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "the bystander's batch drains, and no poisoned item is still running")

	// The poisoned account's first items failed (while the bystander's
	// answers came between them, its failures were not a run); the rest
	// wait, never sent.
	var failed, queued int
	for _, it := range b.items(t, poisoned) {
		switch it.Status {
		case gateway.ItemFailed:
			require.Equal(t, gateway.EInferenceBusy, it.Error.Code)
			failed++
		case gateway.ItemQueued:
			queued++
		default:
			t.Fatalf("item %d is %s", it.Index, it.Status)
		}
	}
	require.GreaterOrEqual(t, failed, 2)
	require.Positive(t, queued)
	require.Equal(t, 50, failed+queued)
	sentPoison := 0
	for _, c := range b.fake.Calls() {
		if strings.HasPrefix(c.Prompt, "POISON") {
			sentPoison++
		}
	}
	require.Equal(t, failed, sentPoison, "only the failed items reached the upstream")

	// Its items are not claimed again while the hold lasts.
	claimed := counting.claimed.Load()
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, claimed, counting.claimed.Load(), "no claims of the held account's items")
	require.LessOrEqual(t, claimed, int64(100))
}

// TestAHeldOffAccountIsNotTheProbeOfAnOutage: when a target's circuit opens
// while one account is held off (an outage after its own failures) and only
// that account has items queued, the drainer's probe claims find them held
// and pass the account over for a while, rather than claim and hand back its
// items in a loop while the circuit is half-open.
func TestAHeldOffAccountIsNotTheProbeOfAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("POISON", fakeupstream.Hostile{Status: http.StatusInternalServerError})
	// The hold, the drainer's pause of the account and the circuit's
	// cool-down all end about cooldown after the hold began.
	cooldown := 1500 * time.Millisecond
	router, err := routing.New(routing.Config{
		Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{
			{Provider: "fake", UpstreamModel: "fake-model", Client: b.provider},
		}}},
		Circuit: routing.CircuitConfig{Failures: 2, Cooldown: cooldown, MaxCooldown: cooldown},
	})
	require.NoError(t, err)
	b.provider = router
	poisoned := b.newBatch(t, "POISON", 20)
	counting := &accountClaims{Store: b.store, account: b.principal.AccountID}
	b.run(t, counting, drainer.Config{Concurrency: 1, Lease: time.Minute, Health: router})
	require.Eventually(t, func() bool {
		failed := 0
		for _, it := range b.items(t, poisoned) {
			if it.Status == gateway.ItemFailed {
				failed++
			}
		}
		return failed == 2
	}, 10*time.Second, 10*time.Millisecond, "two failures hold the account off")

	// An outage, seen by another tenant: the circuit opens for everyone,
	// then, its cool-down over, takes one probe.
	b.fake.SetMode(fakeupstream.Down)
	_, err = router.Complete(b.ctx, &upstream.Request{Model: gateway.ModelInstant, Prompt: "p", MaxOutputTokens: 10, Tenant: uuid.New()})
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	opened := time.Now() // the circuit opened before this
	serving, _ := router.Health()
	require.Empty(t, serving)
	time.Sleep(time.Until(opened.Add(cooldown + 100*time.Millisecond)))
	_, probing := router.Health()
	require.Equal(t, []gateway.Model{gateway.ModelInstant}, probing)

	claimed := counting.claimed.Load()
	time.Sleep(500 * time.Millisecond)
	require.LessOrEqual(t, counting.claimed.Load()-claimed, int64(2), "no claim-and-hand-back loop on the held account's items")
	for _, it := range b.items(t, poisoned) {
		require.Contains(t, []gateway.ItemStatus{gateway.ItemFailed, gateway.ItemQueued}, it.Status)
	}
}

// TestADrainWithoutTroubleLogsNothing: a batch drained and finished, then a
// drainer stopped with no item in hand, writes no line: the drainer's log
// tells of trouble, and of items handed back at a shutdown.
func TestADrainWithoutTroubleLogsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "quiet", 5)
	logs := &syncbuf.Buffer{}
	stop := b.start(t, b.store, drainer.Config{Lease: time.Minute, PollInterval: 50 * time.Millisecond, Grace: time.Second, EvidenceRetention: time.Hour}, logs)
	b.completed(t, id)
	b.batchReaches(t, id, gateway.BatchCompleted)
	stop()
	require.Empty(t, logs.String())
}

// TestAnItemThatCannotBePricedFailsAndIsLogged: an item whose usage cannot be
// priced (its rungs past int64, with a multiplier of 10^19) fails INTERNAL,
// billing nothing, and the operator is told; the drain goes on.
func TestAnItemThatCannotBePricedFailsAndIsLogged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "10000000000000000000", "reasoning": "4", "elements": "2"}, "0")
	require.NoError(t, err)
	b.estimator = &metering.Estimator{Tokenizer: b.estimator.Tokenizer, RateCard: rc}
	id := b.newBatch(t, "overpriced", 2)
	logs := &syncbuf.Buffer{}
	b.runLogging(t, b.store, drainer.Config{}, logs)

	b.batchReaches(t, id, gateway.BatchFailed)
	b.failedUnbilled(t, id, gateway.EInternal)
	require.Equal(t, 2, strings.Count(logs.String(), `"msg":"a batch item's usage could not be priced; failing the item"`))
	require.Contains(t, logs.String(), metering.ErrOverflow.Error())
}

// TestAnItemThatFailsOnceSentFailsAsTheDocumentShows: an item whose call
// failed once sent (a 500) fails with the error the document's example of
// results shows, code and message.
func TestAnItemThatFailsOnceSentFailsAsTheDocumentShows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetStatus(http.StatusInternalServerError)
	id := b.newBatch(t, "fails", 1)
	b.run(t, b.store, drainer.Config{Concurrency: 1, Lease: time.Minute})
	item := b.failedItem(t, id)
	got, err := json.Marshal(map[string]any{"code": item.Error.Code, "message": item.Error.Message})
	require.NoError(t, err)
	shown := apitest.Example(t, "/paths/~1api~1v1~1batch~1{batch_id}~1results/get/responses/200/content/application~1json/examples/results/value/results/1/error")
	require.JSONEq(t, string(shown), string(got))
}
