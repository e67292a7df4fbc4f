package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
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
// restarting database is retried, within the window set or, unset, the
// default one, and the reply is the normal one, billed once.
func TestSettlementRetriesWhileTheDatabaseRestarts(t *testing.T) {
	t.Parallel()
	for _, window := range []time.Duration{2 * time.Second, 0} {
		l := &failingLedger{fails: 2, err: dbAway}
		o := withLedger(l)
		configure := o.server
		o.server = func(c *server.Config) {
			configure(c)
			c.Inference.SettleWindow = window
		}
		b := setupWith(t, o)
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		require.Equal(t, http.StatusOK, r.status, "window %s", window)
		v := b.usage(t, b.key)
		require.Equal(t, int64(1), v.Totals.Requests)
		require.Equal(t, int64(0), v.Budget.ReservedRungs)
	}
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

	// Nor does the replica hold their estimates: under a ceiling that holds
	// one, the next request runs.
	l.mu.Lock()
	l.fails = 0
	l.mu.Unlock()
	b.setLimits(t, ptr(int64(50_000)), ptr(int64(1_000_000)))
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
}

// unconfirmedLedger is the real ledger whose settlements do not learn their
// outcome: the first is sent (and stored when stored is set) and its reply
// lost; the ones after it find the database away until back is set. With
// lost set, every settlement's reply is lost and none is stored.
type unconfirmedLedger struct {
	inference.Ledger
	stored bool
	lost   bool
	sent   atomic.Int32
	back   atomic.Bool
}

// withUnconfirmed serves with l in front of the real ledger, logging to logs
// and counting in m, settlements retried for window; infer, when set, gets the
// inference service.
func withUnconfirmed(l *unconfirmedLedger, logs *syncbuf.Buffer, m *metrics.Metrics, window time.Duration, infer **inference.Service) options {
	return options{logs: logs, server: func(c *server.Config) {
		l.Ledger = c.Inference.Ledger
		c.Inference.Ledger, c.Inference.Unavailable, c.Unavailable = l, store.Transient, store.Transient
		c.Inference.MayHaveCommitted = store.MayHaveCommitted
		c.Inference.Logger = c.Logger
		c.Inference.Metrics = m
		c.Inference.SettleWindow = window
		if infer != nil {
			*infer = c.Inference
		}
	}}
}

func (l *unconfirmedLedger) Settle(ctx context.Context, r gateway.UsageRecord) error {
	if l.lost {
		return fmt.Errorf("error settling requests: %w", io.ErrUnexpectedEOF)
	}
	if l.sent.Add(1) > 1 {
		if l.back.Load() {
			return l.Ledger.Settle(ctx, r)
		}
		return dbAway
	}
	if l.stored {
		if err := l.Ledger.Settle(ctx, r); err != nil {
			return err
		}
	}
	return fmt.Errorf("error settling requests: %w", io.ErrUnexpectedEOF)
}

// TestUnconfirmedSettlementIsSentWithItsUsage: a settlement whose reply was
// lost may be stored, and the database stays away past the settlement
// window. The reply is the normal one with its usage, JSON or streamed, never
// "nothing was billed": the database holds that usage or none, never usage
// the client was not sent (D12). The request is logged, and once the
// database is back the settlement sent again leaves exactly that usage
// billed, once.
func TestUnconfirmedSettlementIsSentWithItsUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		stored bool
		stream bool
	}{
		{"stored, JSON", true, false},
		{"not stored, JSON", false, false},
		{"stored, stream", true, true},
		{"not stored, stream", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l := &unconfirmedLedger{stored: tc.stored}
			logs := &syncbuf.Buffer{}
			m := metrics.New()
			b := setupWith(t, withUnconfirmed(l, logs, m, time.Second, nil))
			var sent int64 // the total rungs the client was sent
			if tc.stream {
				_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "hi"})
				require.GreaterOrEqual(t, len(s.Events), 2)
				for _, e := range s.Events {
					require.NotEqual(t, "response.error", e.Name)
				}
				last := s.Events[len(s.Events)-1]
				require.Equal(t, "response.completed", last.Name)
				var final api.StreamChunk
				last.Decode(t, &final)
				sent = final.Usage.TotalRungs
			} else {
				r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
				require.Equal(t, http.StatusOK, r.status, string(r.body))
				var res api.Response
				require.NoError(t, json.Unmarshal(r.body, &res))
				sent = res.Usage.TotalRungs
			}
			require.Positive(t, sent, "the usage is sent")
			require.GreaterOrEqual(t, l.sent.Load(), int32(2), "the settlement was sent again while the window lasted")

			v := b.usage(t, b.key)
			if tc.stored {
				require.Equal(t, int64(1), v.Totals.Requests)
				require.Equal(t, sent, v.Totals.TotalRungs, "billed is what the client was sent")
			} else {
				require.Zero(t, v.Totals.Requests, "not stored yet: billed less than sent, never more")
			}
			require.Contains(t, logs.String(), "which may not be stored yet")
			require.Contains(t, metricstest.Scrape(m), `gateway_settlements_unconfirmed_total{outcome="sent"} 1`)

			l.back.Store(true)
			require.Eventually(t, func() bool { return strings.Contains(logs.String(), "a settlement sent with its usage is stored") },
				10*time.Second, 20*time.Millisecond)
			v = b.usage(t, b.key)
			require.Equal(t, int64(1), v.Totals.Requests, "stored once")
			require.Equal(t, sent, v.Totals.TotalRungs, "billed is what the client was sent")
			require.Zero(t, v.Budget.ReservedRungs)
			samples := metricstest.Samples(t, m)
			require.Equal(t, float64(1), samples[`gateway_settlements_unconfirmed_total{outcome="stored"}`])
			retried, late := samples[`gateway_database_retries_total{work="settlement"}`], samples[`gateway_database_retries_total{work="late_settlement"}`]
			require.Positive(t, retried, "sent again within the window")
			require.Positive(t, late, "sent again after the reply")
			require.Equal(t, float64(l.sent.Load()-1), retried+late, "each send after the first is counted, once")
		})
	}
}

// TestAnUnconfirmedSettlementCountsItsCost: a request sent with its usage
// while its settlement's outcome is unknown holds, of the day, what it cost,
// as a settled one does, not its estimate: under a ceiling that holds one
// estimate beside that cost, the next request runs.
func TestAnUnconfirmedSettlementCountsItsCost(t *testing.T) {
	t.Parallel()
	var infer *inference.Service
	b := setupWith(t, withUnconfirmed(&unconfirmedLedger{lost: true}, &syncbuf.Buffer{}, metrics.New(), 100*time.Millisecond, &infer))
	// An instant request is estimated at its prompt tokens plus 32000 output rungs.
	b.setLimits(t, ptr(int64(50_000)), nil)
	for i := range 2 {
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		require.Equal(t, http.StatusOK, r.status, "request %d: %s", i, r.body)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the settlements sent again are given up on
	require.ErrorIs(t, infer.WaitLateSettlements(ctx), context.Canceled)
}

// TestEachUnconfirmedSettlementIsLogged: the lines that name a request whose
// usage may be missing are never sampled, as the other errors are
// (logsample): more of them than a window's burst are all written, when the
// settlement is sent with its usage and when it is given up on.
func TestEachUnconfirmedSettlementIsLogged(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	var infer *inference.Service
	b := setupWith(t, withUnconfirmed(&unconfirmedLedger{lost: true}, logs, metrics.New(), 100*time.Millisecond, &infer))
	n := logsample.Burst + 2
	statuses := make(chan int, n)
	for range n {
		go func() { statuses <- b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"}).status }()
	}
	for range n {
		require.Equal(t, http.StatusOK, <-statuses)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, infer.WaitLateSettlements(ctx), context.DeadlineExceeded)
	require.Equal(t, n, strings.Count(logs.String(), "which may not be stored yet"))
	require.Equal(t, n, strings.Count(logs.String(), "its usage may be missing"))
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

// TestShutdownWaitsForLateSettlements: a settlement sent again after its reply
// went out (the database away) is waited for at shutdown. When the database
// comes back within the wait, it is stored before the wait ends; when it does
// not, it is given up on and logged with its usage; either way, a reply lost
// from then on is not sent again but logged alike.
func TestShutdownWaitsForLateSettlements(t *testing.T) {
	t.Parallel()
	setup := func(t *testing.T) (*testBundle, *unconfirmedLedger, *inference.Service, *syncbuf.Buffer, *metrics.Metrics) {
		l := &unconfirmedLedger{}
		logs := &syncbuf.Buffer{}
		m := metrics.New()
		var infer *inference.Service
		b := setupWith(t, withUnconfirmed(l, logs, m, 300*time.Millisecond, &infer))
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		require.Contains(t, metricstest.Scrape(m), `gateway_settlements_unconfirmed_total{outcome="sent"} 1`)
		return b, l, infer, logs, m
	}

	t.Run("stored within the wait", func(t *testing.T) {
		t.Parallel()
		b, l, infer, _, m := setup(t)
		waited := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			waited <- infer.WaitLateSettlements(ctx)
		}()
		time.Sleep(200 * time.Millisecond)
		select {
		case err := <-waited:
			t.Fatalf("the wait ended with the settlement unconfirmed: %v", err)
		default:
		}
		l.back.Store(true)
		require.NoError(t, <-waited)
		require.Contains(t, metricstest.Scrape(m), `gateway_settlements_unconfirmed_total{outcome="stored"} 1`)
		require.Equal(t, int64(1), b.usage(t, b.key).Totals.Requests, "stored once, before the wait ended")

		l.back.Store(false)
		l.sent.Store(0) // the next settlement's reply is lost, and the database away
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		require.Contains(t, metricstest.Scrape(m), `gateway_settlements_unconfirmed_total{outcome="missing"} 1`,
			"not sent again once the wait is over")
	})

	t.Run("given up at the end of the wait", func(t *testing.T) {
		t.Parallel()
		b, l, infer, logs, m := setup(t)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, infer.WaitLateSettlements(ctx), context.DeadlineExceeded)
		require.Contains(t, metricstest.Scrape(m), `gateway_settlements_unconfirmed_total{outcome="missing"} 1`)
		require.Contains(t, logs.String(), "its usage may be missing")
		require.Contains(t, logs.String(), `"total_rungs"`)

		require.GreaterOrEqual(t, l.sent.Load(), int32(2), "sent again before the wait gave up")
		l.sent.Store(0) // the next settlement's reply is lost too
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		scrape := metricstest.Scrape(m)
		require.Contains(t, scrape, `gateway_settlements_unconfirmed_total{outcome="sent"} 2`)
		require.Contains(t, scrape, `gateway_settlements_unconfirmed_total{outcome="missing"} 2`, "not sent again once the wait is over")
		require.Contains(t, scrape, `gateway_settlements_unconfirmed_total{outcome="stored"} 0`)
		require.Contains(t, logs.String(), "no longer sends settlements again")
	})
}
