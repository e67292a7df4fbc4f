// Package routing sends each call of a canonical model to the upstream targets
// the operator configured for it (a provider's model), in order or spread by
// weight, moving on from a target that failed to the next one within bounds,
// and skipping targets whose circuit is open, or that hold off the calling
// tenant alone (its own calls failing there while others' do not). Interactive
// calls and the batch drainer share one Router, so they share what it learns
// of each target.
//
// Fallback keeps the gateway's guarantees: a call moves on only while nothing
// of its output reached anyone, a failed attempt is never billed (the caller
// bills the result of the target that answered, which the result names), and
// a call marked AtMostOnce (a batch item, decisions D12) moves on only from a
// target that certainly did not process it.
package routing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/tracing"
	"github.com/rungworks/gateway/upstream"
)

// Strategy is how a model's targets are tried.
type Strategy string

// The strategies.
const (
	// Ordered tries the targets in the order listed.
	Ordered Strategy = "ordered"
	// Weighted picks the first target at random in proportion to the weights,
	// then the next among those left, and so on.
	Weighted Strategy = "weighted"
)

// Target is a provider's model serving a canonical model.
type Target struct {
	Provider      string
	UpstreamModel string
	// Weight is the target's share under Weighted (at least 1).
	Weight int
	Client upstream.Provider
}

// Route is how a canonical model is served.
type Route struct {
	Strategy Strategy
	Targets  []Target
}

// Config configures a Router.
type Config struct {
	Routes map[gateway.Model]Route
	// MaxAttempts bounds the targets tried per call (DefaultMaxAttempts when zero).
	MaxAttempts int
	// MaxTime bounds a call's fallback: no attempt starts once it has passed
	// since the first (DefaultMaxTime when zero). A running attempt is not cut.
	MaxTime time.Duration
	Circuit CircuitConfig
	Metrics *metrics.Metrics
	// Logger reports the targets that refuse the gateway's access (a wrong
	// key, base URL or model: upstream.ErrDenied); nil discards.
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultMaxAttempts = 3
	DefaultMaxTime     = 30 * time.Second
)

// Router implements upstream.Provider over the configured routes, which
// Replace may swap while it serves.
type Router struct {
	table   atomic.Pointer[table]
	metrics *metrics.Metrics
	logger  *slog.Logger

	mu      sync.Mutex
	changed chan struct{} // closed and replaced when a circuit changes state
}

// table is one configuration's routes: a call uses the table current when it
// starts until it ends.
type table struct {
	routes      map[gateway.Model]*route
	targets     []*target
	maxAttempts int
	maxTime     time.Duration

	// Once replaced (retired), the table's clients close their idle
	// connections at once and again as each of its calls ends: a provider
	// routed no more is not kept connected to until its idle time runs out.
	retired atomic.Bool
	idlers  []idleCloser
}

// idleCloser is a client that keeps connections for the next call and can
// close those not in use (as http.Client can).
type idleCloser interface{ CloseIdleConnections() }

type route struct {
	model    gateway.Model
	strategy Strategy
	targets  []*target
}

// target is a Target with its circuit; targets of the same provider and
// upstream model share one, whatever canonical models they serve.
type target struct {
	Target
	circuit *circuit
	metrics *metrics.Target
}

// retire marks tb replaced: its clients close their idle connections now,
// and those its running calls still use as each ends (see done).
func (tb *table) retire() {
	tb.retired.Store(true)
	tb.closeIdle()
}

// done ends a call on tb; on a retired table, its clients close their idle
// connections, including the one the call just returned.
func (tb *table) done() {
	if tb.retired.Load() {
		tb.closeIdle()
	}
}

// closeIdle closes the idle connections of tb's clients; a call that starts
// on tb after this (it loaded tb just before the swap) closes them again when
// it is done.
func (tb *table) closeIdle() {
	for _, c := range tb.idlers {
		c.CloseIdleConnections()
	}
}

var _ upstream.Provider = (*Router)(nil)

// New returns a router over cfg's routes. Every target's client is guarded
// (upstream.Guard): what it returns is cleaned and bounded before anyone sees
// it.
func New(cfg Config) (*Router, error) {
	r := &Router{metrics: cfg.Metrics, logger: cfg.Logger, changed: make(chan struct{})}
	if r.logger == nil {
		r.logger = slog.New(slog.DiscardHandler)
	}
	t, err := r.build(cfg)
	if err != nil {
		return nil, err
	}
	r.table.Store(t) // its targets' circuit gauges start at 0: closed
	return r, nil
}

// Replace serves cfg's routes (its Metrics and Logger aside: the router keeps
// its own) from the next call on; calls running finish on the routes they
// started with. The clients of the routes replaced close their idle
// connections at once, and those of the calls running as each ends
// (cfg brings clients of its own). Every target starts with a closed
// circuit, and the metrics of the targets no longer routed are dropped. On
// an error the routes in use stay.
func (r *Router) Replace(cfg Config) error {
	t, err := r.build(cfg)
	if err != nil {
		return err
	}
	// Under mu, no circuit reports a state between the swap and the new
	// circuits' first report (see circuitChanged).
	r.mu.Lock()
	old := r.table.Swap(t)
	t.closeCircuits()
	r.wakeLocked()
	r.mu.Unlock()
	old.retire()
	for _, gone := range old.targets {
		if !slices.ContainsFunc(t.targets, func(kept *target) bool { return kept.sameAs(gone.Target) }) {
			r.metrics.DropTarget(gone.Provider, gone.UpstreamModel)
		}
	}
	return nil
}

// circuitChanged reports a circuit's new state and wakes Wait, unless the
// circuit's table was replaced: used by the calls that started on it, it no
// longer speaks for its target.
func (r *Router) circuitChanged(tb *table, t *target, state int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.table.Load() != tb {
		return
	}
	t.metrics.Circuit(state)
	r.wakeLocked()
}

// tenantHeld logs and counts a hold t's circuit put on one tenant's calls.
func (r *Router) tenantHeld(t *target, tenant uuid.UUID) {
	r.logger.Warn("a target holds off one account's calls: they failed (after dispatch, or with a 429) while no other account's did; the other accounts' calls go on",
		"provider", t.Provider, "upstream_model", t.UpstreamModel, "account_id", tenant)
	t.metrics.TenantHold()
}

// closeCircuits reports the table's circuits closed, as they start (the
// gauges of targets kept by a replacement may say otherwise).
func (tb *table) closeCircuits() {
	for _, t := range tb.targets {
		t.metrics.Circuit(stateClosed)
	}
}

// sameAs reports whether t is the target of provider p's upstream model.
func (t *target) sameAs(p Target) bool {
	return t.Provider == p.Provider && t.UpstreamModel == p.UpstreamModel
}

// build makes the table of cfg's routes.
func (r *Router) build(cfg Config) (*table, error) {
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.MaxTime <= 0 {
		cfg.MaxTime = DefaultMaxTime
	}
	circuitCfg := cfg.Circuit.withDefaults()
	tb := &table{routes: map[gateway.Model]*route{}, maxAttempts: cfg.MaxAttempts, maxTime: cfg.MaxTime}
	shared := map[[2]string]*target{}
	for model, rt := range cfg.Routes {
		if len(rt.Targets) == 0 {
			return nil, fmt.Errorf("model %s has no targets", model)
		}
		if rt.Strategy == "" {
			rt.Strategy = Ordered
		}
		if rt.Strategy != Ordered && rt.Strategy != Weighted {
			return nil, fmt.Errorf("model %s: unknown strategy %q", model, rt.Strategy)
		}
		out := &route{model: model, strategy: rt.Strategy}
		for _, t := range rt.Targets {
			if t.Client == nil {
				return nil, fmt.Errorf("model %s: target %s/%s has no client", model, t.Provider, t.UpstreamModel)
			}
			key := [2]string{t.Provider, t.UpstreamModel}
			tt, ok := shared[key]
			if !ok {
				tt = &target{Target: t, metrics: r.metrics.Target(t.Provider, t.UpstreamModel)}
				if c, ok := t.Client.(idleCloser); ok {
					tb.idlers = append(tb.idlers, c)
				}
				tt.Client = upstream.Guard(t.Client, r.cutReporter(tt))
				tt.circuit = newCircuit(circuitCfg, func(state int) { r.circuitChanged(tb, tt, state) }, func(tenant uuid.UUID) { r.tenantHeld(tt, tenant) })
				shared[key] = tt
				tb.targets = append(tb.targets, tt)
			}
			// The weight is the route's: a shared target may weigh differently in each.
			entry := &target{Target: tt.Target, circuit: tt.circuit, metrics: tt.metrics}
			entry.Weight = max(t.Weight, 1)
			out.targets = append(out.targets, entry)
		}
		tb.routes[model] = out
	}
	return tb, nil
}

// cutReporter logs and counts the replies of t that passed one of the
// guard's bounds.
func (r *Router) cutReporter(t *target) func(string) {
	return func(bound string) {
		r.logger.Warn("an upstream reply passed a bound of the gateway and was cut", "provider", t.Provider, "upstream_model", t.UpstreamModel, "bound", bound)
		t.metrics.Cut(bound)
	}
}

// Available implements gateway.Catalog: the model has a route.
func (r *Router) Available(model gateway.Model) bool { return r.table.Load().routes[model] != nil }

// Complete implements upstream.Provider.
func (r *Router) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	return r.run(ctx, req, nil, func(ctx context.Context, t *target, req *upstream.Request) (upstream.Result, error) {
		return t.Client.Complete(ctx, req)
	})
}

// Stream implements upstream.Provider. A stream moves to the next target only
// while nothing of it has been emitted; after that, a failure is the stream's.
func (r *Router) Stream(ctx context.Context, req *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	var emitted bool
	return r.run(ctx, req, &emitted, func(ctx context.Context, t *target, req *upstream.Request) (upstream.Result, error) {
		return t.Client.Stream(ctx, req, func(d upstream.Delta) error {
			emitted = true
			return emit(d)
		})
	})
}

// run tries the model's targets until one answers, a failure may not move on,
// or the attempts or the time run out, and returns the last attempt's outcome.
func (r *Router) run(ctx context.Context, original *upstream.Request, emitted *bool,
	attempt func(context.Context, *target, *upstream.Request) (upstream.Result, error)) (upstream.Result, error) {
	// Each attempt is sent this copy, with its target's upstream model; the
	// caller's request is not changed.
	req := *original
	tb := r.table.Load()
	defer tb.done()
	rt := tb.routes[req.Model]
	if rt == nil {
		return upstream.Result{}, fmt.Errorf("%w: model %s has no route", upstream.ErrUnavailable, req.Model)
	}
	// req.OnDispatch is told once, at the first attempt that reaches a target.
	if onDispatch := req.OnDispatch; onDispatch != nil {
		var once atomic.Bool
		req.OnDispatch = func() {
			if once.CompareAndSwap(false, true) {
				onDispatch()
			}
		}
	}
	var buf [8]*target
	order := rt.order(buf[:0])
	deadline := time.Now().Add(tb.maxTime)
	attempts := 0
	heldOff := false
	var last error
	for _, t := range order {
		now := time.Now()
		if attempts == tb.maxAttempts || (attempts > 0 && now.After(deadline)) {
			break
		}
		if ok, held := t.circuit.allow(now, req.Tenant); !ok {
			heldOff = heldOff || held
			continue
		}
		if attempts > 0 {
			r.metrics.Fallback(string(rt.model))
		}
		attempts++
		req.UpstreamModel = t.UpstreamModel
		actx, span := tracing.StartAttempt(ctx, t.Provider, t.UpstreamModel, attempts)
		res, err := attempt(actx, t, &req)
		kind := upstream.Kind(err)
		t.metrics.Attempt(kind, time.Since(now))
		tracing.EndAttempt(span, t.UpstreamModel, res.UsageReported, res.InputTokens, res.OutputTokens, kind)
		if err == nil && !res.UsageReported {
			t.metrics.UsageUnreported()
		}
		t.observe(err, req.Tenant)
		if kind == upstream.KindDenied {
			r.logger.ErrorContext(ctx, "the upstream refused the gateway's access: check the target's key, base URL and model in the configuration",
				"provider", t.Provider, "upstream_model", t.UpstreamModel, "error", err)
		}
		if err == nil || ctx.Err() != nil || !mayMoveOn(kind, req.AtMostOnce, emitted) {
			res.Route = gateway.UpstreamRoute{Provider: t.Provider, UpstreamModel: t.UpstreamModel, Attempts: attempts}
			return res, err
		}
		last = err
	}
	if attempts == 0 {
		var err error
		if heldOff {
			err = fmt.Errorf("%w: %w: model %s", upstream.ErrUnavailable, upstream.ErrCallerHeld, req.Model)
		} else {
			err = fmt.Errorf("%w: no target of model %s is taking calls (their circuits are open)", upstream.ErrUnavailable, req.Model)
		}
		return upstream.Result{}, upstream.WithRetryAfter(err, time.Until(rt.reopensAt(req.Tenant)))
	}
	return upstream.Result{Route: gateway.UpstreamRoute{Attempts: attempts}}, last
}

// mayMoveOn says whether a failed attempt may be followed by one at the next
// target: never once output was emitted; a target that certainly did not
// process the call (unavailable) always; one that may have (failed after
// dispatch, a stream broken before any output) only when the call may reach
// more than one upstream. A target that refused the gateway's access did not
// process the call either.
func mayMoveOn(kind string, atMostOnce bool, emitted *bool) bool {
	if emitted != nil && *emitted {
		return false
	}
	switch kind {
	case upstream.KindUnavailable, upstream.KindDenied:
		return true
	case upstream.KindFailed, upstream.KindBroken:
		return !atMostOnce
	}
	return false
}

// observe reports the outcome of an attempt for tenant (err, nil for an
// answer) to the target's circuit: an answer (a rejection of the request
// included) says it is up; a failure after dispatch, or a 429, may be the
// tenant's own doing; any other failure (no connection, 503, a refusal of the
// gateway's access) says the target is in trouble; anything else (the caller
// went away) says nothing. A failure carries how long the target asked to
// wait, if it did.
func (t *target) observe(err error, tenant uuid.UUID) {
	switch kind := upstream.Kind(err); kind {
	case "", upstream.KindRejected:
		t.circuit.succeeded(tenant)
	case upstream.KindFailed, upstream.KindBroken, upstream.KindUnavailable, upstream.KindDenied:
		own := kind == upstream.KindFailed || kind == upstream.KindBroken || errors.Is(err, upstream.ErrRateLimited)
		t.circuit.failed(time.Now(), upstream.RetryAfter(err), tenant, own)
	default:
		t.circuit.released(tenant)
	}
}

// reopensAt is the soonest a target of the route takes tenant's calls again:
// the earliest end of its targets' cool-downs and tenant's holds (zero when
// none holds them off).
func (rt *route) reopensAt(tenant uuid.UUID) time.Time {
	var soonest time.Time
	for _, t := range rt.targets {
		if at := t.circuit.reopensAt(tenant); !at.IsZero() && (soonest.IsZero() || at.Before(soonest)) {
			soonest = at
		}
	}
	return soonest
}

// order returns the targets in the order to try them, appended to buf.
func (rt *route) order(buf []*target) []*target {
	buf = append(buf, rt.targets...)
	if rt.strategy != Weighted || len(buf) < 2 {
		return buf
	}
	// A weighted shuffle: each position is drawn among those left, by weight.
	for i := range buf[:len(buf)-1] {
		total := 0
		for _, t := range buf[i:] {
			total += t.Weight
		}
		pick := rand.IntN(total)
		for j := i; j < len(buf); j++ {
			if pick < buf[j].Weight {
				buf[i], buf[j] = buf[j], buf[i]
				break
			}
			pick -= buf[j].Weight
		}
	}
	return buf
}

// Health says which models can be run now: serving are those with a target
// whose circuit is closed, probing those whose targets only let a probe
// through (the batch drainer sends them one item at a time).
func (r *Router) Health() (serving, probing []gateway.Model) {
	now := time.Now()
	routes := r.table.Load().routes
	for _, model := range gateway.Models {
		rt := routes[model]
		if rt == nil {
			continue
		}
		anyReady, anyFull := false, false
		for _, t := range rt.targets {
			ready, full := t.circuit.ready(now)
			anyReady, anyFull = anyReady || ready, anyFull || full
		}
		switch {
		case anyFull:
			serving = append(serving, model)
		case anyReady:
			probing = append(probing, model)
		}
	}
	return serving, probing
}

// Wait returns when a circuit changes state, when the soonest cool-down ends,
// after at most maxWait, or when ctx ends.
func (r *Router) Wait(ctx context.Context, maxWait time.Duration) {
	r.mu.Lock()
	changed := r.changed
	r.mu.Unlock()
	wait := maxWait
	for _, t := range r.table.Load().targets {
		if at := t.circuit.reopensAt(uuid.Nil); !at.IsZero() {
			wait = min(wait, time.Until(at))
		}
	}
	if wait <= 0 {
		return
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-ctx.Done():
	case <-changed:
	case <-timer.C:
	}
}

// wakeLocked wakes whoever waits for a circuit to change; r.mu is held.
func (r *Router) wakeLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}
