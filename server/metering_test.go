package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

func (b *testBundle) usage(t *testing.T, key string) api.UsageView {
	t.Helper()
	r := b.do(http.MethodGet, "/api/v1/usage", key, "", nil)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	var v api.UsageView
	require.NoError(t, json.Unmarshal(r.body, &v))
	return v
}

// setLimits changes acme's limits and waits until the replica has heard of
// the change, as every replica does within moments (a test that asked at once
// would race the notification): a marker sent after the change arrives after
// it.
func (b *testBundle) setLimits(t testing.TB, daily, budget *int64) {
	t.Helper()
	b.waitListening(t)
	require.NoError(t, b.store.SetLimits(context.Background(), store.SetLimitsParams{Account: "acme", DailyRungs: daily, Project: "default", BudgetRungs: budget}))
	marker := uuid.NewString()
	_, err := b.store.Pool().Exec(context.Background(), "SELECT pg_notify('gateway_principals', $1)", marker)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return b.heard(marker) }, 10*time.Second, time.Millisecond, "the change is announced")
}

func TestRateLimitHeadersAndRefusal(t *testing.T) {
	t.Parallel()
	// A fixed clock keeps every request in one rate window.
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	b := setupWith(t, options{rates: ratelimit.Config{Clock: func() time.Time { return at }}})
	free := b.newKey("freeco", gateway.TierFree, gateway.ScopeInference, gateway.ScopeUsage)
	r := b.post("/api/v1/responses", free, map[string]any{"prompt": "p"})
	require.Equal(t, "60", r.header.Get("x-ratelimit-limit"), "the free tier's default")
	require.Equal(t, "59", r.header.Get("x-ratelimit-remaining"))

	r = b.do(http.MethodGet, "/api/v1/usage", b.key, "", nil)
	require.Equal(t, "600", r.header.Get("x-ratelimit-limit"), "the developer tier's default")
	r = b.do(http.MethodGet, "/api/v1/sources/01900000-0000-7000-8000-000000000000", b.key, "", nil)
	require.Equal(t, http.StatusNotFound, r.status)
	require.NotEmpty(t, r.header.Get("x-ratelimit-remaining"), "error replies carry the headers too")

	// Use up the free key's minute.
	for range 59 {
		b.do(http.MethodGet, "/api/v1/usage", free, "", nil)
	}
	r = b.do(http.MethodGet, "/api/v1/usage", free, "", nil)
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, gateway.ERateLimited, r.errorCode(t))
	require.Equal(t, "0", r.header.Get("x-ratelimit-remaining"))
	// The minute's 60 weigh 59, and so admit one, a second into the next.
	require.Equal(t, "31", r.header.Get("Retry-After"), "when the sliding window admits one, not when the minute ends")

	r = b.post("/api/v1/responses", free, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	_, s := b.streamAs(free, "/api/v1/responses", map[string]any{"prompt": "p"})
	require.Equal(t, []string{"response.error"}, []string{s.Events[0].Name})
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, api.ErrorCode("RATE_LIMITED"), env.Error.Code, "a stream reports the rate limit in-band")
	require.Contains(t, env.Error.Message, "retry in 31 s", "with the wait, which it has no header for")
}

func TestBudgetAndDailyCeiling(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// An instant request is estimated at its prompt tokens plus 32000 output rungs.
	b.setLimits(t, nil, ptr(int64(40000)))
	require.Equal(t, http.StatusOK, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"}).status)
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p", "model": "reasoning"})
	require.Equal(t, http.StatusPaymentRequired, r.status)
	require.Equal(t, gateway.EBudgetExceeded, r.errorCode(t))
	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p", "model": "reasoning"})
	require.Len(t, s.Events, 1)
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, api.ErrorCode("BUDGET_EXCEEDED"), env.Error.Code)
	// A smaller output ceiling fits.
	require.Equal(t, http.StatusOK, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p", "max_output_rungs": 100}).status)

	// An estimate larger than the whole ceiling: waiting cannot cure it (D11).
	b.setLimits(t, ptr(int64(100)), ptr(int64(1_000_000)))
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, gateway.ERateLimited, r.errorCode(t))
	require.Empty(t, r.header.Get("Retry-After"))
	require.Contains(t, r.message(t), "max_output_rungs", "the message says what to change")

	// One that does not fit beside a request running with its estimate
	// charged: retry shortly, as that one will be charged what it used.
	b.setLimits(t, ptr(int64(50_000)), ptr(int64(1_000_000)))
	b.upstream.configure(func(s *scripted) { s.hang = true })
	ctx, cancel := context.WithCancel(context.Background())
	running := async(func() int { return b.postBody(ctx, "/api/v1/responses", b.key, strings.NewReader(`{"prompt": "p"}`)) })
	defer func() { cancel(); <-running }()
	calls := b.upstream.callCount()
	require.Eventually(t, func() bool { return b.upstream.callCount() > calls }, 5*time.Second, time.Millisecond, "the first request runs")
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, "2", r.header.Get("Retry-After"))
	require.Contains(t, r.message(t), "requests still running")
	// The same beside it for the project's budget: 402, and retry shortly.
	b.setLimits(t, ptr(int64(10_000_000)), ptr(int64(50_000)))
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusPaymentRequired, r.status)
	require.Equal(t, "2", r.header.Get("Retry-After"))
	require.Contains(t, r.message(t), "requests still running")
}

// TestAdmissionRefusalsAreCounted: each refusal of a request by admission
// is counted by its reason: the key's rate, the account's daily ceiling,
// the project's budget.
func TestAdmissionRefusalsAreCounted(t *testing.T) {
	t.Parallel()
	// A fixed clock keeps every request in one rate window.
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	m := metrics.New()
	b := setupWith(t, options{rates: ratelimit.Config{Clock: func() time.Time { return at }}, server: func(c *server.Config) {
		c.Metrics, c.Inference.Metrics = m, m
	}})
	refusals := func() [3]float64 { // by the budget, the daily ceiling, the rate
		s := metricstest.Samples(t, m)
		return [3]float64{s[`gateway_admission_refusals_total{reason="budget"}`], s[`gateway_admission_refusals_total{reason="daily_ceiling"}`],
			s[`gateway_admission_refusals_total{reason="rate_limit"}`]}
	}
	b.setLimits(t, nil, ptr(int64(40000)))
	require.Equal(t, http.StatusPaymentRequired, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p", "model": "reasoning"}).status)
	require.Equal(t, [3]float64{1, 0, 0}, refusals())
	b.setLimits(t, ptr(int64(100)), nil)
	require.Equal(t, http.StatusTooManyRequests, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"}).status)
	require.Equal(t, [3]float64{1, 1, 0}, refusals())
	free := b.newKey("freeco", gateway.TierFree, gateway.ScopeInference, gateway.ScopeUsage)
	for range 60 {
		b.do(http.MethodGet, "/api/v1/usage", free, "", nil)
	}
	require.Equal(t, http.StatusTooManyRequests, b.post("/api/v1/responses", free, map[string]any{"prompt": "p"}).status)
	require.Equal(t, [3]float64{1, 1, 1}, refusals())
}

// TestInferenceIsMeasured: a call's rungs are counted by side as its reply
// says them, and its upstream run is timed by outcome, a failure counted
// by its kind.
func TestInferenceIsMeasured(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	b := setupWith(t, options{server: func(c *server.Config) { c.Metrics, c.Inference.Metrics = m, m }})
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "measured", "model": "reasoning"})
	require.Equal(t, http.StatusOK, r.status)
	var resp api.Response
	require.NoError(t, json.Unmarshal(r.body, &resp))
	b.upstream.fail(upstream.ErrUnavailable)
	b.post("/api/v1/responses", b.key, map[string]any{"prompt": "fails", "model": "reasoning"})

	series := metricstest.Samples(t, m)
	require.Equal(t, float64(resp.Usage.InputRungs), series[`gateway_rungs_total{entry_point="responses",model="reasoning",side="input"}`])
	require.Equal(t, float64(resp.Usage.OutputRungs), series[`gateway_rungs_total{entry_point="responses",model="reasoning",side="output"}`])
	require.Equal(t, 1.0, series[`gateway_upstream_request_duration_seconds_count{model="reasoning",outcome="ok"}`])
	require.Positive(t, series[`gateway_upstream_request_duration_seconds_sum{model="reasoning",outcome="ok"}`], "the run is timed")
	require.Equal(t, 1.0, series[`gateway_upstream_request_duration_seconds_count{model="reasoning",outcome="error"}`])
	require.Equal(t, 1.0, series[`gateway_upstream_errors_total{kind="unavailable"}`])
}

// TestACallThatFailsGivesBackItsCharge: a call whose upstream fails before
// any output, whole or streamed, or rejects it (its reply naming the
// provider's reason), gives its estimate back to the day at once: under a
// ceiling that holds one estimate, the next request runs.
func TestACallThatFailsGivesBackItsCharge(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// An instant request is estimated at its prompt tokens plus 32000 output rungs.
	b.setLimits(t, ptr(int64(50_000)), nil)
	b.upstream.fail(upstream.ErrUnavailable)
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, gateway.EInferenceBusy, r.errorCode(t))
	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
	require.Equal(t, []string{"response.error"}, []string{s.Events[0].Name})
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)

	b.upstream.fail(&upstream.RejectedError{Status: http.StatusBadRequest, Message: "the prompt breaks a rule of ours"})
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, gateway.EInferenceBusy, r.errorCode(t))
	require.Equal(t, "the inference provider rejected the request: the prompt breaks a rule of ours", r.message(t), "the provider's own words")

	b.upstream.fail(nil)
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusOK, r.status, "nothing is held for the calls that failed: %s", r.body)
}

func TestUsageViewEqualsWhatClientsReceived(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{keepalive: time.Minute})
	var want api.UsageTotals
	add := func(u api.RungUsage) {
		want.Requests++
		want.InputRungs += u.InputRungs
		want.OutputRungs += u.OutputRungs
		want.TotalRungs += u.TotalRungs
	}
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "json", "model": "reasoning"})
	var resp api.Response
	require.NoError(t, json.Unmarshal(r.body, &resp))
	add(api.RungUsage{InputRungs: resp.Usage.InputRungs, OutputRungs: resp.Usage.OutputRungs, TotalRungs: resp.Usage.TotalRungs})

	_, s := b.stream("/api/v1/chat", map[string]any{"prompt": "streamed"})
	var final api.StreamChunk
	s.Events[len(s.Events)-1].Decode(t, &final)
	add(*final.Usage)

	b.upstream.configure(func(s *scripted) { s.breakAfter = 1 })
	_, s = b.stream("/api/v1/responses", map[string]any{"prompt": "broken"})
	s.Events[len(s.Events)-1].Decode(t, &final)
	require.True(t, final.Done)
	add(*final.Usage)

	// A failure before any output bills nothing.
	b.upstream.configure(func(s *scripted) { s.breakAfter = 0; s.err = context.DeadlineExceeded })
	b.post("/api/v1/responses", b.key, map[string]any{"prompt": "fails"})

	v := b.usage(t, b.key)
	require.Equal(t, want, v.Totals)
	require.Len(t, v.ByModel, 2)
	require.Equal(t, v.Daily.ChargedRungs, want.TotalRungs, "every estimate was reconciled to its actual cost")
	require.Equal(t, v.Budget.SpentRungs, want.TotalRungs)
	require.Zero(t, v.Budget.ReservedRungs)
	require.Nil(t, v.Budget.CapRungs)
	require.Equal(t, int64(10_000_000)-want.TotalRungs, v.Daily.RemainingRungs)
	require.Equal(t, v.Period.Start.Add(24*time.Hour), v.Period.End, "the current UTC day by default")

	// A usage-only key reads the same view.
	usageOnly := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeUsage)
	require.Equal(t, want, b.usage(t, usageOnly).Totals)
}

// TestUsageViewBilledDisconnect: the output streamed before the client left
// is billed, the settlement retried while the database restarts though
// nobody waits for its reply.
func TestUsageViewBilledDisconnect(t *testing.T) {
	t.Parallel()
	for _, fails := range []int{0, 2} {
		o := withLedger(&failingLedger{fails: fails, err: dbAway})
		o.keepalive = time.Minute
		b := setupWith(t, o)
		b.upstream.configure(func(s *scripted) { s.hang = true })
		ctx, cancel := context.WithCancel(context.Background())
		resp := b.openStream(ctx, t, `{"prompt": "bye", "stream": true}`)
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "event: response.output_text.delta\n", line)
		cancel()
		resp.Body.Close()

		require.Eventually(t, func() bool {
			v := b.usage(t, b.key)
			return v.Totals.Requests == 1 && v.Totals.OutputRungs > 0 && v.Budget.ReservedRungs == 0 && v.Daily.ChargedRungs == v.Totals.TotalRungs
		}, 10*time.Second, 20*time.Millisecond, "the output before the disconnect is billed and reconciled (settlements failing first: %d)", fails)
	}
}

// TestAResponseSentAgainRunsAgain: the responses routes take no
// Idempotency-Key (the document's "Retrying a response"): a request sent
// again with the same key runs again and is billed again, and the usage view
// shows both.
func TestAResponseSentAgainRunsAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	header := http.Header{"Idempotency-Key": {"retry-1"}}
	var ids []uuid.UUID
	var want int64
	for range 2 {
		r := b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": "same"}, header)
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		require.Empty(t, r.header.Get("Idempotent-Replayed"))
		var resp api.Response
		require.NoError(t, json.Unmarshal(r.body, &resp))
		ids = append(ids, resp.RequestId)
		want += resp.Usage.TotalRungs
	}
	require.NotEqual(t, ids[0], ids[1], "each ran")
	require.Equal(t, 2, b.upstream.callCount(), "both reached the upstream")
	v := b.usage(t, b.key)
	require.Equal(t, int64(2), v.Totals.Requests)
	require.Equal(t, want, v.Totals.TotalRungs, "both billed")
}

func TestUsageViewParameters(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.do(http.MethodGet, "/api/v1/usage?start=2026-01-02T00:00:00Z&end=2026-01-01T00:00:00Z", b.key, "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	r = b.do(http.MethodGet, "/api/v1/usage?start=yesterday", b.key, "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	r = b.do(http.MethodGet, "/api/v1/usage?start=2026-01-01T00:00:00Z&end=2026-01-03T00:00:00Z", b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status)
	period := r.json(t)["period"].(map[string]any)
	require.Equal(t, "2026-01-01T00:00:00Z", period["start"])
	require.Equal(t, "2026-01-03T00:00:00Z", period["end"])

	// Times count to the microsecond, and the period named is the one
	// counted; one that is empty once cut is refused.
	r = b.do(http.MethodGet, "/api/v1/usage?start=2026-01-01T00:00:00.123456789Z&end=2026-01-01T01:00:01.000000999%2B01:00", b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status)
	period = r.json(t)["period"].(map[string]any)
	require.Equal(t, "2026-01-01T00:00:00.123456Z", period["start"])
	require.Equal(t, "2026-01-01T00:00:01Z", period["end"])
	r = b.do(http.MethodGet, "/api/v1/usage?start=2026-01-01T00:00:00.0000001Z&end=2026-01-01T00:00:00.0000009Z", b.key, "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)

	// A date alone is its midnight, UTC.
	r = b.do(http.MethodGet, "/api/v1/usage?start=2026-01-01&end=2026-01-03", b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status)
	period = r.json(t)["period"].(map[string]any)
	require.Equal(t, "2026-01-01T00:00:00Z", period["start"])
	require.Equal(t, "2026-01-03T00:00:00Z", period["end"])
}

// TestUsageViewPastTheRequestRetention: an end of the usage period older
// than the request retention must be on a whole hour (only the hour's sums
// are kept), else 400 INVALID_REQUEST saying so; newer ends may be anything.
func TestUsageViewPastTheRequestRetention(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: func(c *server.Config) { c.RequestRetention = 90 * 24 * time.Hour }})
	old := time.Now().UTC().Add(-100 * 24 * time.Hour).Truncate(time.Hour)
	query := func(start, end time.Time) string {
		return "/api/v1/usage?" + url.Values{"start": {start.Format(time.RFC3339Nano)}, "end": {end.Format(time.RFC3339Nano)}}.Encode()
	}
	r := b.do(http.MethodGet, query(old.Add(30*time.Minute), time.Now()), b.key, "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	require.Contains(t, string(r.body), "start: usage older than 90 days (the request retention) is kept by the hour")
	r = b.do(http.MethodGet, query(old, time.Now()), b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status, "whole hours")
	recent := time.Now().Add(-24 * time.Hour)
	r = b.do(http.MethodGet, query(recent, recent.Add(time.Second)), b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status, "inside the retention")
}
