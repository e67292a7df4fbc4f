package routing

import (
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/upstream/sim"
)

// TestTheRouterReportsTheRoutesInUse: a router's circuits are reported
// closed from the start; a change of a circuit in use, and a replacement of
// the routes, wake whoever waits for a change (Wait), and a circuit of
// routes replaced, still used by calls that started on them, reports
// nothing; a target routed no more, though its provider still is, leaves
// the metrics.
func TestTheRouterReportsTheRoutesInUse(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	routes := func(upstreamModel string) Config {
		return Config{
			Routes:  map[gateway.Model]Route{gateway.ModelInstant: {Targets: []Target{{Provider: "p", UpstreamModel: upstreamModel, Client: &sim.Provider{}}}}},
			Circuit: CircuitConfig{Failures: 1, Cooldown: time.Hour},
		}
	}
	cfg := routes("m")
	cfg.Metrics = m
	r, err := New(cfg)
	require.NoError(t, err)
	state := func(upstreamModel string, s int) string {
		return `gateway_upstream_circuit_state{provider="p",upstream_model="` + upstreamModel + `"} ` + strconv.Itoa(s)
	}
	require.Contains(t, metricstest.Scrape(m), state("m", stateClosed))
	// waiter is what a Wait starting now waits on.
	waiter := func() <-chan struct{} {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.changed
	}
	open := func(tb *table) { tb.targets[0].circuit.failed(time.Now(), 0, uuid.Nil, false) }

	w := waiter()
	open(r.table.Load())
	require.Contains(t, metricstest.Scrape(m), state("m", stateOpen))
	require.True(t, closed(w), "a circuit that opened wakes Wait")

	w = waiter()
	require.NoError(t, r.Replace(routes("m")))
	require.True(t, closed(w), "new routes wake Wait")
	require.Contains(t, metricstest.Scrape(m), state("m", stateClosed))

	replaced := r.table.Load()
	require.NoError(t, r.Replace(routes("m")))
	w = waiter()
	open(replaced)
	require.False(t, closed(w), "a circuit of replaced routes wakes no one")
	require.Contains(t, metricstest.Scrape(m), state("m", stateClosed), "and reports nothing")

	require.NoError(t, r.Replace(routes("m2")))
	scrape := metricstest.Scrape(m)
	require.Contains(t, scrape, state("m2", stateClosed))
	require.NotContains(t, scrape, `upstream_model="m"`)
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
