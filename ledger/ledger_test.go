package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/stagger"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/ledger"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type testBundle struct {
	ctx   context.Context
	url   string
	store *store.Store
}

func setup(t testing.TB) *testBundle {
	t.Helper()
	url := testdb.URL(t)
	return &testBundle{ctx: context.Background(), url: url, store: store.New(testdb.Connect(t, url))}
}

// replica is a ledger over its own pool, running until the test ends.
func (b *testBundle) replica(t *testing.T, cfg ledger.Config) *ledger.Ledger {
	t.Helper()
	l := ledger.New(cfg, store.New(testdb.Connect(t, b.url)))
	b.run(t, l)
	return l
}

// run runs l until the test ends or stop, which ends its Run and waits for
// it to return.
func (b *testBundle) run(t *testing.T, l *ledger.Ledger) (stop func()) {
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx) }()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

func (b *testBundle) principal(t testing.TB, account string, daily, budget *int64) *gateway.Principal {
	t.Helper()
	token, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: account, Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: account, DailyRungs: daily, Project: "default", BudgetRungs: budget}))
	p, err := b.store.LookupKey(b.ctx, token)
	require.NoError(t, err)
	return p
}

func (b *testBundle) view(t *testing.T, p *gateway.Principal) *gateway.UsageView {
	t.Helper()
	day := gateway.UTCDay(time.Now())
	v, err := b.store.Usage(b.ctx, p, day, day.Add(24*time.Hour))
	require.NoError(t, err)
	return v
}

// admit admits a request of today, asked at noon: far from the minutes
// before the day's end, when the next day's slice is granted ahead.
func admit(l *ledger.Ledger, p *gateway.Principal, estimate int64) (uuid.UUID, error) {
	return admitAt(l, p, estimate, gateway.UTCDay(time.Now()).Add(12*time.Hour))
}

func admitAt(l *ledger.Ledger, p *gateway.Principal, estimate int64, at time.Time) (uuid.UUID, error) {
	id := uuid.Must(uuid.NewV7())
	return id, l.Admit(context.Background(), gateway.Admission{RequestID: id, Principal: p, Estimate: estimate, Day: at})
}

func record(p *gateway.Principal, id uuid.UUID, total int64) gateway.UsageRecord {
	now := time.Now().UTC()
	return gateway.UsageRecord{
		RequestID: id, Principal: p, Model: gateway.ModelInstant, Entry: gateway.EntryResponses,
		Usage:     gateway.Usage{InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: total - 1, TotalRungs: total},
		CreatedAt: now, CompletedAt: now, EvidenceExpiresAt: now.Add(time.Hour),
	}
}

// admits reports whether a new replica, whose slice is all that the caps
// leave, admits estimate for p: whether the other replicas' slices came back.
func (b *testBundle) admits(p *gateway.Principal, estimate int64) bool {
	_, err := admit(ledger.New(ledger.Config{Share: 1}, b.store), p, estimate)
	return err == nil
}

func ptr[T any](v T) *T { return &v }

func TestAdmitSettleRelease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{})
	p := b.principal(t, "acme", nil, ptr(int64(1000)))

	id, err := admit(l, p, 100)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 30)))
	id, err = admit(l, p, 100)
	require.NoError(t, err)
	l.Release(id)
	l.Release(id) // twice is harmless
	v := b.view(t, p)
	require.Equal(t, int64(30), v.Daily.Charged, "what was used, never the slice")
	require.Equal(t, int64(30), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)
	require.Equal(t, int64(1), v.Totals.Requests)

	// The whole remainder is still admissible from one replica: a released
	// estimate and an unused one go back to the slice.
	id, err = admit(l, p, 970)
	require.NoError(t, err)
	_, err = admit(l, p, 1)
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err))
	require.NoError(t, l.Settle(b.ctx, record(p, id, 970)))
	require.Equal(t, int64(1000), b.view(t, p).Budget.Spent)
}

// TestUnconfirmedKeepsItsCost: a request whose settlement may or may not be
// stored keeps its cost counted against the slice, as a settled one does, and
// gives back the rest of its estimate: the slice admits no more than it would
// have had the settlement been stored.
func TestUnconfirmedKeepsItsCost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{})
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	l.Unconfirmed(id, 70)
	_, err = admit(l, p, 931)
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err), "its 70 stay counted")
	_, err = admit(l, p, 930)
	require.NoError(t, err, "the 30 of its estimate it did not use came back")
}

// TestCeilingResetsWithTheDay: a daily ceiling spent leaves the next UTC
// day's whole, from the same replica: each day has slices of its own, and a
// request is charged to the day it was admitted for.
func TestCeilingResetsWithTheDay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{})
	p := b.principal(t, "acme", ptr(int64(100)), nil)
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 100)))
	_, err = admit(l, p, 1)
	require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(err), "today's ceiling is spent")

	tomorrow := time.Now().Add(24 * time.Hour)
	id = uuid.Must(uuid.NewV7())
	require.NoError(t, l.Admit(b.ctx, gateway.Admission{RequestID: id, Principal: p, Estimate: 100, Day: tomorrow}), "tomorrow's is whole")
	r := record(p, id, 60)
	r.CreatedAt, r.CompletedAt = tomorrow, tomorrow
	require.NoError(t, l.Settle(b.ctx, r))
	require.Equal(t, int64(100), b.view(t, p).Daily.Charged, "today's charge is today's alone")
	day := gateway.UTCDay(tomorrow)
	v, err := b.store.Usage(b.ctx, p, day, day.Add(24*time.Hour))
	require.NoError(t, err)
	require.Equal(t, int64(60), v.Totals.TotalRungs)

	// Tomorrow has the 40 its ceiling leaves, no more.
	next := gateway.Admission{RequestID: uuid.Must(uuid.NewV7()), Principal: p, Estimate: 41, Day: tomorrow}
	require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(l.Admit(b.ctx, next)))
	next.Estimate = 40
	require.NoError(t, l.Admit(b.ctx, next))
}

// TestRefusalsWaitingCannotCure: an estimate larger than the whole daily
// ceiling or the whole budget cap is refused without Retry-After, saying what
// to change (D11); one that only does not fit today keeps Retry-After.
func TestRefusalsWaitingCannotCure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{})
	p := b.principal(t, "acme", ptr(int64(100)), ptr(int64(60)))
	var e *gateway.Error
	_, err := admit(l, p, 101)
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.EBudgetExceeded, e.Code, "the cap is checked first")
	require.Zero(t, e.RetryAfter)
	require.Contains(t, e.Message, "max_output_rungs")

	q := b.principal(t, "other", ptr(int64(100)), nil)
	_, err = admit(l, q, 101)
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Zero(t, e.RetryAfter)
	require.Contains(t, e.Message, "max_output_rungs")

	id, err := admit(l, q, 60)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(q, id, 60)))
	_, err = admit(l, q, 60)
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	midnight := gateway.UTCDay(time.Now()).Add(24 * time.Hour)
	require.WithinDuration(t, midnight, time.Now().Add(e.RetryAfter), time.Minute, "the day resets: waiting helps")
	require.Contains(t, e.Message, "00:00 UTC")
	// The whole ceiling, or the whole cap, fits once nothing else is there.
	_, err = admit(l, q, 100)
	require.ErrorAs(t, err, &e)
	require.WithinDuration(t, midnight, time.Now().Add(e.RetryAfter), time.Minute, "an estimate of the whole ceiling fits tomorrow: %s", e.Message)
	id, err = admit(l, p, 10)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 10)))
	_, err = admit(l, p, 60)
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.EBudgetExceeded, e.Code)
	require.Contains(t, e.Message, "beside what the project has spent", "not larger than the whole cap")
}

// TestRefusalByUnfinishedBatches: a request refused because the estimates
// of the account's batch items not yet finished fill the ceiling, while what
// is charged for good leaves room for it once they end, is told to retry in
// a minute, not at midnight.
func TestRefusalByUnfinishedBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := b.principal(t, "acme", ptr(int64(100)), nil)
	items := []store.NewItem{{Request: store.ItemRequest{Prompt: "p", Model: gateway.ModelInstant, MaxOutputRungs: 10}, Estimate: 80}}
	now := time.Now().UTC()
	_, err := b.store.CreateBatch(b.ctx, store.NewBatch{Principal: p, RequestHash: []byte("h"), Items: items, CreatedAt: now, ExpiresAt: now.Add(24 * time.Hour)})
	require.NoError(t, err)

	_, err = admit(b.replica(t, ledger.Config{}), p, 60)
	var e *gateway.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Equal(t, gateway.BatchesRetryAfter, e.RetryAfter, "20 free and 80 held by a batch cover 60: %s", e.Message)
	require.Contains(t, e.Message, "batch items not yet finished")
}

// TestRefusalsByRequestsRunning: a request refused because the estimates of
// requests still running fill the ceiling or the cap, while what is charged
// or spent for good leaves room for it, is told to retry shortly, not at
// midnight, nor refused for good; once their actual cost fills it, the
// refusal is the day's (429 until midnight) or the cap's (402, no
// Retry-After, raise the cap).
func TestRefusalsByRequestsRunning(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, tt := range map[string]struct {
		daily, budget *int64
		code          gateway.ErrorCode
		later         func(t *testing.T, e *gateway.Error)
	}{
		"daily ceiling": {ptr(int64(100)), nil, gateway.ERateLimited, func(t *testing.T, e *gateway.Error) {
			midnight := gateway.UTCDay(time.Now()).Add(24 * time.Hour)
			require.WithinDuration(t, midnight, time.Now().Add(e.RetryAfter), time.Minute)
		}},
		"budget cap": {nil, ptr(int64(100)), gateway.EBudgetExceeded, func(t *testing.T, e *gateway.Error) {
			require.Zero(t, e.RetryAfter, "spending never comes back")
			require.Contains(t, e.Message, "raise the cap")
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Two replicas: one runs a request, the other's is refused. The
			// first gives its slice back as soon as it is idle.
			running, other := b.replica(t, ledger.Config{Idle: 10 * time.Millisecond}), b.replica(t, ledger.Config{})
			p := b.principal(t, name, tt.daily, tt.budget)
			id, err := admit(running, p, 60)
			require.NoError(t, err)
			var e *gateway.Error
			_, err = admit(other, p, 60)
			require.ErrorAs(t, err, &e)
			require.Equal(t, tt.code, e.Code)
			require.Equal(t, gateway.HeldRetryAfter, e.RetryAfter, "retry shortly: %s", e.Message)
			require.Contains(t, e.Message, "requests still running")

			require.NoError(t, running.Settle(b.ctx, record(p, id, 10)))
			require.Eventually(t, func() bool {
				id, err = admit(other, p, 60)
				return err == nil
			}, 10*time.Second, ledger.RefusalMemory, "the running request ended at its actual cost, its slice went back")

			require.NoError(t, other.Settle(b.ctx, record(p, id, 60)))
			time.Sleep(ledger.RefusalMemory) // past the refusal remembered
			_, err = admit(other, p, 60)
			require.ErrorAs(t, err, &e)
			require.Equal(t, tt.code, e.Code)
			require.NotContains(t, e.Message, "requests still running", "10 + 60 used for good: 60 more never fit")
			tt.later(t, e)
		})
	}
}

// countingStore counts grant statements.
type countingStore struct {
	*store.Store
	grants atomic.Int64
}

func (c *countingStore) GrantQuota(ctx context.Context, r store.QuotaRequest) (store.QuotaGrant, error) {
	c.grants.Add(1)
	return c.Store.GrantQuota(ctx, r)
}

// counted is a running ledger of cfg whose grants are counted.
func (b *testBundle) counted(t *testing.T, cfg ledger.Config) (*ledger.Ledger, *countingStore) {
	t.Helper()
	st := &countingStore{Store: b.store}
	l := ledger.New(cfg, st)
	b.run(t, l)
	return l, st
}

// heldStore holds each grant after the first at gate until gate is closed
// (or for ten seconds, so that a ledger that waits for one fails its test
// rather than hang it), counting the grants sent and those answered.
type heldStore struct {
	*store.Store
	gate           chan struct{}
	sent, answered atomic.Int64
	// failing fails the grants, as a database away does.
	failing atomic.Bool
}

func (h *heldStore) GrantQuota(ctx context.Context, r store.QuotaRequest) (store.QuotaGrant, error) {
	if h.sent.Add(1) > 1 {
		select {
		case <-h.gate:
		case <-time.After(10 * time.Second):
		}
	}
	defer h.answered.Add(1)
	if h.failing.Load() {
		return store.QuotaGrant{}, errors.New("the database is away")
	}
	return h.Store.GrantQuota(ctx, r)
}

// refilling is a ledger over a heldStore whose first slice of p's day, of
// 1,000 rungs under a ceiling of 16,000, is down to 200 after eight requests
// of 100 each: the refill has started, and is held.
func (b *testBundle) refilling(t *testing.T, run func(*ledger.Ledger)) (*ledger.Ledger, *heldStore, *gateway.Principal) {
	t.Helper()
	st := &heldStore{Store: b.store, gate: make(chan struct{})}
	l := ledger.New(ledger.Config{}, st)
	run(l)
	p := b.principal(t, "acme", ptr(int64(16_000)), nil)
	for i := range 8 {
		b.request(t, l, p)
		if i < 7 {
			require.Equal(t, int64(1), st.sent.Load(), "served from the slice")
		}
	}
	require.Eventually(t, func() bool { return st.sent.Load() == 2 }, 10*time.Second, time.Millisecond, "the refill started at 200 available")
	return l, st, p
}

// request admits and settles a request of p of 100 rungs.
func (b *testBundle) request(t *testing.T, l *ledger.Ledger, p *gateway.Principal) {
	t.Helper()
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 100)))
}

// TestASliceIsRefilledAheadOfNeed: once less than a quarter of its last grant
// is available, a slice is refilled in the background; the requests after go
// on from what is left meanwhile, and none waits for a grant.
func TestASliceIsRefilledAheadOfNeed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st, p := b.refilling(t, func(l *ledger.Ledger) { b.run(t, l) })
	b.request(t, l, p)
	b.request(t, l, p)
	require.Equal(t, int64(1), st.answered.Load(), "the last two requests of the slice went on while the refill was held")
	close(st.gate)
	require.Eventually(t, func() bool { return st.answered.Load() == 2 }, 10*time.Second, time.Millisecond)
	for range 7 { // from the refill, 1/16 of 15,000
		b.request(t, l, p)
	}
	require.Equal(t, int64(2), st.sent.Load())
	require.Equal(t, int64(1700), b.view(t, p).Daily.Charged, "what was used, never the slices")
}

// TestAFailedRefillWaitsBeforeTheNext: a refill that fails (the database
// away) is not started again by the next admission, nor by each after it,
// only once RefusalMemory has passed: the admissions go on from what is left
// without a grant statement each.
func TestAFailedRefillWaitsBeforeTheNext(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st, p := b.refilling(t, func(l *ledger.Ledger) { b.run(t, l) })
	today := gateway.UTCDay(time.Now())
	admitOne := func() { // 200 available stay 200: below a quarter of the last grant
		id, err := admit(l, p, 10)
		require.NoError(t, err)
		l.Release(id)
	}
	st.failing.Store(true)
	start := time.Now()
	close(st.gate)
	require.Eventually(t, func() bool { return st.answered.Load() == 2 && !l.Granting(p, today) }, 10*time.Second, time.Millisecond, "the refill failed")
	admitOne()
	granting := l.Granting(p, today)
	if time.Since(start) < ledger.RefusalMemory {
		require.False(t, granting, "no refill again within RefusalMemory of the failure")
	}
	require.Eventually(t, func() bool { admitOne(); return st.sent.Load() >= 3 }, 10*time.Second, 10*time.Millisecond, "then one")
	elapsed := time.Since(start)
	require.LessOrEqual(t, st.sent.Load(), int64(2+elapsed/ledger.RefusalMemory), "one refill a RefusalMemory at the most, after %s", elapsed)
}

// TestARefillInFlightAtShutdownIsFoldedBack: a ledger that stops while a
// refill is in flight waits for it, then folds its slice back with the rest.
func TestARefillInFlightAtShutdownIsFoldedBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, stop := context.WithCancel(b.ctx)
	done := make(chan struct{})
	_, st, p := b.refilling(t, func(l *ledger.Ledger) {
		go func() { defer close(done); l.Run(ctx) }()
	})
	stop()
	close(st.gate)
	<-done
	require.Equal(t, int64(2), st.answered.Load())
	require.True(t, b.admits(p, 16_000-800), "the ceiling but what was used is free again")
}

// foldCountingStore counts grants and folds.
type foldCountingStore struct {
	countingStore
	folds atomic.Int64
	// gate, when set, holds each fold until it is closed; held is set once
	// one waits there.
	gate chan struct{}
	held atomic.Bool
}

func (f *foldCountingStore) FoldQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID) (int64, error) {
	f.folds.Add(1)
	if f.gate != nil {
		f.held.Store(true)
		<-f.gate
	}
	return f.Store.FoldQuotaLeases(ctx, owner, ids)
}

// TestTheNextDayIsGrantedAhead: in the last minutes of a day, a request of an
// account starts the grant of the next day's slice in the background, so that
// its first request of the next day is admitted from memory; the slice of a
// day not yet started is not folded back as idle.
func TestTheNextDayIsGrantedAhead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &foldCountingStore{countingStore: countingStore{Store: store.New(testdb.Connect(t, b.url))}}
	l := ledger.New(ledger.Config{Idle: 20 * time.Millisecond}, st)
	b.run(t, l)
	p := b.principal(t, "acme", nil, nil)
	tomorrow := gateway.UTCDay(time.Now()).AddDate(0, 0, 1)

	id, err := admitAt(l, p, 10, tomorrow.Add(-ledger.DefaultDayAhead-time.Second))
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 5)))
	require.Equal(t, int64(1), st.grants.Load(), "not yet")
	id, err = admitAt(l, p, 10, tomorrow.Add(-time.Second))
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 5)))
	require.Eventually(t, func() bool { return st.grants.Load() == 2 }, 10*time.Second, time.Millisecond, "tomorrow's slice")

	// Today's slice, idle, is folded back; tomorrow's, granted ahead, is kept
	// by the same beats.
	require.Eventually(t, func() bool { return st.folds.Load() >= 1 }, 10*time.Second, time.Millisecond)
	id, err = admitAt(l, p, 10, tomorrow.Add(time.Second))
	require.NoError(t, err)
	r := record(p, id, 5)
	r.CreatedAt, r.CompletedAt = tomorrow.Add(time.Second), tomorrow.Add(time.Second)
	require.NoError(t, l.Settle(b.ctx, r))
	require.Equal(t, int64(2), st.grants.Load(), "tomorrow's first request is admitted from the slice granted ahead")
	require.Equal(t, int64(10), b.view(t, p).Daily.Charged, "today's requests, and nothing of tomorrow's slice")
	v, err := b.store.Usage(b.ctx, p, tomorrow, tomorrow.AddDate(0, 0, 1))
	require.NoError(t, err)
	require.Equal(t, int64(5), v.Totals.TotalRungs)
}

// TestTheNextDayIsGrantedFromTheAccountsOwnInstant: an account's next day is
// granted ahead from the instant of DefaultDayAhead's first half that its id
// sets (stagger.Lead), not before: accounts do not all start their grants as
// the window opens.
func TestTheNextDayIsGrantedFromTheAccountsOwnInstant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st := b.counted(t, ledger.Config{})
	p := b.principal(t, "acme", nil, nil)
	tomorrow := gateway.UTCDay(time.Now()).AddDate(0, 0, 1)
	lead := stagger.Lead(p.AccountID, ledger.DefaultDayAhead)

	for _, at := range []time.Duration{ledger.DefaultDayAhead + time.Second, lead + time.Millisecond} {
		id, err := admitAt(l, p, 10, tomorrow.Add(-at))
		require.NoError(t, err)
		l.Release(id)
	}
	require.False(t, l.Holds(p, tomorrow), "a millisecond before its instant")
	id, err := admitAt(l, p, 10, tomorrow.Add(-lead))
	require.NoError(t, err)
	l.Release(id)
	require.True(t, l.Holds(p, tomorrow), "from its instant")
	require.Eventually(t, func() bool { return st.grants.Load() == 2 }, 10*time.Second, time.Millisecond, "tomorrow's slice")
}

// TestNoNextDayIsGrantedAheadWhileItsSliceIsFoldedBack: a next day's slice
// granted ahead and then retired (its account's limits changed) is folded
// back; meanwhile the admissions of the day before grant no other ahead of
// it, which would not see what the folded one held given back.
func TestNoNextDayIsGrantedAheadWhileItsSliceIsFoldedBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &foldCountingStore{countingStore: countingStore{Store: b.store}, gate: make(chan struct{})}
	open := sync.OnceFunc(func() { close(st.gate) })
	defer open() // before the ledger's last folds, should the test fail with the gate shut
	l := ledger.New(ledger.Config{}, st)
	b.run(t, l)
	p := b.principal(t, "acme", nil, nil)
	tomorrow := gateway.UTCDay(time.Now()).AddDate(0, 0, 1)
	running, err := admitAt(l, p, 10, tomorrow.Add(-time.Second)) // today's slice, in use until the end
	require.NoError(t, err)
	defer l.Release(running)
	require.Eventually(t, func() bool { return st.grants.Load() == 2 && !l.Granting(p, tomorrow) }, 10*time.Second, time.Millisecond, "tomorrow's slice")

	l.Invalidate(p.AccountID) // tomorrow's slice, unused, is folded back; today's waits for its request
	require.Eventually(t, st.held.Load, 10*time.Second, time.Millisecond)
	id, err := admitAt(l, p, 10, tomorrow.Add(-time.Second))
	require.NoError(t, err, "today's admissions go on, from a new slice")
	require.False(t, l.Holds(p, tomorrow), "no slice of tomorrow while its last is folded back")
	open()
	l.Release(id)
	require.Eventually(t, func() bool {
		id, err := admitAt(l, p, 10, tomorrow.Add(-time.Second))
		require.NoError(t, err)
		l.Release(id)
		return l.Holds(p, tomorrow)
	}, 10*time.Second, time.Millisecond, "once folded, tomorrow's slice is granted ahead again")
}

// TestAGrantThatFailsFailsForAllWhoWaitOnIt: while the database does not
// answer, the requests of an account-day that wait for the grant in flight
// fail with it, instead of each sending one more grant in turn after it
// (each waiting for all the failures before its own).
func TestAGrantThatFailsFailsForAllWhoWaitOnIt(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.Connect(t, testdb.Unanswering(t)))}
	l := ledger.New(ledger.Config{}, st)
	p := &gateway.Principal{AccountID: uuid.Must(uuid.NewV7()), ProjectID: uuid.Must(uuid.NewV7()), Tier: gateway.TierDeveloper}
	const requests = 8
	errs := make(chan error, requests)
	request := func() {
		_, err := admit(l, p, 10)
		errs <- err
	}
	go request()
	require.Eventually(t, func() bool { return st.grants.Load() == 1 }, 10*time.Second, time.Millisecond)
	for range requests - 1 {
		go request()
	}
	for range requests {
		require.ErrorIs(t, <-errs, context.DeadlineExceeded)
	}
	require.Equal(t, int64(1), st.grants.Load(), "one grant for all")
}

// TestRefusalsAreAnsweredFromMemory: a burst of requests past the cap costs
// one grant statement per RefusalMemory, not one each; a request the slice
// still covers is admitted meanwhile.
func TestRefusalsAreAnsweredFromMemory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st := b.counted(t, ledger.Config{})
	p := b.principal(t, "acme", nil, ptr(int64(100)))
	id, err := admit(l, p, 80)
	require.NoError(t, err)
	l.Release(id) // 80 of the slice's 100 back in memory
	start := time.Now()
	for range 50 {
		_, err := admit(l, p, 200)
		require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err))
	}
	elapsed := time.Since(start)
	require.LessOrEqual(t, st.grants.Load(), int64(2+elapsed/ledger.RefusalMemory), "after %s", elapsed)
	before := st.grants.Load()
	_, err = admit(l, p, 80)
	require.NoError(t, err, "what the slice holds is still admitted")
	require.Equal(t, before, st.grants.Load(), "from memory")
}

// TestARefusedRefillIsNotAskedAgainAtEachAdmission: a slice whose refill
// the ceiling refused goes on admitting what it holds without asking for
// more at each admission: the refusal answers for RefusalMemory.
func TestARefusedRefillIsNotAskedAgainAtEachAdmission(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st := b.counted(t, ledger.Config{})
	p := b.principal(t, "acme", ptr(int64(1600)), nil)
	today := gateway.UTCDay(time.Now())
	id, err := admit(l, p, 10) // a slice of 100
	require.NoError(t, err)
	l.Release(id)
	_, err = admit(b.replica(t, ledger.Config{}), p, 1500) // another replica holds the rest of the day
	require.NoError(t, err)

	start := time.Now()
	_, err = admit(l, p, 80) // the refill starts at 20 available, and is refused
	require.NoError(t, err)
	require.Eventually(t, func() bool { return st.grants.Load() == 2 && !l.Granting(p, today) }, 10*time.Second, time.Millisecond)
	_, err = admit(l, p, 30)
	require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(err), "more than the slice holds: the refusal, from memory")
	for range 10 {
		id, err := admit(l, p, 10)
		require.NoError(t, err, "what the slice holds is still admitted")
		l.Release(id)
		require.Eventually(t, func() bool { return !l.Granting(p, today) }, 10*time.Second, time.Millisecond)
	}
	elapsed := time.Since(start)
	require.LessOrEqual(t, st.grants.Load(), int64(2+elapsed/ledger.RefusalMemory), "after %s", elapsed)
}

// TestConcurrentAdmissionsNeverPassTheCap: 200 concurrent requests against a
// budget and a ceiling that fit 10, over 1 and 3 replicas, with usage
// reported above the estimate: exactly 10 are admitted, and what is billed is
// what they used — the overspend is the difference between their estimates
// and the upstream's counts, and no more (D5).
func TestConcurrentAdmissionsNeverPassTheCap(t *testing.T) {
	t.Parallel()
	for _, replicas := range []int{1, 3} {
		for name, limits := range map[string][2]*int64{
			"budget": {nil, ptr(int64(1000))},
			"daily":  {ptr(int64(1000)), nil},
		} {
			t.Run(fmt.Sprintf("%s/replicas=%d", name, replicas), func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				ledgers := make([]*ledger.Ledger, replicas)
				for i := range ledgers {
					ledgers[i] = b.replica(t, ledger.Config{Owner: uuid.Must(uuid.NewV7())})
				}
				p := b.principal(t, "acme", limits[0], limits[1])
				// All admissions race first, then the admitted settle concurrently.
				type running struct {
					l  *ledger.Ledger
					id uuid.UUID
				}
				var mu sync.Mutex
				var admittedRequests []running
				var wg sync.WaitGroup
				for i := range 200 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						l := ledgers[i%replicas]
						id, err := admit(l, p, 100)
						if err != nil {
							require.Contains(t, []gateway.ErrorCode{gateway.EBudgetExceeded, gateway.ERateLimited}, gateway.ErrorCodeOf(err), err)
							return
						}
						mu.Lock()
						admittedRequests = append(admittedRequests, running{l, id})
						mu.Unlock()
					}()
				}
				wg.Wait()
				var admitted, billed atomic.Int64
				admitted.Store(int64(len(admittedRequests)))
				for i, r := range admittedRequests {
					wg.Add(1)
					go func() {
						defer wg.Done()
						cost := int64(100 + i%7) // the upstream counted more than estimated
						require.NoError(t, r.l.Settle(b.ctx, record(p, r.id, cost)))
						billed.Add(cost)
					}()
				}
				wg.Wait()
				require.Equal(t, int64(10), admitted.Load())
				v := b.view(t, p)
				require.Equal(t, billed.Load(), v.Totals.TotalRungs)
				require.Equal(t, billed.Load(), v.Daily.Charged)
				require.Equal(t, billed.Load(), v.Budget.Spent)
				require.LessOrEqual(t, billed.Load(), int64(1000)+6*10, "the cap plus what the upstream counted above the estimates")
			})
		}
	}
}

// gatedStore holds the first group commit until released, counting groups.
type gatedStore struct {
	*store.Store
	gate chan struct{}
	// held is set once the first commit waits at the gate.
	held   atomic.Bool
	once   sync.Once
	mu     sync.Mutex
	groups []int
}

// sizes are the sizes of the groups committed so far, in order.
func (g *gatedStore) sizes() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int(nil), g.groups...)
}

func (g *gatedStore) SettleRequests(ctx context.Context, group []store.Settlement) error {
	g.once.Do(func() {
		g.held.Store(true)
		<-g.gate
	})
	g.mu.Lock()
	g.groups = append(g.groups, len(group))
	g.mu.Unlock()
	return g.Store.SettleRequests(ctx, group)
}

// gatedLedger is a running ledger whose first group commit waits until
// gated.gate is closed, its metrics, and a principal to settle under.
func (b *testBundle) gatedLedger(t *testing.T) (*ledger.Ledger, *gatedStore, *metrics.Metrics, *gateway.Principal) {
	t.Helper()
	gated := &gatedStore{Store: b.store, gate: make(chan struct{})}
	m := metrics.New()
	l := ledger.New(ledger.Config{Metrics: m}, gated)
	b.run(t, l)
	return l, gated, m, b.principal(t, "acme", nil, nil)
}

// TestSettlementsCommitInGroups: requests that finish while a commit is in
// flight are committed together, in one statement, when it ends; a member
// whose data the database refuses fails alone (D11). The metrics count the
// groups stored, not those that failed.
func TestSettlementsCommitInGroups(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, gated, m, p := b.gatedLedger(t)

	settle := func(r gateway.UsageRecord, errs chan<- error) {
		id, err := admit(l, p, 100)
		require.NoError(t, err)
		r.RequestID = id
		errs <- l.Settle(b.ctx, r)
	}
	first := make(chan error, 1)
	go settle(record(p, uuid.Nil, 10), first)
	require.Eventually(t, gated.held.Load, 5*time.Second, time.Millisecond, "the first request commits first")
	errs := make(chan error, 20)
	for i := range 20 {
		r := record(p, uuid.Nil, 10)
		if i == 7 {
			r.Model = "no such model" // refused by the requests table's check
		}
		go settle(r, errs)
	}
	require.Eventually(t, func() bool { return l.Waiting() == 20 }, 5*time.Second, time.Millisecond)
	close(gated.gate)
	require.NoError(t, <-first)
	failed := 0
	for range 20 {
		if err := <-errs; err != nil {
			failed++
		}
	}
	require.Equal(t, 1, failed, "only the bad member fails")
	groups := gated.sizes()
	require.Equal(t, 1, groups[0])
	require.Equal(t, 20, groups[1], "the twenty that waited went in one statement")
	require.Len(t, groups, 2+20, "the failed group, then each member alone")
	v := b.view(t, p)
	require.Equal(t, int64(20), v.Totals.Requests)
	require.Equal(t, int64(200), v.Daily.Charged)

	// The first alone, then the nineteen good members alone; the groups that
	// failed stored nothing.
	scrape := metricstest.Scrape(m)
	require.Contains(t, scrape, `gateway_group_commit_size_count{work="settlement"} 20`+"\n")
	require.Contains(t, scrape, `gateway_group_commit_duration_seconds_count{work="settlement"} 20`+"\n")
}

// TestGroupCommitsAreMeasured: each stored group is measured once, with its
// size.
func TestGroupCommitsAreMeasured(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, gated, m, p := b.gatedLedger(t)
	errs := make(chan error, 6)
	settle := func() {
		id, err := admit(l, p, 100)
		require.NoError(t, err)
		errs <- l.Settle(b.ctx, record(p, id, 10))
	}
	go settle()
	require.Eventually(t, gated.held.Load, 5*time.Second, time.Millisecond, "the first request commits first")
	for range 5 {
		go settle()
	}
	require.Eventually(t, func() bool { return l.Waiting() == 5 }, 5*time.Second, time.Millisecond)
	close(gated.gate)
	for range 6 {
		require.NoError(t, <-errs)
	}
	require.Equal(t, []int{1, 5}, gated.sizes())

	scrape := metricstest.Scrape(m)
	require.Contains(t, scrape, `gateway_group_commit_size_count{work="settlement"} 2`+"\n")
	require.Contains(t, scrape, `gateway_group_commit_size_sum{work="settlement"} 6`+"\n")
	require.Contains(t, scrape, `gateway_group_commit_duration_seconds_count{work="settlement"} 2`+"\n")
}

// TestDeadReplicaSlicesComeBack: a replica that dies holding a slice (never
// folded, never renewed) keeps it from others only until its lease runs out;
// then the fold gives it back, and what it settled stays billed once.
func TestDeadReplicaSlicesComeBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	// The dead replica: not running, so never renewing or folding.
	dead := ledger.New(ledger.Config{Owner: uuid.Must(uuid.NewV7()), Lease: time.Second, Share: 1}, store.New(testdb.Connect(t, b.url)))
	id, err := admit(dead, p, 100)
	require.NoError(t, err)
	require.NoError(t, dead.Settle(b.ctx, record(p, id, 40)))
	_, err = admit(dead, p, 100) // running when it dies
	require.NoError(t, err)

	alive := b.replica(t, ledger.Config{Owner: uuid.Must(uuid.NewV7())})
	_, err = admit(alive, p, 100)
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err), "the whole cap is the dead replica's slice")

	require.Eventually(t, func() bool {
		n, err := b.store.FoldExpiredQuotaLeases(b.ctx, 100)
		require.NoError(t, err)
		return n == 1
	}, 10*time.Second, 50*time.Millisecond)
	v := b.view(t, p)
	require.Equal(t, int64(40), v.Budget.Spent, "what it settled, once")
	require.Zero(t, v.Budget.Reserved)
	id, err = admit(alive, p, 960)
	require.NoError(t, err, "everything but what was used came back")
	require.NoError(t, alive.Settle(b.ctx, record(p, id, 960)))
	require.Equal(t, int64(1000), b.view(t, p).Budget.Spent)
}

// TestLimitChangesApply: after Invalidate (a change to limits was announced)
// nothing more is admitted from the old slices; the new cap applies. The old
// slice is folded back when its last request ends, not once idle (never,
// here) nor at the next round of renewals (10 s).
func TestLimitChangesApply(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{Idle: time.Hour})
	p := b.principal(t, "acme", nil, ptr(int64(100_000)))
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", Project: "default", BudgetRungs: ptr(int64(150))}))
	l.Invalidate(p.AccountID)
	_, err = admit(l, p, 100)
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err), "the old slice (6,250) is not used under the new cap")
	require.NoError(t, l.Settle(b.ctx, record(p, id, 50)))
	require.Eventually(t, func() bool {
		_, err := admit(l, p, 100)
		return err == nil
	}, 5*time.Second, 20*time.Millisecond, "once the old slice is folded back, the new cap has room")
	require.Equal(t, int64(50), b.view(t, p).Budget.Spent)
}

// TestLimitChangesApplyToTheirAccountOnly: a change to one account's limits
// retires that account's slices, not another's, whose requests go on from its
// slice without a grant; a change that names no account retires them all.
func TestLimitChangesApplyToTheirAccountOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, st := b.counted(t, ledger.Config{Idle: time.Hour})
	changed := b.principal(t, "changed", nil, ptr(int64(100_000)))
	other := b.principal(t, "other", nil, ptr(int64(100_000)))
	serve := func() {
		t.Helper()
		for _, p := range []*gateway.Principal{changed, other} {
			id, err := admit(l, p, 100)
			require.NoError(t, err)
			require.NoError(t, l.Settle(b.ctx, record(p, id, 10)))
		}
	}
	serve()
	require.Equal(t, int64(2), st.grants.Load())
	l.Invalidate(changed.AccountID)
	serve()
	require.Equal(t, int64(3), st.grants.Load(), "only the changed account's slice was granted again")
	l.Invalidate(uuid.Nil)
	serve()
	require.Equal(t, int64(5), st.grants.Load(), "both were granted again")
	require.Equal(t, int64(30), b.view(t, other).Budget.Spent)
}

// TestHeldLeasesAreRenewedAndIdleOnesFolded: a replica renews the slices it
// uses past their first lease, and folds back those it stops using.
func TestHeldLeasesAreRenewedAndIdleOnesFolded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.replica(t, ledger.Config{Lease: 600 * time.Millisecond, Idle: time.Hour})
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	time.Sleep(1500 * time.Millisecond) // two and a half leases
	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Zero(t, n, "the lease is renewed while the request runs")
	require.NoError(t, l.Settle(b.ctx, record(p, id, 10)))

	idle := b.replica(t, ledger.Config{Idle: 50 * time.Millisecond})
	q := b.principal(t, "other", nil, ptr(int64(1000)))
	id, err = admit(idle, q, 100)
	require.NoError(t, err)
	require.NoError(t, idle.Settle(b.ctx, record(q, id, 10)))
	require.Eventually(t, func() bool { return b.admits(q, 990) }, 10*time.Second, 20*time.Millisecond, "the idle slice came back")
}

// TestASliceFoldedElsewhereAdmitsNothingMore: a slice that its replica's
// renewal finds folded (by another replica, after this one stalled past its
// lease, say) admits nothing more, though its replica still counts room in
// it: another replica leases what the fold gave back, and the cap holds.
// What settles under the folded slice is charged directly, once.
func TestASliceFoldedElsewhereAdmitsNothingMore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	owner := uuid.Must(uuid.NewV7())
	l := b.replica(t, ledger.Config{Owner: owner, Lease: 600 * time.Millisecond, Idle: time.Hour, Share: 1})
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	var lease uuid.UUID
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT id FROM quota_leases WHERE owner = $1`, owner).Scan(&lease))
	n, err := b.store.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{lease})
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "folded elsewhere")
	time.Sleep(700 * time.Millisecond) // past a renewal (a third of a lease)

	other := b.replica(t, ledger.Config{Owner: uuid.Must(uuid.NewV7()), Share: 1})
	theirs, err := admit(other, p, 960)
	require.NoError(t, err, "the fold gave the slice back")
	_, err = admit(l, p, 100)
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err), "the folded slice admits nothing more")

	require.NoError(t, l.Settle(b.ctx, record(p, id, 40)))
	require.NoError(t, other.Settle(b.ctx, record(p, theirs, 960)))
	v := b.view(t, p)
	require.Equal(t, int64(1000), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)
}

// foldFailingStore fails the first folds asked of it, as a database away for
// a moment would, and, when refuse is set, every fold of a lease it names.
type foldFailingStore struct {
	*store.Store
	failures atomic.Int32 // folds still to fail
	folds    atomic.Int32 // folds asked
	refuse   func(ids []uuid.UUID) bool
}

func (f *foldFailingStore) FoldQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID) (int64, error) {
	f.folds.Add(1)
	if f.failures.Add(-1) >= 0 {
		return 0, errors.New("connection refused")
	}
	if f.refuse != nil && f.refuse(ids) {
		return 0, errors.New("refused for its data")
	}
	return f.Store.FoldQuotaLeases(ctx, owner, ids)
}

// TestAFailedFoldIsTriedAgain: a slice whose fold failed comes back at a
// later beat of its replica, long before its lease (an hour here) runs out;
// the failure is told.
func TestAFailedFoldIsTriedAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	failing := &foldFailingStore{Store: b.store}
	failing.failures.Store(2)
	logs := &syncbuf.Buffer{}
	l := ledger.New(ledger.Config{Lease: time.Hour, Idle: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))}, failing)
	b.run(t, l)
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	id, err := admit(l, p, 100)
	require.NoError(t, err)
	require.NoError(t, l.Settle(b.ctx, record(p, id, 10)))

	require.Eventually(t, func() bool { return b.admits(p, 990) }, 10*time.Second, 20*time.Millisecond, "the slice came back")
	require.GreaterOrEqual(t, failing.folds.Load(), int32(3), "two folds failed before one passed")
	v := b.view(t, p)
	require.Equal(t, int64(10), v.Budget.Spent, "what was used under the slice, once")
	require.Contains(t, logs.String(), "error folding back quota leases; trying again at the next beat")
}

// TestAShutdownFoldsAgainWhatFailedBefore: a slice whose fold failed while
// its ledger ran is folded back when the ledger stops, once the database
// takes it.
func TestAShutdownFoldsAgainWhatFailedBefore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var stopping atomic.Bool
	failing := &foldFailingStore{Store: b.store, refuse: func([]uuid.UUID) bool { return !stopping.Load() }}
	l := ledger.New(ledger.Config{Lease: time.Hour, Idle: 50 * time.Millisecond}, failing)
	stop := b.run(t, l)
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	b.request(t, l, p)
	require.Eventually(t, func() bool { return failing.folds.Load() >= 2 }, 10*time.Second, 10*time.Millisecond, "the fold failed, and again")
	require.False(t, b.admits(p, 900), "the slice is away")

	stopping.Store(true)
	stop()
	require.True(t, b.admits(p, 900), "the slice came back at the shutdown")
	require.Equal(t, int64(100), b.view(t, p).Budget.Spent)
}

// TestAShutdownWithTheDatabaseAwayFoldsOnce: a ledger that stops while its
// fold fails sends no second one (the database is likely away, and each
// statement could keep the shutdown a statement timeout); the slice is left
// to run out with its lease.
func TestAShutdownWithTheDatabaseAwayFoldsOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	failing := &foldFailingStore{Store: b.store}
	l := ledger.New(ledger.Config{Lease: time.Hour, Idle: time.Hour}, failing)
	stop := b.run(t, l)
	p := b.principal(t, "acme", nil, ptr(int64(1000)))
	b.request(t, l, p)

	failing.failures.Store(1 << 30)
	stop()
	require.Equal(t, int32(1), failing.folds.Load(), "one fold at the shutdown, not tried again")
	require.False(t, b.admits(p, 900), "the slice is left to run out")
}

// TestAFoldRefusedForOneLeaseKeepsNoOtherAway: when leases of two tenants
// that failed to fold together fail again, each is folded alone; the one the
// database refuses stays away (until its lease runs out, an hour here), the
// other comes back.
func TestAFoldRefusedForOneLeaseKeepsNoOtherAway(t *testing.T) {
	t.Parallel()
	b := setup(t)
	failing := &foldFailingStore{Store: b.store}
	failing.failures.Store(1) // the first fold, of both leases, fails
	var (
		mu       sync.Mutex
		poisoned uuid.UUID // the first lease of the first fold not failed as transient, refused ever after
	)
	failing.refuse = func(ids []uuid.UUID) bool {
		mu.Lock()
		defer mu.Unlock()
		if poisoned == uuid.Nil {
			poisoned = ids[0]
		}
		return slices.Contains(ids, poisoned)
	}
	l := ledger.New(ledger.Config{Lease: time.Hour, Idle: 200 * time.Millisecond}, failing)
	principals := []*gateway.Principal{
		b.principal(t, "acme", nil, ptr(int64(1000))),
		b.principal(t, "other", nil, ptr(int64(1000))),
	}
	for _, p := range principals {
		id, err := admit(l, p, 100)
		require.NoError(t, err)
		require.NoError(t, l.Settle(b.ctx, record(p, id, 10)))
	}
	b.run(t, l) // both idle at its first beats: folded together

	var returned, kept *gateway.Principal
	require.Eventually(t, func() bool {
		for i, p := range principals {
			if b.admits(p, 990) {
				returned, kept = p, principals[1-i]
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "one slice came back")
	require.False(t, b.admits(kept, 990), "the refused slice is still away")
	require.Equal(t, int64(10), b.view(t, returned).Budget.Spent)
	require.Equal(t, int64(10), b.view(t, kept).Budget.Spent, "what was used under the refused slice counts")
	mu.Lock()
	defer mu.Unlock()
	require.NotEqual(t, uuid.Nil, poisoned)
}

// renewalRecordingStore records the size of each renewal statement.
type renewalRecordingStore struct {
	*store.Store
	mu    sync.Mutex
	sizes []int
}

func (r *renewalRecordingStore) RenewQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID, lease time.Duration) ([]uuid.UUID, error) {
	r.mu.Lock()
	r.sizes = append(r.sizes, len(ids))
	r.mu.Unlock()
	return r.Store.RenewQuotaLeases(ctx, owner, ids, lease)
}

// TestManyLeasesAreRenewedInSmallStatements: a replica holding the leases of
// many accounts renews them a hundred at a time (a statement holds the
// leases it locks until it commits, and each settlement waits for the lease
// it charges), and every one of them stays held.
func TestManyLeasesAreRenewedInSmallStatements(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &renewalRecordingStore{Store: store.New(testdb.Connect(t, b.url))}
	l := ledger.New(ledger.Config{Lease: 900 * time.Millisecond, Idle: time.Hour}, st)
	b.run(t, l)
	const accounts = 250
	for i := range accounts {
		p := b.principal(t, fmt.Sprintf("tenant-%d", i), nil, nil)
		_, err := admit(l, p, 10)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		renewed := 0
		for _, n := range st.sizes {
			renewed += n
		}
		return renewed >= 2*accounts
	}, 10*time.Second, 20*time.Millisecond, "the leases are renewed, twice over")
	st.mu.Lock()
	require.LessOrEqual(t, slices.Max(st.sizes), 100, "no renewal statement extends more than a hundred leases: %v", st.sizes)
	st.mu.Unlock()
	time.Sleep(2 * 900 * time.Millisecond) // two leases more
	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, accounts)
	require.NoError(t, err)
	require.Zero(t, n, "every lease is held: none ran out")
}

// TestASliceInSteadyUseIsGrantedOnce: a slice used all the time is renewed
// before its replica stops using it, lease after lease, so it is granted
// once. Renewals skipped a beat whenever the beat before had come late (the
// folds ran first), and then the slice lapsed here while the database still
// held it: the next request was granted a new one, a durable commit before
// its dispatch.
func TestASliceInSteadyUseIsGrantedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &countingStore{Store: store.New(testdb.Connect(t, b.url))}
	const lease = 900 * time.Millisecond
	l := ledger.New(ledger.Config{Lease: lease, Idle: lease / 3}, st)
	b.run(t, l)
	p := b.principal(t, "acme", nil, nil)
	for deadline := time.Now().Add(6 * lease); time.Now().Before(deadline); {
		id, err := admit(l, p, 10)
		require.NoError(t, err)
		require.NoError(t, l.Settle(b.ctx, record(p, id, 5)))
		time.Sleep(2 * time.Millisecond)
	}
	require.Equal(t, int64(1), st.grants.Load(), "one grant in six leases")
}

// renewalFailingStore fails each renewal for which fail, called with mu
// held, returns an error, and counts grants.
type renewalFailingStore struct {
	*countingStore
	mu   sync.Mutex
	fail func(ids []uuid.UUID) error
}

func (r *renewalFailingStore) RenewQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID, lease time.Duration) ([]uuid.UUID, error) {
	r.mu.Lock()
	var err error
	if r.fail != nil {
		err = r.fail(ids)
	}
	r.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return r.Store.RenewQuotaLeases(ctx, owner, ids, lease)
}

// heldLeases admits a request of each of n accounts that never ends, so that
// l holds a lease of each.
func (b *testBundle) heldLeases(t *testing.T, l *ledger.Ledger, n int) []*gateway.Principal {
	t.Helper()
	principals := make([]*gateway.Principal, n)
	for i := range principals {
		principals[i] = b.principal(t, fmt.Sprintf("tenant-%d", i), nil, nil)
	}
	for _, p := range principals {
		_, err := admit(l, p, 10)
		require.NoError(t, err)
	}
	return principals
}

// TestARenewalRefusedForOneLeaseRenewsTheOthers: when a renewal statement
// fails for its data, its leases are renewed one by one, so that the one the
// database refuses runs out alone and the other statements go on (D11).
func TestARenewalRefusedForOneLeaseRenewsTheOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var poisoned uuid.UUID // the first lease of the first renewal, refused ever after
	st := &renewalFailingStore{countingStore: &countingStore{Store: store.New(testdb.Connect(t, b.url))}}
	st.fail = func(ids []uuid.UUID) error {
		if poisoned == uuid.Nil {
			poisoned = ids[0]
		}
		if slices.Contains(ids, poisoned) {
			return errors.New("refused for its data")
		}
		return nil
	}
	const lease = 900 * time.Millisecond
	l := ledger.New(ledger.Config{Lease: lease, Idle: time.Hour, Unavailable: store.Transient}, st)
	b.run(t, l)
	const accounts = 250 // three statements a renewal
	b.heldLeases(t, l, accounts)
	time.Sleep(2 * lease)
	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, accounts)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "only the refused lease ran out")
	st.mu.Lock()
	defer st.mu.Unlock()
	require.NotEqual(t, uuid.Nil, poisoned)
}

// TestARenewalCutShortKeepsWhatItRenewed: when the database goes away in the
// middle of a renewal, the leases it renewed before are used on, and only
// the others are granted anew once they lapse; the rest of the renewal waits
// for the next beat, rather than being sent lease by lease to a database
// away.
func TestARenewalCutShortKeepsWhatItRenewed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := &renewalFailingStore{countingStore: &countingStore{Store: store.New(testdb.Connect(t, b.url))}}
	const lease = 900 * time.Millisecond
	logs := &syncbuf.Buffer{}
	l := ledger.New(ledger.Config{Lease: lease, Idle: time.Hour, Unavailable: store.Transient, Logger: slog.New(slog.NewTextHandler(logs, nil))}, st)
	b.run(t, l)
	principals := b.heldLeases(t, l, 150) // two statements a renewal
	rows, err := b.store.Pool().Query(b.ctx, `SELECT id FROM quota_leases ORDER BY id LIMIT 100`)
	require.NoError(t, err)
	oldest, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	// From now on a renewal statement of the oldest hundred leases passes,
	// and one of any other times out.
	alone := 0 // statements of one lease that timed out
	st.mu.Lock()
	st.fail = func(ids []uuid.UUID) error {
		for _, id := range ids {
			if !slices.Contains(oldest, id) {
				if len(ids) == 1 {
					alone++
				}
				return fmt.Errorf("error renewing: %w", context.DeadlineExceeded)
			}
		}
		return nil
	}
	st.mu.Unlock()
	time.Sleep(lease) // the newest fifty lapse here
	grants := st.grants.Load()
	for _, p := range principals {
		_, err := admit(l, p, 10)
		require.NoError(t, err)
	}
	require.Equal(t, int64(50), st.grants.Load()-grants, "the fifty leases not renewed are granted anew, the others used on")
	st.mu.Lock()
	defer st.mu.Unlock()
	require.Zero(t, alone, "a statement that failed as the database went away is not sent again lease by lease")
	require.Contains(t, logs.String(), "error renewing quota leases", "the failure is told")
}
