package server_test

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/ratelimit"
)

// statementCounter counts the statements sent to PostgreSQL by the function
// they call.
type statementCounter struct {
	mu     sync.Mutex
	n      map[string]int
	others []string
}

// counted are the statements of the hot path.
var counted = []string{"lookupkey", "lease_rate", "grant_quota", "name: settlerequests", "fold_quota_leases", "renew_quota_leases"}

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	sql := strings.ToLower(d.SQL)
	for _, name := range counted {
		if strings.Contains(sql, name) {
			c.n[name]++
			return ctx
		}
	}
	c.n["other"]++
	c.others = append(c.others, d.SQL)
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *statementCounter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.n))
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

// TestHotPathRoundTrips proves what a response costs in database work in the
// steady state: nothing to authenticate, count the rate or admit it (the key
// is cached, the rate and the quota come from slices held in memory), and one
// statement, one commit, to settle it; a request without inference costs
// only its own statement.
func TestHotPathRoundTrips(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testdb.URL(t))
	require.NoError(t, err)
	counter := &statementCounter{n: map[string]int{}}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	// A fixed clock keeps every request in one rate window: a minute that
	// turns leases a slice of the next. No day's slice is granted ahead: the
	// test may run in the last minutes of one.
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	b := setupWith(t, options{pool: pool, dayAhead: -1, rates: ratelimit.Config{Limits: gateway.RateLimits{Free: 1 << 20, Developer: 1 << 20}, Clock: func() time.Time { return at }}})
	b.waitListening(t)

	// The first request fills the cache and leases the slices.
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "warm up"})
	require.Equal(t, http.StatusOK, r.status)

	before := counter.snapshot()
	const n = 40
	for i := range n {
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "count my queries", "web_search": true, "stream": i%2 == 1})
		require.Equal(t, http.StatusOK, r.status)
	}
	after := counter.snapshot()
	for _, name := range []string{"lookupkey", "lease_rate", "grant_quota"} {
		require.Zero(t, after[name]-before[name], "%s on the steady-state path", name)
	}
	require.Equal(t, n, after["name: settlerequests"]-before["name: settlerequests"], "one settlement statement per request sent one at a time")
	require.Zero(t, after["other"]-before["other"], "no other statement: %q", counter.others)

	before = counter.snapshot()
	r = b.do(http.MethodGet, "/api/v1/sources/01900000-0000-7000-8000-000000000000", b.key, "", nil)
	require.Equal(t, http.StatusNotFound, r.status)
	after = counter.snapshot()
	require.Equal(t, 1, after["other"]-before["other"], "only the evidence lookup")
	require.Zero(t, after["lookupkey"]-before["lookupkey"])
}
