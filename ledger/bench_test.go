package ledger_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/ledger"
	"github.com/rungworks/gateway/store"
)

// answeringStore counts the grants answered, by day.
type answeringStore struct {
	*store.Store
	mu       sync.Mutex
	answered map[time.Time]int
}

func (a *answeringStore) GrantQuota(ctx context.Context, r store.QuotaRequest) (store.QuotaGrant, error) {
	g, err := a.Store.GrantQuota(ctx, r)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.answered[r.Day]++
	return g, err
}

// answeredFor is how many grants of day were answered.
func (a *answeringStore) answeredFor(day time.Time) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.answered[day]
}

// BenchmarkTheTurnOfADay: the first requests of a day of 1,000 accounts, sent
// together, each admitted by a replica (a pool of 8 connections, the
// default) that admitted one of each account the second before: with the
// next day's slices granted ahead in the day's last minutes (the default) and
// without, each waiting for its grant. An operation is one day's turn, the
// requests of its last second and first second and the grants of the new day
// (ahead: those of the last second, awaited before the first second's);
// reported, the first second's admissions' p50, p99 and slowest.
func BenchmarkTheTurnOfADay(b *testing.B) {
	const accounts = 1000
	bundle := setup(b)
	ctx, url := bundle.ctx, bundle.url
	principals := make([]*gateway.Principal, accounts)
	for i := range principals {
		principals[i] = bundle.principal(b, fmt.Sprintf("tenant-%d", i), nil, nil)
	}
	for n, c := range []struct {
		name     string
		dayAhead time.Duration
	}{{"ahead", 0}, {"at-the-turn", -1}} {
		b.Run(c.name, func(b *testing.B) {
			pool, err := store.Connect(ctx, url, "gateway bench "+b.Name(), 8)
			require.NoError(b, err)
			b.Cleanup(pool.Close)
			st := &answeringStore{Store: store.New(pool), answered: map[time.Time]int{}}
			l := ledger.New(ledger.Config{DayAhead: c.dayAhead}, st)
			// Days of their own, far from today and from the other case's.
			first := gateway.UTCDay(time.Now()).AddDate(0, 0, 10+1000*n)
			var waits []time.Duration
			b.ResetTimer()
			for i := range b.N {
				turn := first.AddDate(0, 0, i+1)
				for _, p := range principals {
					id, err := admitAt(l, p, 10, turn.Add(-time.Second))
					require.NoError(b, err)
					l.Release(id)
				}
				for c.dayAhead >= 0 && st.answeredFor(turn) < accounts {
					time.Sleep(time.Millisecond)
				}
				took := make([]time.Duration, accounts)
				var wg sync.WaitGroup
				for j, p := range principals {
					wg.Add(1)
					go func() {
						defer wg.Done()
						start := time.Now()
						id, err := admitAt(l, p, 10, turn.Add(time.Second))
						took[j] = time.Since(start)
						if err != nil {
							b.Error(err)
							return
						}
						l.Release(id)
					}()
				}
				wg.Wait()
				waits = append(waits, took...)
			}
			b.StopTimer()
			slices.Sort(waits)
			at := func(q float64) float64 { return float64(waits[int(q*float64(len(waits)-1))].Microseconds()) }
			b.ReportMetric(at(0.5), "p50-µs")
			b.ReportMetric(at(0.99), "p99-µs")
			b.ReportMetric(at(1), "max-µs")
		})
	}
}
