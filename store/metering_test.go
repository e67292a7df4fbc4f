package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

func (b *testBundle) admit(p *gateway.Principal, estimate int64, expires time.Time) (uuid.UUID, error) {
	id := uuid.Must(uuid.NewV7())
	return id, b.store.Admit(b.ctx, gateway.Admission{RequestID: id, Principal: p, Estimate: estimate, Day: time.Now(), ExpiresAt: expires})
}

func (b *testBundle) settle(t *testing.T, p *gateway.Principal, id uuid.UUID, total int64) {
	t.Helper()
	now := time.Now().UTC()
	require.NoError(t, b.store.Settle(b.ctx, gateway.UsageRecord{
		RequestID: id, Principal: p, Model: gateway.ModelInstant, Entry: gateway.EntryResponses,
		Usage:     gateway.Usage{InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: total - 1, TotalRungs: total},
		CreatedAt: now, CompletedAt: now, EvidenceExpiresAt: now.Add(time.Hour),
	}))
}

func (b *testBundle) view(t *testing.T, p *gateway.Principal) *gateway.UsageView {
	t.Helper()
	day := gateway.UTCDay(time.Now())
	v, err := b.store.Usage(b.ctx, p, day, day.Add(24*time.Hour))
	require.NoError(t, err)
	return v
}

func (b *testBundle) limits(t *testing.T, account string, daily, budget *int64) {
	t.Helper()
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: account, DailyRungs: daily, Project: "default", BudgetRungs: budget}))
}

func ptr[T any](v T) *T { return &v }

func TestAdmitSettleRelease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))

	id, err := b.admit(p, 100, time.Now().Add(time.Hour))
	require.NoError(t, err)
	v := b.view(t, p)
	require.Equal(t, int64(100), v.Daily.Charged, "the estimate is charged at admission")
	require.Equal(t, int64(100), v.Budget.Reserved)

	b.settle(t, p, id, 30)
	v = b.view(t, p)
	require.Equal(t, int64(30), v.Daily.Charged, "reconciled to the actual cost")
	require.Equal(t, int64(0), v.Budget.Reserved)
	require.Equal(t, int64(30), v.Budget.Spent)
	require.Equal(t, int64(1), v.Totals.Requests)
	require.Equal(t, int64(30), v.Totals.TotalRungs)

	id, err = b.admit(p, 100, time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.NoError(t, b.store.Release(b.ctx, id))
	v = b.view(t, p)
	require.Equal(t, int64(30), v.Daily.Charged, "a released request costs nothing")
	require.Equal(t, int64(0), v.Budget.Reserved)
	require.Equal(t, int64(1), v.Totals.Requests)
	require.NoError(t, b.store.Release(b.ctx, id), "releasing twice is harmless")
	require.Equal(t, int64(30), b.view(t, p).Daily.Charged)
}

func TestAdmitRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(250)), nil)
	for range 2 {
		_, err := b.admit(p, 100, time.Now().Add(time.Hour))
		require.NoError(t, err)
	}
	_, err := b.admit(p, 100, time.Now().Add(time.Hour))
	require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(err))
	var e *gateway.Error
	require.ErrorAs(t, err, &e)
	require.Positive(t, e.RetryAfter)
	require.LessOrEqual(t, e.RetryAfter, 24*time.Hour)
	require.Equal(t, int64(200), b.view(t, p).Daily.Charged, "a refused request charges nothing")

	_, q := b.key(t, "budgeted", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "budgeted", nil, ptr(int64(250)))
	for range 2 {
		_, err := b.admit(q, 100, time.Now().Add(time.Hour))
		require.NoError(t, err)
	}
	_, err = b.admit(q, 100, time.Now().Add(time.Hour))
	require.Equal(t, gateway.EBudgetExceeded, gateway.ErrorCodeOf(err))
	v := b.view(t, q)
	require.Equal(t, int64(200), v.Budget.Reserved)
	require.Equal(t, int64(200), v.Daily.Charged, "a budget refusal leaves the daily charge untouched")
	require.Equal(t, int64(10_000_000), v.Daily.Ceiling, "developer default")

	_, f := b.key(t, "freeco", gateway.TierFree, gateway.ScopeInference)
	require.Equal(t, int64(1_000_000), b.view(t, f).Daily.Ceiling, "free default")
}

// TestAdmitConcurrently: 200 concurrent admissions against a budget and a
// ceiling that fit exactly 10 never admit an eleventh.
func TestAdmitConcurrently(t *testing.T) {
	t.Parallel()
	for name, limit := range map[string]func(b *testBundle, account string){
		"budget": func(b *testBundle, account string) { b.limits(t, account, nil, ptr(int64(1000))) },
		"daily":  func(b *testBundle, account string) { b.limits(t, account, ptr(int64(1000)), nil) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
			limit(b, "acme")
			var admitted, refused atomic.Int64
			var wg sync.WaitGroup
			for range 200 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, err := b.admit(p, 100, time.Now().Add(time.Hour))
					if err == nil {
						admitted.Add(1)
					} else {
						require.Contains(t, []gateway.ErrorCode{gateway.EBudgetExceeded, gateway.ERateLimited}, gateway.ErrorCodeOf(err), err)
						refused.Add(1)
					}
				}()
			}
			wg.Wait()
			require.Equal(t, int64(10), admitted.Load())
			require.Equal(t, int64(190), refused.Load())
			v := b.view(t, p)
			require.Equal(t, int64(1000), v.Daily.Charged)
		})
	}
}

func TestRateLimitAcrossReplicas(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	// A fixed clock keeps every request in one window, so the count is exact.
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	limits := store.Options{RateLimits: gateway.RateLimits{Free: 3, Developer: 8}, Clock: func() time.Time { return at }}
	// Two stores with their own pools stand for two replicas.
	a := store.New(testdb.Connect(t, url), limits)
	b := store.New(testdb.Connect(t, url), limits)
	ctx := context.Background()
	token, err := a.CreateKey(ctx, store.CreateKeyParams{Account: "acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)

	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := a
			if i%2 == 1 {
				st = b
			}
			p, err := st.Authenticate(ctx, token)
			require.NoError(t, err)
			require.Equal(t, 8, p.Rate.Limit)
			if p.Rate.Admitted {
				admitted.Add(1)
			} else {
				require.Zero(t, p.Rate.Remaining)
				require.Positive(t, p.Rate.Reset)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(8), admitted.Load(), "two replicas together admit the limit, not twice it")

	free, err := a.CreateKey(ctx, store.CreateKeyParams{Account: "freeco", Project: "default", Tier: ptr(gateway.TierFree), Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	p, err := a.Authenticate(ctx, free)
	require.NoError(t, err)
	require.Equal(t, 3, p.Rate.Limit)
	require.Equal(t, 2, p.Rate.Remaining)
}

func TestRateLimitSlidingWindow(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	ctx := context.Background()
	minute := time.Now().Truncate(time.Minute)
	var now time.Time
	st := store.New(testdb.Connect(t, url), store.Options{RateLimits: gateway.RateLimits{Free: 10, Developer: 10}, Clock: func() time.Time { return now }})
	token, err := st.CreateKey(ctx, store.CreateKeyParams{Account: "acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	count := func(at time.Time, n int) (admitted int) {
		now = at
		for range n {
			p, err := st.Authenticate(ctx, token)
			require.NoError(t, err)
			if p.Rate.Admitted {
				admitted++
			}
		}
		return admitted
	}
	require.Equal(t, 10, count(minute.Add(50*time.Second), 12), "the limit within a minute")
	// 15 s into the next minute, 3/4 of the previous minute still counts: 7.5 used.
	require.Equal(t, 2, count(minute.Add(75*time.Second), 5))
	// A minute later only the new window's own requests count.
	require.Equal(t, 8, count(minute.Add(180*time.Second), 8))
}

func TestReleaseExpiredReservations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	dead, err := b.admit(p, 100, time.Now().Add(-time.Second))
	require.NoError(t, err)
	_, err = b.admit(p, 50, time.Now().Add(time.Hour))
	require.NoError(t, err)

	n, err := b.store.ReleaseExpiredReservations(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "only the lapsed lease is released")
	v := b.view(t, p)
	require.Equal(t, int64(50), v.Daily.Charged)
	require.Equal(t, int64(50), v.Budget.Reserved)

	// A request settling after recovery released it is charged its actual cost once.
	b.settle(t, p, dead, 20)
	v = b.view(t, p)
	require.Equal(t, int64(70), v.Daily.Charged)
	require.Equal(t, int64(50), v.Budget.Reserved)
	require.Equal(t, int64(20), v.Budget.Spent)
}

func TestUsageView(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	record := func(who *gateway.Principal, model gateway.Model, in, out int64, at time.Time) {
		require.NoError(t, b.store.Settle(b.ctx, gateway.UsageRecord{
			RequestID: uuid.Must(uuid.NewV7()), Principal: who, Model: model, Entry: gateway.EntryResponses,
			Usage:     gateway.Usage{InputRungs: in, OutputRungs: out, TotalRungs: in + out},
			CreatedAt: at, CompletedAt: at, EvidenceExpiresAt: at.Add(time.Hour),
		}))
	}
	record(p, gateway.ModelInstant, 1, 2, now)
	record(p, gateway.ModelInstant, 3, 4, now)
	record(p, gateway.ModelReasoning, 10, 20, now)
	record(p, gateway.ModelElements, 100, 100, now.Add(-48*time.Hour)) // outside the period
	record(other, gateway.ModelInstant, 1000, 1000, now)               // another account

	v, err := b.store.Usage(b.ctx, p, now.Add(-time.Hour), now.Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, gateway.ModelUsage{Requests: 3, InputRungs: 14, OutputRungs: 26, TotalRungs: 40}, v.Totals)
	require.Equal(t, []gateway.ModelUsage{
		{Model: gateway.ModelInstant, Requests: 2, InputRungs: 4, OutputRungs: 6, TotalRungs: 10},
		{Model: gateway.ModelReasoning, Requests: 1, InputRungs: 10, OutputRungs: 20, TotalRungs: 30},
	}, v.ByModel)
	require.Equal(t, "default", v.Budget.Project)
	require.Nil(t, v.Budget.Cap)
	require.Equal(t, gateway.UTCDay(now).Add(24*time.Hour), v.Daily.ResetsAt)

	empty, err := b.store.Usage(b.ctx, p, now.Add(time.Hour), now.Add(2*time.Hour))
	require.NoError(t, err)
	require.Empty(t, empty.ByModel)
	require.NotNil(t, empty.ByModel, "an empty list, not null")
}

// TestLedgerUnderConcurrency races admissions, settlements, releases, the
// reconciler and recovery on one account and project; no statement may fail
// (a deadlock would) and the books must balance afterwards.
func TestLedgerUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1_000_000)))
	ctx, stop := context.WithCancel(b.ctx)
	var background sync.WaitGroup
	for _, job := range []func() error{
		func() error { _, err := b.store.ReconcileSettlements(ctx, 50); return err },
		func() error { _, err := b.store.ReleaseExpiredReservations(ctx, 50); return err },
	} {
		background.Add(1)
		go func() {
			defer background.Done()
			for ctx.Err() == nil {
				if err := job(); err != nil && ctx.Err() == nil {
					t.Errorf("background job: %v", err)
				}
			}
		}()
	}

	var settled atomic.Int64
	var wg sync.WaitGroup
	for i := range 300 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			expires := time.Now().Add(time.Hour)
			if i%10 == 0 {
				expires = time.Now().Add(-time.Second) // a dead replica's request: recovery releases it
			}
			id, err := b.admit(p, 100, expires)
			require.NoError(t, err)
			switch i % 3 {
			case 0:
				require.NoError(t, b.store.Release(b.ctx, id))
			default:
				cost := int64(i%50 + 1)
				b.settle(t, p, id, cost)
				settled.Add(cost)
			}
		}()
	}
	wg.Wait()
	stop()
	background.Wait()
	for {
		n, err := b.store.ReconcileSettlements(b.ctx, 1000)
		require.NoError(t, err)
		if n == 0 {
			break
		}
	}
	v := b.view(t, p)
	require.Equal(t, settled.Load(), v.Totals.TotalRungs)
	require.Equal(t, settled.Load(), v.Daily.Charged, "every charge reconciled to actual, none twice")
	require.Equal(t, settled.Load(), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)
}

func TestReconcileKeepsTheView(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(10_000)))
	for _, cost := range []int64{10, 20, 30} {
		id, err := b.admit(p, 100, time.Now().Add(time.Hour))
		require.NoError(t, err)
		b.settle(t, p, id, cost)
	}
	_, err := b.admit(p, 100, time.Now().Add(time.Hour)) // still running
	require.NoError(t, err)
	before := b.view(t, p)
	require.Equal(t, int64(160), before.Daily.Charged)
	require.Equal(t, int64(100), before.Budget.Reserved)
	require.Equal(t, int64(60), before.Budget.Spent)

	n, err := b.store.ReconcileSettlements(b.ctx, 1000)
	require.NoError(t, err)
	require.Equal(t, int64(3), n, "the running reservation stays")
	require.Equal(t, before, b.view(t, p))
	n, err = b.store.ReconcileSettlements(b.ctx, 1000)
	require.NoError(t, err)
	require.Zero(t, n)
}
