// Package metrics holds the gateway's Prometheus metrics. A nil *Metrics is
// valid and records nothing, so every component takes one optionally.
package metrics

import (
	"net/http"
	httppprof "net/http/pprof"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/serverlog"
	"github.com/rungworks/gateway/upstream"
)

// Metrics are the gateway's instruments.
type Metrics struct {
	registry         *prometheus.Registry
	requests         *prometheus.CounterVec
	requestDuration  *prometheus.HistogramVec
	rungs            *prometheus.CounterVec
	upstreamDuration *prometheus.HistogramVec
	upstreamErrors   *prometheus.CounterVec
	openStreams      prometheus.Gauge
	streamErrors     *prometheus.CounterVec
	batchItems       *prometheus.CounterVec
	claimDuration    prometheus.Histogram
	commitDuration   *prometheus.HistogramVec
	commitSize       *prometheus.HistogramVec
	queueDepth       prometheus.Gauge
	leaseRescues     prometheus.Counter
	maintenanceRows  *prometheus.CounterVec
	maintenanceFails *prometheus.CounterVec
	refusals         *prometheus.CounterVec
	unconfirmed      *prometheus.CounterVec
	databaseRetries  *prometheus.CounterVec
	clamps           *prometheus.CounterVec
	attempts         *prometheus.CounterVec
	replyCuts        *prometheus.CounterVec
	tenantHolds      *prometheus.CounterVec
	unreported       *prometheus.CounterVec
	attemptDuration  *prometheus.HistogramVec
	circuitState     *prometheus.GaugeVec
	fallbacks        *prometheus.CounterVec
	reloadOK         prometheus.Gauge
	reloadTime       prometheus.Gauge
	clockOffset      prometheus.Gauge
	listening        *prometheus.GaugeVec
	handshakeFails   *prometheus.CounterVec
	traceFails       prometheus.Counter
}

// New registers the gateway's metrics (and the Go and process collectors) on a
// registry of their own.
func New() *Metrics {
	m := &Metrics{
		registry: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_http_requests_total", Help: "HTTP requests by route, method and status.",
		}, []string{"route", "method", "status"}),
		requestDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gateway_http_request_duration_seconds", Help: "HTTP request latency by route and method (streams: until the stream ends).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"route", "method"}),
		rungs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_rungs_total", Help: "Rungs metered, by model, entry point and side (input or output).",
		}, []string{"model", "entry_point", "side"}),
		upstreamDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gateway_upstream_request_duration_seconds", Help: "Upstream call latency by model and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2.5, 12),
		}, []string{"model", "outcome"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_errors_total", Help: "Upstream failures by kind: unavailable, denied (the gateway's key, base URL or model refused), failed (after dispatch), rejected, broken (mid-stream), cancelled, other.",
		}, []string{"kind"}),
		openStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gateway_open_streams", Help: "Server-sent event streams open now.",
		}),
		streamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_stream_errors_total", Help: "Streams that sent a response.error event (their head said 200), by its code: the codes and statuses a JSON reply would have had (gateway_http_requests_total counts these streams as 200s).",
		}, []string{"code"}),
		batchItems: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_batch_items_total", Help: "Batch items handled by this replica, by outcome: completed, failed, requeued, refused (budget).",
		}, []string{"outcome"}),
		claimDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "gateway_batch_claim_duration_seconds", Help: "Latency of one claim of batch items.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		commitDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "gateway_group_commit_duration_seconds",
			Help:    "Latency of one transaction that stored a group of outcomes, by work: settlement (finished requests' usage and evidence; their replies wait for it), batch_outcomes (batch items') or batch_creations (batches of one account-day created together; their replies wait for it).",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"work"}),
		commitSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gateway_group_commit_size", Help: "Outcomes in one group transaction that committed, by work (see gateway_group_commit_duration_seconds).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 9),
		}, []string{"work"}),
		queueDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gateway_batch_queue_depth", Help: "Batch items queued, across all replicas (sampled).",
		}),
		leaseRescues: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gateway_batch_lease_rescues_total", Help: "Batches with items failed as INTERRUPTED after their replica's lease ran out (rescued by this replica).",
		}),
		maintenanceRows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_maintenance_rows_total", Help: "Rows a maintenance job handled on this replica (removed, folded, rescued, expired), by job (label task: Prometheus keeps job for the scrape target).",
		}, []string{"task"}),
		maintenanceFails: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_maintenance_failures_total", Help: "Runs of a maintenance job on this replica that failed, by job (label task): the database away, or an account whose rows fail the job (set aside, named in the log; the job goes on with the others).",
		}, []string{"task"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_admission_refusals_total", Help: "Requests refused by admission: rate_limit, daily_ceiling, budget, turn_wait (a large request that waited too long for its account's turn to be priced).",
		}, []string{"reason"}),
		unconfirmed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_settlements_unconfirmed_total",
			Help: "Responses sent with their usage while its settlement's outcome was unknown (its reply lost, the database away), by what became of the settlement: sent (the reply went out), stored (sent again until stored, once), missing (given up on: the usage may be missing).",
		}, []string{"outcome"}),
		databaseRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_database_retries_total",
			Help: "Database calls tried again after an attempt failed with the database away (a connection broken or timed out, a failover), by work: settlement, late_settlement (one sent again after its reply went out), batch_creation, batch_outcomes, batch_items (handed back to the queue), batch_states (batches started or finished). Rising while nothing fails: a database that answers slowly, or connections that drop.",
		}, []string{"work"}),
		clamps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_usage_clamped_total", Help: "Upstream token counts that cannot be true, by model and side: cut to their bound (output ceiling sent, or input bytes sent), or, reported as no tokens for text there was, counted by the tokenizer.",
		}, []string{"model", "side"}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_attempts_total", Help: "Upstream attempts by provider, upstream model and outcome: ok, or the failure's kind (unavailable, denied, failed, rejected, broken, cancelled, other).",
		}, []string{"provider", "upstream_model", "outcome"}),
		replyCuts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_reply_cuts_total", Help: "Upstream replies that passed one of the gateway's bounds, by provider, upstream model and bound: text (the reply failed, or was too long to read, or its stream broke off), sources (those past 100 dropped), url (a source dropped for its URL), title, snippet, verdict (cut).",
		}, []string{"provider", "upstream_model", "bound"}),
		tenantHolds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_tenant_holds_total", Help: "Holds a target's circuit put on one account's calls alone, by provider and upstream model: the account's calls failed (after dispatch, or with a 429) while no other account's did (the circuit stayed closed for the others).",
		}, []string{"provider", "upstream_model"}),
		unreported: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_usage_unreported_total", Help: "Calls a target answered whole without reporting usage, by provider and upstream model: billed from the tokenizer's count of the text sent and received, not from the upstream's.",
		}, []string{"provider", "upstream_model"}),
		attemptDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gateway_upstream_attempt_duration_seconds", Help: "Latency of one upstream attempt by provider and upstream model (streams: until the stream ends).",
			Buckets: prometheus.ExponentialBuckets(0.005, 2.5, 12),
		}, []string{"provider", "upstream_model"}),
		circuitState: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gateway_upstream_circuit_state", Help: "Circuit of a target: 0 closed (taking calls), 1 half-open (one probe), 2 open (cooling down).",
		}, []string{"provider", "upstream_model"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_upstream_fallbacks_total", Help: "Calls of a canonical model that moved on from a failed target to the next one.",
		}, []string{"model"}),
		reloadOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gateway_config_last_reload_successful", Help: "Whether the last reload of the configuration file (on SIGHUP or a change of its files) took effect: 1, or 0 when the file did not check and the routes in use stayed.",
		}),
		reloadTime: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gateway_config_last_reload_success_timestamp_seconds", Help: "When the routes in use were loaded (at start, or by the last reload that took effect), in seconds since the epoch.",
		}),
		clockOffset: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gateway_clock_offset_seconds", Help: "How far the database's clock is ahead of this replica's (negative: behind), compared every minute.",
		}),
		listening: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gateway_notifications_listening", Help: "Whether this replica hears the database's notifications (1) or not (0), by listener: keys (changes to keys and limits; while not, keys are looked up for every request) and batches (creations and cancels; while not, they are found by polling).",
		}, []string{"listener"}),
		handshakeFails: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gateway_tls_handshake_failures_total", Help: "TLS handshakes on the API's listener that failed, by kind: closed (the client left before it ended: a TCP health check, a scanner), plain_http (answered 400), refused (the client ended it with an alert: the certificate, or no common version or cipher), other.",
		}, []string{"kind"}),
		traceFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gateway_trace_export_failures_total", Help: "Errors of the OpenTelemetry SDK, each an export of spans that failed (the collector away, or refusing them): its spans are lost. 0 without tracing.",
		}),
	}
	for _, listener := range []string{ListenerKeys, ListenerBatches} {
		m.listening.WithLabelValues(listener).Set(0)
	}
	m.registry.MustRegister(m.attempts, m.replyCuts, m.tenantHolds, m.unreported, m.attemptDuration, m.circuitState, m.fallbacks, m.reloadOK, m.reloadTime, m.clockOffset, m.listening, m.handshakeFails, m.traceFails,
		m.requests, m.requestDuration, m.rungs, m.upstreamDuration, m.upstreamErrors,
		m.openStreams, m.streamErrors, m.batchItems, m.claimDuration, m.commitDuration, m.commitSize, m.queueDepth, m.leaseRescues, m.maintenanceRows, m.maintenanceFails, m.refusals, m.unconfirmed, m.databaseRetries, m.clamps,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The counters that alerts (deploy/prometheus) take increases of are
	// exported at zero from the start: a series that first appears at 1
	// shows no increase, and its first event would not alert.
	for _, o := range []string{UnconfirmedSent, UnconfirmedStored, UnconfirmedMissing} {
		m.unconfirmed.WithLabelValues(o)
	}
	for _, o := range []string{string(gateway.ItemCompleted), string(gateway.ItemFailed), ItemRequeued, ItemRefused} {
		m.batchItems.WithLabelValues(o)
	}
	for _, code := range []gateway.ErrorCode{gateway.EInternal, gateway.EServiceUnavailable, gateway.EInferenceBusy} {
		m.streamErrors.WithLabelValues(string(code))
	}
	for _, model := range gateway.Models {
		for _, side := range []string{"input", "output"} {
			m.clamps.WithLabelValues(string(model), side)
		}
	}
	// So are the retries of each work: a graph of their rate would miss the
	// first retries of a replica that had none.
	for _, w := range []string{RetrySettlement, RetryLateSettlement, RetryBatchCreation, RetryBatchOutcomes, RetryBatchItems, RetryBatchStates} {
		m.databaseRetries.WithLabelValues(w)
	}
	return m
}

// Handler serves the metrics listener: /metrics in the Prometheus text format,
// Go's profiler under /debug/pprof/ when pprof is true, and 404 elsewhere.
func (m *Metrics) Handler(pprof bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{}))
	if pprof {
		mux.HandleFunc("/debug/pprof/", httppprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", httppprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", httppprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", httppprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", httppprof.Trace)
	}
	return mux
}

// Other is the label value of anything outside a label's fixed set (D11).
const Other = "other"

// Method is method when it is one of the methods HTTP defines, else Other:
// metric labels (and log fields) take values from fixed sets only, so callers
// cannot grow them.
func Method(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return method
	}
	return Other
}

// Request records one HTTP request. route must come from a fixed set (the
// server's route templates); the method and status are bounded here.
func (m *Metrics) Request(route, method string, status int, d time.Duration) {
	if m == nil {
		return
	}
	method = Method(method)
	if status < 100 || status > 599 {
		status = 0
	}
	m.requests.WithLabelValues(route, method, strconv.Itoa(status)).Inc()
	m.requestDuration.WithLabelValues(route, method).Observe(d.Seconds())
}

// Rungs records metered usage.
func (m *Metrics) Rungs(model, entry string, input, output int64) {
	if m == nil {
		return
	}
	m.rungs.WithLabelValues(model, entry, "input").Add(float64(input))
	m.rungs.WithLabelValues(model, entry, "output").Add(float64(output))
}

// Upstream records one upstream call; kind is empty on success.
func (m *Metrics) Upstream(model, kind string, d time.Duration) {
	if m == nil {
		return
	}
	outcome := "ok"
	if kind != "" {
		outcome = "error"
		m.upstreamErrors.WithLabelValues(kind).Inc()
	}
	m.upstreamDuration.WithLabelValues(model, outcome).Observe(d.Seconds())
}

// StreamOpened and StreamClosed track open streams.
func (m *Metrics) StreamOpened() {
	if m != nil {
		m.openStreams.Inc()
	}
}

// StreamError records a stream's response.error event with code.
func (m *Metrics) StreamError(code string) {
	if m != nil {
		m.streamErrors.WithLabelValues(code).Inc()
	}
}

// StreamClosed records the end of a stream.
func (m *Metrics) StreamClosed() {
	if m != nil {
		m.openStreams.Dec()
	}
}

// Outcomes of a batch item that BatchItem records besides its final status
// (completed, failed).
const (
	// ItemRequeued is an item handed back to the queue, never dispatched.
	ItemRequeued = "requeued"
	// ItemRefused is an item its project's budget cap could not cover.
	ItemRefused = "refused"
)

// BatchItem records a batch item's outcome here.
func (m *Metrics) BatchItem(outcome string) {
	if m != nil {
		m.batchItems.WithLabelValues(outcome).Inc()
	}
}

// Claim records one claim's latency.
func (m *Metrics) Claim(d time.Duration) {
	if m != nil {
		m.claimDuration.Observe(d.Seconds())
	}
}

// Work stored by group transactions, the label values of GroupCommit.
const (
	WorkSettlement     = "settlement"
	WorkBatchOutcomes  = "batch_outcomes"
	WorkBatchCreations = "batch_creations"
)

// GroupCommit records one group transaction of work (WorkSettlement,
// WorkBatchOutcomes or WorkBatchCreations) that committed: how many outcomes
// it held and how long it took.
func (m *Metrics) GroupCommit(work string, size int, d time.Duration) {
	if m != nil {
		m.commitDuration.WithLabelValues(work).Observe(d.Seconds())
		m.commitSize.WithLabelValues(work).Observe(float64(size))
	}
}

// QueueDepth records the number of queued items.
func (m *Metrics) QueueDepth(n int64) {
	if m != nil {
		m.queueDepth.Set(float64(n))
	}
}

// LeaseRescues records batches rescued.
func (m *Metrics) LeaseRescues(n int64) {
	if m != nil {
		m.leaseRescues.Add(float64(n))
	}
}

// MaintenanceJob exports a maintenance job's series at zero, before its
// first run (alerts take increases).
func (m *Metrics) MaintenanceJob(job string) {
	if m != nil {
		m.maintenanceRows.WithLabelValues(job)
		m.maintenanceFails.WithLabelValues(job)
	}
}

// MaintenanceRun records a run of a maintenance job (named in the code, a
// fixed set): the rows it handled, and whether it failed.
func (m *Metrics) MaintenanceRun(job string, rows int64, err error) {
	if m == nil {
		return
	}
	m.maintenanceRows.WithLabelValues(job).Add(float64(rows))
	if err != nil {
		m.maintenanceFails.WithLabelValues(job).Inc()
	}
}

// Refusal records an admission refusal.
func (m *Metrics) Refusal(reason string) {
	if m != nil {
		m.refusals.WithLabelValues(reason).Inc()
	}
}

// What became of a settlement whose outcome was unknown when its reply was
// sent (see Unconfirmed).
const (
	UnconfirmedSent    = "sent"    // the reply went out with its usage
	UnconfirmedStored  = "stored"  // sent again, and stored
	UnconfirmedMissing = "missing" // given up on: its usage may be missing
)

// Unconfirmed records what became of a settlement whose outcome was unknown
// when its reply was sent: one of the Unconfirmed constants.
func (m *Metrics) Unconfirmed(outcome string) {
	if m != nil {
		m.unconfirmed.WithLabelValues(outcome).Inc()
	}
}

// Work whose database calls are tried again while the database is away, the
// label values of DatabaseRetry.
const (
	RetrySettlement     = "settlement"      // a finished request's usage, before its reply
	RetryLateSettlement = "late_settlement" // one sent again after its reply went out
	RetryBatchCreation  = "batch_creation"  // a creation whose reply was lost
	RetryBatchOutcomes  = "batch_outcomes"  // batch items' outcomes, and checks of them
	RetryBatchItems     = "batch_items"     // items handed back to the queue
	RetryBatchStates    = "batch_states"    // batches started or finished
)

// DatabaseRetry records an attempt of a database call of work (one of the
// Retry constants) that failed with the database away and is tried again.
func (m *Metrics) DatabaseRetry(work string) {
	if m != nil {
		m.databaseRetries.WithLabelValues(work).Inc()
	}
}

// Clamp records an upstream token count cut to its bound.
func (m *Metrics) Clamp(model, side string) {
	if m != nil {
		m.clamps.WithLabelValues(model, side).Inc()
	}
}

// Target holds the instruments of one upstream target, resolved once so that
// an attempt records without looking labels up. A nil *Target records nothing.
type Target struct {
	outcomes   map[string]prometheus.Counter
	other      prometheus.Counter
	cuts       map[string]prometheus.Counter
	holds      prometheus.Counter
	unreported prometheus.Counter
	duration   prometheus.Observer
	circuit    prometheus.Gauge
}

// attemptOutcomes are the outcome label values of an attempt: ok, or the
// failure's upstream.Kind.
var attemptOutcomes = []string{"ok", upstream.KindUnavailable, upstream.KindDenied, upstream.KindFailed, upstream.KindRejected,
	upstream.KindBroken, upstream.KindCancelled, upstream.KindOther}

// Target returns the instruments of a provider's upstream model.
func (m *Metrics) Target(provider, upstreamModel string) *Target {
	if m == nil {
		return nil
	}
	t := &Target{
		outcomes:   make(map[string]prometheus.Counter, len(attemptOutcomes)),
		holds:      m.tenantHolds.WithLabelValues(provider, upstreamModel),
		unreported: m.unreported.WithLabelValues(provider, upstreamModel),
		duration:   m.attemptDuration.WithLabelValues(provider, upstreamModel),
		circuit:    m.circuitState.WithLabelValues(provider, upstreamModel),
	}
	for _, o := range attemptOutcomes {
		t.outcomes[o] = m.attempts.WithLabelValues(provider, upstreamModel, o)
	}
	t.other = t.outcomes[upstream.KindOther]
	t.cuts = make(map[string]prometheus.Counter, len(upstream.Cuts))
	for _, c := range upstream.Cuts {
		t.cuts[c] = m.replyCuts.WithLabelValues(provider, upstreamModel, c)
	}
	return t
}

// ConfigLoaded records a load of the routes: at start, or a reload that
// took effect (ok) or did not.
func (m *Metrics) ConfigLoaded(ok bool, at time.Time) {
	if m == nil {
		return
	}
	if !ok {
		m.reloadOK.Set(0)
		return
	}
	m.reloadOK.Set(1)
	m.reloadTime.Set(float64(at.UnixNano()) / 1e9)
}

// DropTarget removes the series of a provider's upstream model that no
// longer serves (its configuration was replaced without it), so that its
// last circuit state does not stand for a target that is gone.
func (m *Metrics) DropTarget(provider, upstreamModel string) {
	if m == nil {
		return
	}
	for _, o := range attemptOutcomes {
		m.attempts.DeleteLabelValues(provider, upstreamModel, o)
	}
	for _, c := range upstream.Cuts {
		m.replyCuts.DeleteLabelValues(provider, upstreamModel, c)
	}
	m.tenantHolds.DeleteLabelValues(provider, upstreamModel)
	m.unreported.DeleteLabelValues(provider, upstreamModel)
	m.attemptDuration.DeleteLabelValues(provider, upstreamModel)
	m.circuitState.DeleteLabelValues(provider, upstreamModel)
}

// Attempt records one attempt; kind is empty on success.
func (t *Target) Attempt(kind string, d time.Duration) {
	if t == nil {
		return
	}
	if kind == "" {
		kind = "ok"
	}
	c, ok := t.outcomes[kind]
	if !ok {
		c = t.other
	}
	c.Inc()
	t.duration.Observe(d.Seconds())
}

// Cut records a reply of the target that passed bound (one of upstream.Cuts).
func (t *Target) Cut(bound string) {
	if t == nil {
		return
	}
	if c, ok := t.cuts[bound]; ok {
		c.Inc()
	}
}

// TenantHold records a hold the target's circuit put on one account's calls.
func (t *Target) TenantHold() {
	if t != nil {
		t.holds.Inc()
	}
}

// UsageUnreported records a call the target answered whole without usage.
func (t *Target) UsageUnreported() {
	if t != nil {
		t.unreported.Inc()
	}
}

// Circuit records the target's circuit state: 0 closed, 1 half-open, 2 open.
func (t *Target) Circuit(state int) {
	if t != nil {
		t.circuit.Set(float64(state))
	}
}

// ClockOffset records how far the database's clock is ahead of this replica's.
func (m *Metrics) ClockOffset(d time.Duration) {
	if m != nil {
		m.clockOffset.Set(d.Seconds())
	}
}

// The listeners of gateway_notifications_listening.
const (
	ListenerKeys    = "keys"
	ListenerBatches = "batches"
)

// Listening records whether listener (ListenerKeys, ListenerBatches) hears
// the database's notifications.
func (m *Metrics) Listening(listener string, on bool) {
	if m == nil {
		return
	}
	v := 0.0
	if on {
		v = 1
	}
	m.listening.WithLabelValues(listener).Set(v)
}

// Fallback records a call of model moving on to its next target.
func (m *Metrics) Fallback(model string) {
	if m != nil {
		m.fallbacks.WithLabelValues(model).Inc()
	}
}

// TLSHandshakeFailed records a failed TLS handshake of kind (serverlog's
// kinds; anything else is Other).
func (m *Metrics) TLSHandshakeFailed(kind string) {
	if m == nil {
		return
	}
	switch kind {
	case serverlog.Closed, serverlog.PlainHTTP, serverlog.Refused:
	default:
		kind = Other
	}
	m.handshakeFails.WithLabelValues(kind).Inc()
}

// TraceExportFailed counts an error of the tracing SDK: an export that
// failed, its spans lost.
func (m *Metrics) TraceExportFailed() {
	if m != nil {
		m.traceFails.Inc()
	}
}

// Build exports, as gateway_build_info (1, labelled), the version and the
// source revision of the running binary (version.Read), so that a rolling
// upgrade's replicas can be told apart.
func (m *Metrics) Build(version, revision string) {
	if m == nil {
		return
	}
	m.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "gateway_build_info",
		Help:        "Always 1: the version (a release, a pseudo-version of a commit, or devel) and the source revision (a git commit, -dirty with changes not committed when make build linked it; empty when unknown) of the replica's binary, as gateway --version prints them.",
		ConstLabels: prometheus.Labels{"version": version, "revision": revision},
	}, func() float64 { return 1 }))
}

// TLSCertificate exports, as gateway_tls_certificate_expiry_timestamp_seconds,
// when the certificate served on the API's listener stops being valid:
// notAfter is asked at each scrape (certfile.Pair.NotAfter reads a renewal
// of the files then, handshake or not). Called once, by a replica serving
// TLS.
func (m *Metrics) TLSCertificate(notAfter func() time.Time) {
	if m == nil {
		return
	}
	m.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "gateway_tls_certificate_expiry_timestamp_seconds",
		Help: "When the certificate served on the API's listener (GATEWAY_TLS_CERT) stops being valid (its NotAfter), in seconds since the epoch; its files are looked at on each scrape, so a renewal shows at once.",
	}, func() float64 { return float64(notAfter().Unix()) }))
}

// Pool is what a database connection pool tells of itself at a moment:
// its connections now, and its acquires since it opened.
type Pool struct {
	// Acquired, Idle and Constructing count the connections now: in use,
	// waiting for use, being opened; Max is the most the pool opens.
	Acquired, Idle, Constructing, Max int32
	// Acquires counts the connections handed out; Waited those that had to
	// wait, none being idle, for Wait in all; Canceled the acquires whose
	// caller gave up first.
	Acquires, Waited, Canceled int64
	Wait                       time.Duration
}

// DatabasePool exports the replica's database connections, read from stat at
// each scrape: gateway_db_connections by state (acquired, idle,
// constructing), gateway_db_connections_max, and the counters
// gateway_db_acquires_total, gateway_db_acquires_waited_total,
// gateway_db_acquire_wait_seconds_total and
// gateway_db_acquires_canceled_total. A pool whose acquires wait is too small
// for the replica's load (GATEWAY_DB_MAX_CONNS), or its database too slow.
// Called once, by a serving replica.
func (m *Metrics) DatabasePool(stat func() Pool) {
	if m == nil {
		return
	}
	m.registry.MustRegister(poolCollector(stat))
}

// LogLinesLost exports lost, read at each scrape, as
// gateway_log_lines_lost_total: the log lines this replica could not write
// (its log reader gone, a broken pipe) or dropped (its log reader stalled),
// while it went on serving. Called once, by a serving replica.
func (m *Metrics) LogLinesLost(lost func() uint64) {
	if m == nil {
		return
	}
	m.registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "gateway_log_lines_lost_total",
		Help: "Log lines this replica could not write or dropped (its standard error's reader gone or stalled), while it went on serving.",
	}, func() float64 { return float64(lost()) }))
}

// poolCollector exports a Pool read at each scrape.
type poolCollector func() Pool

var (
	poolConnections = prometheus.NewDesc("gateway_db_connections",
		"Database connections of this replica's pool now, by state: acquired (in use), idle, constructing (being opened).", []string{"state"}, nil)
	poolMax = prometheus.NewDesc("gateway_db_connections_max",
		"The most connections this replica's pool opens (GATEWAY_DB_MAX_CONNS).", nil, nil)
	poolAcquires = prometheus.NewDesc("gateway_db_acquires_total",
		"Connections handed out by this replica's pool.", nil, nil)
	poolWaited = prometheus.NewDesc("gateway_db_acquires_waited_total",
		"Connections handed out after a wait, none being idle: a pool too small for the load, or a database too slow.", nil, nil)
	poolWait = prometheus.NewDesc("gateway_db_acquire_wait_seconds_total",
		"Time spent waiting for a connection, none being idle, by the acquires that got one.", nil, nil)
	poolCanceled = prometheus.NewDesc("gateway_db_acquires_canceled_total",
		"Acquires whose caller gave up (its deadline passed, its client left) before a connection was free.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{poolConnections, poolMax, poolAcquires, poolWaited, poolWait, poolCanceled} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	p := c()
	ch <- prometheus.MustNewConstMetric(poolConnections, prometheus.GaugeValue, float64(p.Acquired), "acquired")
	ch <- prometheus.MustNewConstMetric(poolConnections, prometheus.GaugeValue, float64(p.Idle), "idle")
	ch <- prometheus.MustNewConstMetric(poolConnections, prometheus.GaugeValue, float64(p.Constructing), "constructing")
	ch <- prometheus.MustNewConstMetric(poolMax, prometheus.GaugeValue, float64(p.Max))
	ch <- prometheus.MustNewConstMetric(poolAcquires, prometheus.CounterValue, float64(p.Acquires))
	ch <- prometheus.MustNewConstMetric(poolWaited, prometheus.CounterValue, float64(p.Waited))
	ch <- prometheus.MustNewConstMetric(poolWait, prometheus.CounterValue, p.Wait.Seconds())
	ch <- prometheus.MustNewConstMetric(poolCanceled, prometheus.CounterValue, float64(p.Canceled))
}
