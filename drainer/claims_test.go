package drainer_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/store"
)

// health is a fixed view of the upstream targets: the models with a target
// taking calls, and those whose targets only take a probe.
type health struct {
	serving, probing []gateway.Model
}

func (h *health) Health() (serving, probing []gateway.Model) { return h.serving, h.probing }

func (h *health) Wait(ctx context.Context, maxWait time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(min(maxWait, 10*time.Millisecond)):
	}
}

// TestAModelOnlyProbedRunsOneItemAtATime: while a model's targets take only a
// probe, its items run one at a time, each once the one before has ended,
// whatever the drain concurrency.
func TestAModelOnlyProbedRunsOneItemAtATime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(50 * time.Millisecond)
	id := b.newBatch(t, "probe", 4)
	b.run(t, b.store, drainer.Config{Concurrency: 4, Lease: time.Minute, Health: &health{probing: []gateway.Model{gateway.ModelInstant}}})
	b.completed(t, id)
	require.Equal(t, 1, b.fake.PeakInFlight(), "one probe at a time")
	require.Len(t, b.fake.Calls(), 4, "each item reaches the upstream once")
}

// TestAProbeTakesASlotOfTheClaim: a probe of one model and the items of the
// models serving share the drain concurrency: with one worker, the probe is
// the one item claimed, and no other waits, claimed, for a worker another
// replica may have free.
func TestAProbeTakesASlotOfTheClaim(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(30 * time.Second)
	serving := b.newBatch(t, "serving", 3)
	probing := b.newBatchOfModel(t, b.principal, gateway.ModelReasoning, []string{"probing 0", "probing 1"})
	b.run(t, b.store, drainer.Config{Concurrency: 1, Lease: time.Minute, Health: &health{
		serving: []gateway.Model{gateway.ModelInstant}, probing: []gateway.Model{gateway.ModelReasoning},
	}})
	require.Eventually(t, func() bool { return b.fake.InFlight() == 1 }, 10*time.Second, 10*time.Millisecond)
	var claimed []string
	for _, id := range []uuid.UUID{serving, probing} {
		for _, it := range b.items(t, id) {
			if it.Status == gateway.ItemInProgress {
				claimed = append(claimed, fmt.Sprintf("%s item %d", id, it.Index))
			}
		}
	}
	require.Equal(t, []string{fmt.Sprintf("%s item 0", probing)}, claimed, "the probe, alone")
}

// listenLater holds the drainer's listener until listen is closed, and
// counts the claims.
type listenLater struct {
	*store.Store
	listen chan struct{}
	claims atomic.Int64
}

func (s *listenLater) ListenBatches(ctx context.Context, listening, created func(), stopped func(uuid.UUID)) error {
	if err := await(ctx, s.listen); err != nil {
		return err
	}
	return s.Store.ListenBatches(ctx, listening, created, stopped)
}

// await waits until ch is closed or ctx ends, and returns ctx's error then.
func await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-ch:
		return nil
	}
}

func (s *listenLater) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	s.claims.Add(1)
	return s.Store.ClaimItems(ctx, p)
}

// TestADrainerPollingHourlyRunsOnWord: with a poll interval of an hour, the
// drainer claims the batches created before its listener listens once it
// does, a batch as it is created, and the next item as soon as a worker is
// free: it never waits for the poll.
func TestADrainerPollingHourlyRunsOnWord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &listenLater{Store: b.store, listen: make(chan struct{})}
	b.start(t, st, drainer.Config{Concurrency: 1, Lease: time.Minute, PollInterval: time.Hour, Grace: time.Second, EvidenceRetention: time.Hour}, io.Discard)
	require.Eventually(t, func() bool { return st.claims.Load() == 1 }, 10*time.Second, 10*time.Millisecond, "the first claim finds nothing")

	before := b.newBatch(t, "before listening", 3)
	close(st.listen)
	b.completed(t, before)
	after := b.newBatch(t, "after", 2)
	b.completed(t, after)
	require.Len(t, b.fake.Calls(), 5, "each item reaches the upstream once")
}

// failingClaims fails every claim, as a database refusing the statement
// would, and counts them.
type failingClaims struct {
	*store.Store
	claims atomic.Int64
}

func (s *failingClaims) ClaimItems(context.Context, store.ClaimParams) ([]store.ClaimedItem, error) {
	s.claims.Add(1)
	return nil, errors.New("error claiming batch items: refused")
}

// TestAFailingClaimWaitsAPollInterval: a claim that fails is tried again
// after a poll interval (50 ms here), not at once in a loop on the database,
// and its failures are logged once while they last.
func TestAFailingClaimWaitsAPollInterval(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.newBatch(t, "refused", 1)
	st := &failingClaims{Store: b.store}
	logs := &syncbuf.Buffer{}
	b.runLogging(t, st, drainer.Config{Lease: time.Minute}, logs)
	require.Eventually(t, func() bool { return st.claims.Load() >= 2 }, 10*time.Second, 10*time.Millisecond)
	time.Sleep(500 * time.Millisecond)
	require.LessOrEqual(t, st.claims.Load(), int64(20), "about one claim a poll interval")
	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"error claiming batch items"`), logs.String())
}

// firstClaim records the items of the first claim that returns some.
type firstClaim struct {
	*store.Store
	items atomic.Pointer[[]store.ClaimedItem]
}

func (s *firstClaim) ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error) {
	items, err := s.Store.ClaimItems(ctx, p)
	if len(items) > 0 {
		s.items.CompareAndSwap(nil, &items)
	}
	return items, err
}

// TestAClaimServesEveryAccountWithWork: an account's batch queued behind
// another account's larger one is served in the first claim, which halves
// between the two.
func TestAClaimServesEveryAccountWithWork(t *testing.T) {
	t.Parallel()
	b := setup(t)
	big := b.newBatch(t, "big", 40)
	other := principal(t, b.store, "small")
	small := b.newBatchFor(t, other, []string{"small 0", "small 1", "small 2", "small 3"})
	st := &firstClaim{Store: b.store}
	b.run(t, st, drainer.Config{Concurrency: 8, Lease: time.Minute})
	b.completed(t, big)
	for _, it := range b.itemsOf(t, other, small) {
		require.Equal(t, gateway.ItemCompleted, it.Status)
	}
	counts := map[uuid.UUID]int{}
	for _, it := range *st.items.Load() {
		counts[it.AccountID]++
	}
	require.Equal(t, map[uuid.UUID]int{b.principal.AccountID: 4, other.AccountID: 4}, counts)
}

// heldCommits holds the first commit of outcomes until every one of n items
// has been answered by the upstream, and a moment more for their outcomes
// to reach the completer, and counts the commits.
type heldCommits struct {
	*store.Store
	answered func() int
	n        int
	commits  atomic.Int64
}

func (s *heldCommits) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	if s.commits.Add(1) == 1 {
		for s.answered() < s.n && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return s.Store.CompleteItems(ctx, owner, results)
}

// TestOutcomesThatWaitAreCommittedTogether: the outcomes that arrive while a
// commit runs are stored together by the next, in one transaction, not one
// by one.
func TestOutcomesThatWaitAreCommittedTogether(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "together", 16)
	st := &heldCommits{Store: b.store, answered: func() int { return len(b.fake.Calls()) }, n: 16}
	b.run(t, st, drainer.Config{Concurrency: 16, Lease: time.Minute})
	b.completed(t, id)
	require.LessOrEqual(t, st.commits.Load(), int64(3), "the first group, then the rest at once")
}

// heldRelease holds the hand-back of a lost claim's items until release is
// closed.
type heldRelease struct {
	*lossyStore
	release chan struct{}
}

func (s *heldRelease) ReleaseClaim(ctx context.Context, owner, claimID uuid.UUID) (store.Requeued, error) {
	if err := await(ctx, s.release); err != nil {
		return store.Requeued{}, err
	}
	return s.lossyStore.ReleaseClaim(ctx, owner, claimID)
}

// TestALostClaimOfACancelledBatchFinishesIt: the items of a claim whose
// reply was lost, handed back once their batch is being cancelled, are
// cancelled, and the batch is then cancelled at once, not left cancelling
// for the housekeeping; none reached the upstream.
func TestALostClaimOfACancelledBatchFinishesIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "lost", 3)
	lossy := &lossyStore{Store: b.store}
	lossy.lose.Store(1)
	st := &heldRelease{lossyStore: lossy, release: make(chan struct{})}
	b.run(t, st, drainer.Config{Lease: time.Minute})
	b.itemsReach(t, id, gateway.ItemInProgress) // the lost claim took them
	require.NoError(t, b.store.CancelBatch(b.ctx, b.principal.AccountID, id))
	close(st.release)
	b.batchReaches(t, id, gateway.BatchCancelled)
	for _, it := range b.items(t, id) {
		require.Equal(t, gateway.ItemCancelled, it.Status)
	}
	require.Empty(t, b.fake.Calls())
}
