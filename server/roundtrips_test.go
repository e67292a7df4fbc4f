package server_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

// queryCounter counts the statements sent to PostgreSQL.
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestHotPathRoundTrips proves what a response costs in database round trips:
// one to authenticate the key and count it against the rate limit, one to admit
// it (daily charge and budget reservation), one to settle it (usage, evidence,
// reconciliation) — admission and settlement together two.
func TestHotPathRoundTrips(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testdb.URL(t))
	require.NoError(t, err)
	counter := &queryCounter{}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool, store.Options{})

	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}, "0.5")
	require.NoError(t, err)
	srv, err := server.New(server.Config{
		Auth: st,
		Inference: &inference.Service{
			Provider: &scripted{}, Models: upstream.DefaultModelMap(), Estimator: &metering.Estimator{Tokenizer: tok, RateCard: rc},
			Ledger: st, EvidenceRetention: time.Hour,
		},
		Evidence: st,
		Usage:    st,
	})
	require.NoError(t, err)
	b := &testBundle{t: t, store: st}
	key := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.http = newHTTPServer(t, srv)

	for _, stream := range []bool{false, true, false, true} {
		before := counter.n.Load()
		r := b.post("/api/v1/responses", key, map[string]any{"prompt": "count my queries", "web_search": true, "stream": stream})
		require.Equal(t, http.StatusOK, r.status)
		require.Equal(t, int64(3), counter.n.Load()-before, "stream=%v", stream)
	}
	// Authentication alone (with the rate count) is one statement.
	before := counter.n.Load()
	r := b.do(http.MethodGet, "/api/v1/sources/01900000-0000-7000-8000-000000000000", key, "", nil)
	require.Equal(t, http.StatusNotFound, r.status)
	require.Equal(t, int64(2), counter.n.Load()-before, "authenticate, then the evidence lookup")
}
