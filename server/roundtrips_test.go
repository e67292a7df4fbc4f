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

// TestHotPathRoundTrips proves a non-streaming response costs at most two
// database round trips: authenticating the key and committing the usage.
func TestHotPathRoundTrips(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testdb.URL(t))
	require.NoError(t, err)
	counter := &queryCounter{}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool)

	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}, "0.5")
	require.NoError(t, err)
	srv, err := server.New(server.Config{
		Auth: st,
		Inference: &inference.Service{
			Provider: &scripted{}, Models: upstream.DefaultModelMap(), Estimator: &metering.Estimator{Tokenizer: tok, RateCard: rc},
			Recorder: st, EvidenceRetention: time.Hour,
		},
		Evidence: st,
	})
	require.NoError(t, err)
	b := &testBundle{t: t, store: st}
	key := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.http = newHTTPServer(t, srv)

	for range 5 {
		before := counter.n.Load()
		r := b.post("/api/v1/responses", key, map[string]any{"prompt": "count my queries", "web_search": true})
		require.Equal(t, http.StatusOK, r.status)
		require.LessOrEqual(t, counter.n.Load()-before, int64(2))
	}
}
