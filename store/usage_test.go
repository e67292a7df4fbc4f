package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// settled is what a test settled, for the usage view to be checked against.
type settled []gateway.UsageRecord

// at is a record of p's completed at t, with model and total rungs.
func at(p *gateway.Principal, t time.Time, model gateway.Model, total int64) gateway.UsageRecord {
	r := record(p, uuid.Must(uuid.NewV7()), total)
	r.Model, r.CreatedAt, r.CompletedAt = model, t, t
	return r
}

// want is the usage view of [start, end) summed from the records themselves.
func (s settled) want(start, end time.Time) (gateway.ModelUsage, map[gateway.Model]gateway.ModelUsage) {
	var totals gateway.ModelUsage
	byModel := map[gateway.Model]gateway.ModelUsage{}
	for _, r := range s {
		if r.CompletedAt.Before(start) || !r.CompletedAt.Before(end) {
			continue
		}
		m := byModel[r.Model]
		for _, u := range []*gateway.ModelUsage{&totals, &m} {
			u.Requests++
			u.InputRungs += r.Usage.InputRungs
			u.OutputRungs += r.Usage.OutputRungs
			u.TotalRungs += r.Usage.TotalRungs
		}
		m.Model = r.Model
		byModel[r.Model] = m
	}
	return totals, byModel
}

// check asserts that the usage view of every period equals the records'.
func (s settled) check(t *testing.T, st *store.Store, p *gateway.Principal, periods [][2]time.Time) {
	t.Helper()
	for _, period := range periods {
		v, err := st.Usage(context.Background(), p, period[0], period[1])
		require.NoError(t, err)
		totals, byModel := s.want(period[0], period[1])
		name := fmt.Sprintf("[%s, %s)", period[0].Format(time.RFC3339Nano), period[1].Format(time.RFC3339Nano))
		require.Equal(t, totals.Requests, v.Totals.Requests, name)
		require.Equal(t, totals.TotalRungs, v.Totals.TotalRungs, name)
		require.Equal(t, totals.InputRungs, v.Totals.InputRungs, name)
		require.Len(t, v.ByModel, len(byModel), name)
		for _, m := range v.ByModel {
			require.Equal(t, byModel[m.Model], m, name)
		}
	}
}

// hoursMatchMinutes asserts that each hour's sums are those of its minutes'
// folded rows, and that there are sums.
func hoursMatchMinutes(t *testing.T, st *store.Store) {
	t.Helper()
	var hours, off int
	err := st.Pool().QueryRow(context.Background(), `
		SELECT (SELECT count(*) FROM usage_hours), count(*) FILTER (WHERE m.requests IS DISTINCT FROM h.requests
		           OR m.input_rungs IS DISTINCT FROM h.input_rungs OR m.total_rungs IS DISTINCT FROM h.total_rungs)
		  FROM (SELECT account_id, date_bin('1 hour', minute, '2000-01-01 00:00Z') AS hour, model, sum(requests) AS requests,
		               sum(input_rungs) AS input_rungs, sum(total_rungs) AS total_rungs
		          FROM usage_minutes WHERE backend = 0 GROUP BY 1, 2, 3) m
		  FULL JOIN usage_hours h USING (account_id, hour, model)`).Scan(&hours, &off)
	require.NoError(t, err)
	require.Positive(t, hours)
	require.Zero(t, off, "hours whose sums are not their folded minutes'")
}

// minuteRows counts usage_minutes rows of each account, minute and model.
func minuteRows(t *testing.T, st *store.Store) (rows, minutes int) {
	t.Helper()
	err := st.Pool().QueryRow(context.Background(),
		`SELECT count(*), count(DISTINCT (account_id, minute, model)) FROM usage_minutes`).Scan(&rows, &minutes)
	require.NoError(t, err)
	return rows, minutes
}

// TestUsageViewAddsMinutesAndTheirEnds: the usage view sums the hours whole
// inside its period from the sums by hour (with their minutes not yet folded
// into them), the other minutes whole inside it from the sums by minute, and
// the parts of a minute at either end from the requests; whatever the
// period's bounds (on an hour or a minute, inside one, empty), and before and
// after the sums of each server process are folded into one, it equals the
// sum of what was settled.
func TestUsageViewAddsMinutesAndTheirEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	base := time.Now().UTC().Truncate(time.Minute).Add(-time.Hour)

	// Records on minutes' bounds and within them, of two models, settled in
	// groups over two connections (two server processes), and another
	// account's in the same minutes.
	rng := rand.New(rand.NewPCG(1, 2))
	var mine settled
	for i := range 120 {
		offset := time.Duration(rng.Int64N(int64(5 * time.Minute))).Truncate(time.Microsecond)
		if i%10 == 0 {
			offset = offset.Truncate(time.Minute)
		}
		model := gateway.ModelInstant
		if i%3 == 0 {
			model = gateway.ModelReasoning
		}
		mine = append(mine, at(p, base.Add(offset), model, int64(2+i)))
	}
	for i := range 40 { // and over three hours and more around them
		mine = append(mine, at(p, base.Add(-150*time.Minute+time.Duration(i)*307*time.Second), gateway.ModelElements, int64(7+i)))
	}
	conns := []*store.Store{b.store}
	single, _ := singleConnection(t, b.store)
	conns = append(conns, single)
	for i := 0; i < len(mine); i += 7 {
		group := []store.Settlement{{Record: at(other, base.Add(time.Duration(i)*time.Second), gateway.ModelInstant, 1000)}}
		for _, r := range mine[i:min(i+7, len(mine))] {
			group = append(group, store.Settlement{Record: r})
		}
		require.NoError(t, conns[i%2].SettleRequests(b.ctx, group))
	}

	periods := [][2]time.Time{
		{base, base.Add(5 * time.Minute)},
		{base.Add(-time.Hour), base.Add(time.Hour)},
		{base.Add(time.Minute), base.Add(3 * time.Minute)},
		{base.Add(90 * time.Second), base.Add(150 * time.Second)},
		{base.Add(61 * time.Second), base.Add(119 * time.Second)},
		{base.Add(time.Minute), base.Add(time.Minute)},
		{base.Add(3 * time.Minute), base.Add(2 * time.Minute)},
		{gateway.UTCDay(base), gateway.UTCDay(base).Add(24 * time.Hour)},
		{base.Truncate(time.Hour).Add(-time.Hour), base.Truncate(time.Hour).Add(time.Hour)},
		{base.Truncate(time.Hour).Add(-time.Hour + time.Second), base.Truncate(time.Hour).Add(time.Hour - time.Second)},
		{base.Truncate(time.Hour).Add(-2 * time.Hour), base.Truncate(time.Hour).Add(-time.Hour)},
	}
	for range 40 {
		start := base.Add(time.Duration(rng.Int64N(int64(6 * time.Minute))))
		periods = append(periods, [2]time.Time{start, start.Add(time.Duration(rng.Int64N(int64(4 * time.Minute))))})
	}
	for range 40 {
		start := base.Add(-3*time.Hour + time.Duration(rng.Int64N(int64(3*time.Hour))))
		periods = append(periods, [2]time.Time{start, start.Add(time.Duration(rng.Int64N(int64(3 * time.Hour))))})
	}
	for _, r := range mine[:10] {
		periods = append(periods, [2]time.Time{r.CompletedAt, r.CompletedAt.Add(time.Minute)}, [2]time.Time{base, r.CompletedAt})
	}
	mine.check(t, b.store, p, periods)
	rows, minutes := minuteRows(t, b.store)
	require.Greater(t, rows, minutes, "each connection adds to rows of its own")

	folded, err := b.store.FoldUsageMinutes(b.ctx, time.Now().Add(time.Hour), 1000)
	require.NoError(t, err)
	require.Equal(t, int64(rows), folded)
	rows, minutes = minuteRows(t, b.store)
	require.Equal(t, minutes, rows, "one row a minute and model once folded")
	hoursMatchMinutes(t, b.store)
	mine.check(t, b.store, p, periods)

	// A request settled late, in a minute folded already, adds a row of its
	// own, folded at the next run.
	late := at(p, base.Add(2*time.Minute+time.Second), gateway.ModelInstant, 50)
	mine = append(mine, late)
	require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: late}}))
	mine.check(t, b.store, p, periods)
	folded, err = b.store.FoldUsageMinutes(b.ctx, time.Now().Add(time.Hour), 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1), folded)
	hoursMatchMinutes(t, b.store)
	mine.check(t, b.store, p, periods)

	// A request settled again (its reply lost) is not counted twice.
	require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: late}}))
	mine.check(t, b.store, p, periods)
}

// TestUsageMinutesStayExactWhileFolding: settlements on several connections
// and folds of every minute, the current one too, running at once leave the
// usage view equal to what was settled.
func TestUsageMinutesStayExactWhileFolding(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	base := time.Now().UTC().Truncate(time.Minute).Add(-10 * time.Minute)

	var mu sync.Mutex
	var all settled
	var wg sync.WaitGroup
	for w := range 4 {
		st, _ := singleConnection(t, b.store)
		wg.Go(func() {
			for i := range 40 {
				group := []store.Settlement{
					{Record: at(p, base.Add(time.Duration(i%3)*time.Minute), gateway.ModelInstant, int64(w+i+2))},
					{Record: at(p, base.Add(time.Duration(w)*time.Second), gateway.ModelElements, 3)},
				}
				if err := st.SettleRequests(b.ctx, group); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				all = append(all, group[0].Record, group[1].Record)
				mu.Unlock()
			}
		})
	}
	done := make(chan struct{})
	var folds sync.WaitGroup
	folds.Go(func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := b.store.FoldUsageMinutes(b.ctx, time.Now().Add(time.Hour), 7); err != nil {
				t.Error(err)
				return
			}
		}
	})
	wg.Wait()
	close(done)
	folds.Wait()
	require.Len(t, all, 4*40*2)
	periods := [][2]time.Time{{base, base.Add(3 * time.Minute)}, {base.Add(-time.Hour), base.Add(time.Hour)}, {base.Add(30 * time.Second), base.Add(90 * time.Second)}}
	all.check(t, b.store, p, periods)
	_, err := b.store.FoldUsageMinutes(b.ctx, time.Now().Add(time.Hour), 1000)
	require.NoError(t, err)
	rows, minutes := minuteRows(t, b.store)
	require.Equal(t, minutes, rows)
	hoursMatchMinutes(t, b.store)
	all.check(t, b.store, p, periods)
}

// TestMigrationSumsExistingUsage: migration 00039 sums the requests settled
// before it by minute and by hour, so the usage view reads the same before
// and after.
func TestMigrationSumsExistingUsage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, provider := migratedTo(t, 38)

	b := &testBundle{ctx: ctx, store: store.New(pool)}
	p := keyAt00010(t, pool)
	base := time.Now().UTC().Truncate(time.Minute).Add(-time.Hour)
	var before settled
	for i := range 30 {
		r := at(p, base.Add(time.Duration(i)*17*time.Second), gateway.ModelInstant, int64(i+2))
		before = append(before, r)
		// Stored with the columns a schema at 00038 has, as its release
		// stored them (today's settlement may name objects added since).
		b.insertRequest(t, pool, r)
	}

	_, err := provider.Up(ctx)
	require.NoError(t, err)
	var backend0 int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_minutes WHERE backend = 0`).Scan(&backend0))
	require.Equal(t, 9, backend0, "30 requests 17 s apart fall in 9 minutes")
	hoursMatchMinutes(t, b.store)
	before.check(t, b.store, p, [][2]time.Time{{base, base.Add(time.Hour)}, {base.Add(time.Minute), base.Add(5 * time.Minute)}, {base.Add(10 * time.Second), base.Add(7*time.Minute + 10*time.Second)}})
}

// BenchmarkUsageView: the usage view of an account's requests, spread over
// a day or a year: the whole span, and a period that begins and ends inside a
// minute (its ends read from the requests), as the span holds more requests.
// The sums by minute are folded first, as maintenance keeps them.
func BenchmarkUsageView(b *testing.B) {
	for _, c := range []struct {
		name     string
		requests int
		span     time.Duration
	}{
		{"day/requests=10000", 10_000, 24 * time.Hour},
		{"day/requests=1000000", 1_000_000, 24 * time.Hour},
		{"year/requests=1000000", 1_000_000, 365 * 24 * time.Hour},
	} {
		b.Run(c.name, func(b *testing.B) {
			ctx := context.Background()
			bundle := &testBundle{ctx: ctx, store: store.New(testdb.New(b))}
			_, p := bundle.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
			from := gateway.UTCDay(time.Now()).Add(-c.span)
			_, err := bundle.store.Pool().Exec(ctx, `
				INSERT INTO requests (id, account_id, project_id, api_key_id, model, entry_point, status,
				                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
				SELECT gen_random_uuid(), $1, $2, $3, 'instant', 'responses', 'completed', 10, 20, 10, 20, 30, t, t
				  FROM (SELECT $4::timestamptz + i * ($5::interval / $6) AS t FROM generate_series(0, $6 - 1) i) g`,
				p.AccountID, p.ProjectID, p.KeyID, from, c.span, c.requests)
			require.NoError(b, err)
			for {
				n, err := bundle.store.FoldUsageMinutes(ctx, time.Now(), 100_000)
				require.NoError(b, err)
				if n == 0 {
					break
				}
			}
			_, err = bundle.store.Pool().Exec(ctx, `ANALYZE`)
			require.NoError(b, err)
			for name, period := range map[string][2]time.Time{
				"whole":  {from, from.Add(c.span)},
				"inside": {from.Add(30 * time.Second), from.Add(c.span - 30*time.Second)},
			} {
				b.Run(name, func(b *testing.B) {
					for b.Loop() {
						v, err := bundle.store.Usage(ctx, p, period[0], period[1])
						if err != nil || v.Totals.Requests == 0 {
							b.Fatalf("%d requests: %v", v.Totals.Requests, err)
						}
					}
				})
			}
		})
	}
}
