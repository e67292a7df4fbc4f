package server_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
)

// failingLedger is the real ledger whose settlements fail as told first:
// fault injection in front of a real database.
type failingLedger struct {
	inference.Ledger
	mu    sync.Mutex
	fails int   // settlements still to fail
	err   error // how they fail
}

func (l *failingLedger) Settle(ctx context.Context, r gateway.UsageRecord) error {
	l.mu.Lock()
	if l.fails > 0 {
		l.fails--
		l.mu.Unlock()
		return l.err
	}
	l.mu.Unlock()
	return l.Ledger.Settle(ctx, r)
}

func withLedger(l *failingLedger) options {
	return options{server: func(c *server.Config) {
		l.Ledger = c.Inference.Ledger
		c.Inference.Ledger, c.Inference.Unavailable, c.Unavailable = l, store.Transient, store.Transient
		c.Inference.SettleWindow = 2 * time.Second
	}}
}

var dbAway = &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}

// TestSettlementRetriesWhileTheDatabaseRestarts: a settlement that meets a
// restarting database is retried, and the reply is the normal one, billed once.
func TestSettlementRetriesWhileTheDatabaseRestarts(t *testing.T) {
	t.Parallel()
	l := &failingLedger{fails: 2, err: dbAway}
	b := setupWith(t, withLedger(l))
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusOK, r.status)
	v := b.usage(t, b.key)
	require.Equal(t, int64(1), v.Totals.Requests)
	require.Equal(t, int64(0), v.Budget.ReservedRungs)
}

// TestFailedSettlementBillsNothingAndReleases: a settlement that cannot be
// stored bills nothing, holds no reservation, and says so: 503 while the
// database is away, 500 when it refused; in a stream, response.error then
// response.completed with zero usage.
func TestFailedSettlementBillsNothingAndReleases(t *testing.T) {
	t.Parallel()
	l := &failingLedger{fails: 1000, err: dbAway}
	b := setupWith(t, withLedger(l))
	b.setLimits(t, nil, ptr(int64(1_000_000)))
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, gateway.EServiceUnavailable, r.errorCode(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))

	l.mu.Lock()
	l.err = errors.New("refused")
	l.mu.Unlock()
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Contains(t, r.message(t), "nothing was billed")

	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "hi"})
	require.GreaterOrEqual(t, len(s.Events), 3)
	last, prev := s.Events[len(s.Events)-1], s.Events[len(s.Events)-2]
	require.Equal(t, "response.error", prev.Name)
	require.Equal(t, "response.completed", last.Name)
	var final api.StreamChunk
	last.Decode(t, &final)
	require.Equal(t, api.RungUsage{}, *final.Usage, "the usage sent is what was billed: nothing")

	v := b.usage(t, b.key)
	require.Zero(t, v.Totals.Requests)
	require.Zero(t, v.Budget.ReservedRungs, "every reservation released")
}

// TestAbortEndsCallsInFlight: at the end of the shutdown grace, a stream in
// flight ends with response.error then response.completed carrying the usage
// billed, and a JSON request with INFERENCE_BUSY (D12).
func TestAbortEndsCallsInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.upstream.configure(func(s *scripted) { s.hang = true })
	streamed := make(chan apitest.Stream, 1)
	go func() {
		_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "long"})
		streamed <- s
	}()
	answered := make(chan reply, 1)
	go func() { answered <- b.post("/api/v1/responses", b.key, map[string]any{"prompt": "json"}) }()
	require.Eventually(t, func() bool { return b.upstream.callCount() == 2 }, 5*time.Second, 10*time.Millisecond)
	time.Sleep(50 * time.Millisecond) // the stream's first piece is out
	b.server.Abort()

	r := <-answered
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, gateway.EInferenceBusy, r.errorCode(t))
	require.Contains(t, r.message(t), "shutting down")

	s := <-streamed
	require.Len(t, s.Events, 3)
	require.Equal(t, "response.error", s.Events[1].Name)
	var env api.ErrorEnvelope
	s.Events[1].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)
	var final api.StreamChunk
	s.Events[2].Decode(t, &final)
	require.Positive(t, final.Usage.TotalRungs)
	v := b.usage(t, b.key)
	require.Equal(t, final.Usage.TotalRungs, v.Totals.TotalRungs, "billed is what the client was sent")
	require.Equal(t, int64(1), v.Totals.Requests, "the JSON request was billed nothing")
}
