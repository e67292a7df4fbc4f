package routing_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
)

// testBundle is a router over fake upstreams a, b and c (in that order) for
// the instant model, each with a real OpenAI-compatible client.
type testBundle struct {
	router *routing.Router
	fakes  map[string]*fakeupstream.Server
}

func setup(t *testing.T, cfg routing.Config) *testBundle {
	t.Helper()
	b := &testBundle{fakes: map[string]*fakeupstream.Server{}}
	var targets []routing.Target
	for _, name := range []string{"a", "b", "c"} {
		fake := fakeupstream.New()
		t.Cleanup(fake.Close)
		b.fakes[name] = fake
		client := openai.New(openai.Config{BaseURL: fake.BaseURL(), Timeout: 300 * time.Millisecond})
		targets = append(targets, routing.Target{Provider: name, UpstreamModel: name + "-model", Client: client})
	}
	cfg.Routes = map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: targets}}
	r, err := routing.New(cfg)
	require.NoError(t, err)
	b.router = r
	return b
}

func (b *testBundle) calls(name string) int { return len(b.fakes[name].Calls()) }

// onlyRoute is routes sending the instant model to fake upstream name alone,
// through a new client that keeps idle connections for an hour.
func (b *testBundle) onlyRoute(name string, h2c bool) routing.Config {
	client := openai.New(openai.Config{BaseURL: b.fakes[name].BaseURL(), Timeout: 5 * time.Second, IdleTimeout: time.Hour, H2C: h2c})
	return routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{{Provider: name, UpstreamModel: name + "-model", Client: client}}}}}
}

func request(prompt string) *upstream.Request {
	return &upstream.Request{Model: gateway.ModelInstant, Prompt: prompt, MaxOutputTokens: 100}
}

// completeFor runs prompt through the router as tenant's call.
func (b *testBundle) completeFor(tenant uuid.UUID, prompt string) (upstream.Result, error) {
	req := request(prompt)
	req.Tenant = tenant
	return b.router.Complete(context.Background(), req)
}

func TestFallsBackWhenATargetIsUnavailable(t *testing.T) {
	t.Parallel()
	for name, breakA := range map[string]func(*fakeupstream.Server){
		"refused": func(f *fakeupstream.Server) { f.Close() },
		"503":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusServiceUnavailable) },
		"429":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusTooManyRequests) },
		"401":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusUnauthorized) },
		"404":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusNotFound) },
		"500":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusInternalServerError) },
		"408":     func(f *fakeupstream.Server) { f.SetStatus(http.StatusRequestTimeout) },
		"timeout": func(f *fakeupstream.Server) { f.SetDelay(2 * time.Second) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, routing.Config{})
			breakA(b.fakes["a"])
			res, err := b.router.Complete(context.Background(), request("hello there"))
			require.NoError(t, err)
			require.Equal(t, fakeupstream.Reply("hello there"), res.Content)
			require.Equal(t, "b", res.Route.Provider)
			require.Equal(t, "b-model", res.Route.UpstreamModel)
			require.Equal(t, 2, res.Route.Attempts)
			pt, ct := fakeupstream.Usage("hello there")
			require.Equal(t, []uint64{pt, ct}, []uint64{res.InputTokens, res.OutputTokens}, "the usage is the answering target's")
			require.Equal(t, "b-model", b.fakes["b"].Calls()[0].Model)
			require.Zero(t, b.calls("c"))
		})
	}
}

func TestARejectionDoesNotFallBack(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	b.fakes["a"].SetMode(fakeupstream.Reject)
	_, err := b.router.Complete(context.Background(), request("p"))
	var rejected *upstream.RejectedError
	require.ErrorAs(t, err, &rejected)
	require.Equal(t, 1, b.calls("a"))
	require.Zero(t, b.calls("b"), "a request the upstream refused is not sent elsewhere")
}

// TestAtMostOnceMovesOnOnlyWhenNotProcessed: a batch item (D12) goes to the
// next target only when the first certainly did not process it.
func TestAtMostOnceMovesOnOnlyWhenNotProcessed(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	req := request("item")
	req.AtMostOnce = true

	b.fakes["a"].SetStatus(http.StatusInternalServerError)
	_, err := b.router.Complete(context.Background(), req)
	require.ErrorIs(t, err, upstream.ErrFailed)
	require.Zero(t, b.calls("b"), "a 500 may have been processed: not sent again")

	b.fakes["a"].SetDelay(2 * time.Second) // a timeout after dispatch
	b.fakes["a"].SetStatus(0)
	_, err = b.router.Complete(context.Background(), req)
	require.ErrorIs(t, err, upstream.ErrFailed)
	require.Zero(t, b.calls("b"))

	b.fakes["a"].SetDelay(0)
	b.fakes["a"].SetStatus(http.StatusUnauthorized)
	res, err := b.router.Complete(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider, "a refusal of the gateway's key did not process the item")

	b.fakes["a"].SetStatus(http.StatusServiceUnavailable)
	var dispatches int
	req.OnDispatch = func() { dispatches++ }
	res, err = b.router.Complete(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 1, dispatches, "the caller hears of the dispatch once")
	require.Empty(t, req.UpstreamModel, "the caller's request is not changed by the attempts")
}

// TestADeniedTargetIsReportedAndSkipped: a target that refuses the
// gateway's key counts against its circuit, and each refusal is logged for
// the operator with the upstream's message (which a caller never sees).
func TestADeniedTargetIsReportedAndSkipped(t *testing.T) {
	t.Parallel()
	var log syncbuf.Buffer
	b := setup(t, routing.Config{
		Circuit: routing.CircuitConfig{Failures: 2, Cooldown: time.Hour},
		Logger:  slog.New(slog.NewJSONHandler(&log, nil)),
	})
	b.fakes["a"].SetStatus(http.StatusUnauthorized)
	for range 3 {
		res, err := b.router.Complete(context.Background(), request("p"))
		require.NoError(t, err)
		require.Equal(t, "b", res.Route.Provider)
	}
	require.Equal(t, 2, b.calls("a"), "two refusals opened the circuit")
	lines := logged(t, &log)
	require.Len(t, lines, 2)
	entry := lines[0]
	require.Equal(t, "ERROR", entry["level"])
	require.Equal(t, "a", entry["provider"])
	require.Equal(t, "a-model", entry["upstream_model"])
	require.Contains(t, entry["msg"], "refused the gateway's access")
	require.Contains(t, entry["error"], "status 401")
}

// TestATargetThatAsksToWaitIsWaitedFor: a 429 with Retry-After counts as a
// failure (one alone opens nothing: a provider may give it to one request);
// the cool-down it starts lasts as long as the target asked, at most the
// longest cool-down; when no target takes calls, the error says when the
// first one will.
func TestATargetThatAsksToWaitIsWaitedFor(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 2, Cooldown: 10 * time.Millisecond, MaxCooldown: time.Hour}})
	b.fakes["a"].SetStatus(http.StatusTooManyRequests)
	b.fakes["a"].SetReplyHeader("Retry-After", "30")
	for range 2 {
		res, err := b.router.Complete(context.Background(), request("p"))
		require.NoError(t, err)
		require.Equal(t, 2, res.Route.Attempts, "a is tried until its circuit opens")
	}
	time.Sleep(50 * time.Millisecond) // past the configured cool-down
	res, err := b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts, "a's circuit stays open for the 30 s it asked")
	require.Equal(t, 2, b.calls("a"))

	for name, wait := range map[string]string{"b": "20", "c": "25"} {
		b.fakes[name].SetStatus(http.StatusServiceUnavailable)
		b.fakes[name].SetReplyHeader("Retry-After", wait)
	}
	for range 2 {
		_, err = b.router.Complete(context.Background(), request("p"))
		require.ErrorIs(t, err, upstream.ErrUnavailable)
		require.Equal(t, 25*time.Second, upstream.RetryAfter(err), "the last target's wait")
	}
	_, err = b.router.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.InDelta(t, 20*time.Second, upstream.RetryAfter(err), float64(time.Second), "no target takes calls: the soonest, b, reopens in 20 s")
	require.Equal(t, []int{2, 2, 2}, []int{b.calls("a"), b.calls("b") - 3, b.calls("c")}, "b answered three before")
}

func TestStreamFallsBackOnlyBeforeTheFirstByte(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	prompt := "one two three four"
	collect := func() (string, upstream.Result, error) {
		var got string
		res, err := b.router.Stream(context.Background(), request(prompt), func(d upstream.Delta) error {
			got += d.Content
			return nil
		})
		return got, res, err
	}

	b.fakes["a"].SetMode(fakeupstream.Down)
	got, res, err := collect()
	require.NoError(t, err)
	require.Equal(t, fakeupstream.Reply(prompt), got)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 2, res.Route.Attempts)

	b.fakes["a"].SetMode(fakeupstream.OK)
	b.fakes["a"].SetBreakAfter(2)
	before := b.calls("b")
	got, res, err = collect()
	require.ErrorIs(t, err, upstream.ErrStreamBroken)
	require.Equal(t, fakeupstream.StreamPieces(prompt)[0]+fakeupstream.StreamPieces(prompt)[1], got, "what was sent stays the stream's")
	require.Equal(t, got, res.Content)
	require.Equal(t, "a", res.Route.Provider)
	require.Equal(t, before, b.calls("b"), "no fallback once output reached the caller")
}

func TestAttemptsAreBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{MaxAttempts: 2, Circuit: routing.CircuitConfig{Failures: 100}})
	for _, name := range []string{"a", "b", "c"} {
		b.fakes[name].SetMode(fakeupstream.Down)
	}
	res, err := b.router.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.Equal(t, 2, res.Route.Attempts)
	require.Zero(t, b.calls("c"))

	// And in time: no attempt starts once MaxTime has passed.
	b = setup(t, routing.Config{MaxTime: 50 * time.Millisecond, Circuit: routing.CircuitConfig{Failures: 100}})
	b.fakes["a"].SetDelay(100 * time.Millisecond)
	b.fakes["a"].SetStatus(http.StatusServiceUnavailable)
	res, err = b.router.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.Equal(t, 1, res.Route.Attempts)
	require.Zero(t, b.calls("b"))

	// The first attempt is made however short MaxTime is.
	b = setup(t, routing.Config{MaxTime: time.Nanosecond})
	res, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
}

func TestCircuitOpensThenProbes(t *testing.T) {
	t.Parallel()
	cooldown := 200 * time.Millisecond
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 2, Cooldown: cooldown, MaxCooldown: time.Hour}})
	b.fakes["a"].SetMode(fakeupstream.Down)
	for range 2 {
		res, err := b.router.Complete(context.Background(), request("p"))
		require.NoError(t, err)
		require.Equal(t, 2, res.Route.Attempts)
	}
	require.Equal(t, 2, b.calls("a"))

	// Open: a is skipped, b answers at the first attempt.
	res, err := b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts)
	require.Equal(t, 2, b.calls("a"))

	// After the cool-down one probe goes to a; it fails: open again, for
	// twice as long.
	time.Sleep(cooldown)
	_, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, 3, b.calls("a"))
	time.Sleep(cooldown)
	_, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, 3, b.calls("a"), "the second cool-down is longer")

	// A probe that succeeds closes the circuit.
	b.fakes["a"].SetMode(fakeupstream.OK)
	time.Sleep(cooldown)
	res, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
	res, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
}

// TestOneTenantsFailuresHoldOffOnlyItsCalls: failures after dispatch that
// only one tenant's calls meet hold off that tenant's calls alone, with a
// cool-down and a probe of their own, while every other tenant's calls go on
// and the drainer sees the model healthy. A run of two tenants' failures is
// the target's: its circuit opens for everyone.
func TestOneTenantsFailuresHoldOffOnlyItsCalls(t *testing.T) {
	t.Parallel()
	cooldown := 500 * time.Millisecond // long enough that a slow machine still calls within it
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 2, Cooldown: cooldown, MaxCooldown: time.Hour}})
	for _, f := range b.fakes {
		f.SetHostile("POISON", fakeupstream.Hostile{Status: http.StatusInternalServerError})
	}
	poisoner, bystander := uuid.New(), uuid.New()
	sent := func() int { return b.calls("a") + b.calls("b") + b.calls("c") }

	// Two of the poisoner's calls fail at every target, tried in turn.
	for range 2 {
		_, err := b.completeFor(poisoner, "POISON")
		require.ErrorIs(t, err, upstream.ErrFailed)
	}
	require.Equal(t, 6, sent())

	// Now its calls are held off by every target and sent nowhere...
	_, err := b.completeFor(poisoner, "fine")
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.ErrorIs(t, err, upstream.ErrCallerHeld)
	require.Positive(t, upstream.RetryAfter(err))
	require.LessOrEqual(t, upstream.RetryAfter(err), cooldown)
	require.Equal(t, 6, sent())
	// ...while the bystander's go to the first target as before.
	res, err := b.completeFor(bystander, "fine")
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts)
	serving, probing := b.router.Health()
	require.Equal(t, []gateway.Model{gateway.ModelInstant}, serving)
	require.Empty(t, probing)

	// After the cool-down each target takes one probe of the poisoner's; they
	// fail, and hold it twice as long.
	time.Sleep(cooldown)
	_, err = b.completeFor(poisoner, "POISON")
	require.ErrorIs(t, err, upstream.ErrFailed)
	require.Equal(t, 10, sent())
	time.Sleep(cooldown)
	_, err = b.completeFor(poisoner, "fine")
	require.ErrorIs(t, err, upstream.ErrCallerHeld)
	require.Equal(t, 10, sent(), "the second cool-down is longer")

	// A probe that is answered lifts the hold.
	time.Sleep(cooldown)
	res, err = b.completeFor(poisoner, "fine")
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
	res, err = b.completeFor(poisoner, "fine")
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)

	// One failure of the poisoner's, then one of another tenant's: the run
	// is the targets' own trouble, and they open for everyone.
	_, err = b.completeFor(poisoner, "POISON")
	require.ErrorIs(t, err, upstream.ErrFailed)
	_, err = b.completeFor(uuid.New(), "POISON")
	require.ErrorIs(t, err, upstream.ErrFailed)
	before := sent()
	_, err = b.completeFor(bystander, "fine")
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.NotErrorIs(t, err, upstream.ErrCallerHeld)
	require.Equal(t, before, sent())
	serving, _ = b.router.Health()
	require.Empty(t, serving)
}

// TestOneTenantsRateLimitsHoldOffOnlyItsCalls: a 429 can answer one request
// alone (a prompt larger than a per-minute token limit), so a run of one
// tenant's 429s holds off that tenant, for as long as the target asked, while
// the others' calls go on; 429s of two tenants' in a run are the target's
// limit reached, and open its circuit for everyone.
func TestOneTenantsRateLimitsHoldOffOnlyItsCalls(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 2, Cooldown: 100 * time.Millisecond, MaxCooldown: time.Hour}})
	for _, f := range b.fakes {
		f.SetHostile("HUGE", fakeupstream.Hostile{Status: http.StatusTooManyRequests})
		f.SetReplyHeader("Retry-After", "30")
	}
	large, bystander := uuid.New(), uuid.New()
	for range 2 {
		_, err := b.completeFor(large, "HUGE")
		require.ErrorIs(t, err, upstream.ErrRateLimited)
	}
	_, err := b.completeFor(large, "fine")
	require.ErrorIs(t, err, upstream.ErrCallerHeld)
	require.Greater(t, upstream.RetryAfter(err), 20*time.Second, "held for the 30 s the target asked")
	res, err := b.completeFor(bystander, "fine")
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)

	for range 2 {
		_, err := b.completeFor(uuid.New(), "HUGE")
		require.ErrorIs(t, err, upstream.ErrRateLimited)
	}
	_, err = b.completeFor(bystander, "fine")
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.NotErrorIs(t, err, upstream.ErrCallerHeld, "two tenants' 429s opened the circuits for everyone")
}

// TestFailuresOfNoTenantAreTheTargets: failures of calls that name no tenant,
// and failures that say the target is in trouble whoever calls (a 503 here),
// open the circuit for everyone, as before tenants were told apart.
func TestFailuresOfNoTenantAreTheTargets(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 2, Cooldown: time.Hour}})
	b.fakes["a"].SetStatus(http.StatusInternalServerError)
	for range 2 {
		res, err := b.router.Complete(context.Background(), request("p"))
		require.NoError(t, err)
		require.Equal(t, "b", res.Route.Provider)
	}
	b.fakes["b"].SetMode(fakeupstream.Down)
	tenant := uuid.New()
	for range 2 {
		res, err := b.completeFor(tenant, "p")
		require.NoError(t, err)
		require.Equal(t, "c", res.Route.Provider)
	}
	res, err := b.completeFor(uuid.New(), "p")
	require.NoError(t, err)
	require.Equal(t, "c", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts, "a and b are open for every tenant")
}

func TestHealthAndWait(t *testing.T) {
	t.Parallel()
	cooldown := 300 * time.Millisecond
	b := setup(t, routing.Config{Circuit: routing.CircuitConfig{Failures: 1, Cooldown: cooldown}})
	serving, probing := b.router.Health()
	require.Equal(t, []gateway.Model{gateway.ModelInstant}, serving)
	require.Empty(t, probing)

	// Every circuit closed, Wait returns when its caller leaves.
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan struct{})
	go func() {
		b.router.Wait(ctx, time.Hour)
		close(left)
	}()
	cancel()
	select {
	case <-left:
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return when its context ended")
	}

	for _, name := range []string{"a", "b", "c"} {
		b.fakes[name].SetMode(fakeupstream.Down)
	}
	_, err := b.router.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	serving, probing = b.router.Health()
	require.Empty(t, serving)
	require.Empty(t, probing, "every target is cooling down")

	// No target takes calls: refused at once, nothing sent.
	calls := b.calls("a") + b.calls("b") + b.calls("c")
	_, err = b.router.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.Equal(t, calls, b.calls("a")+b.calls("b")+b.calls("c"))

	// Wait returns when the first cool-down ends; then the model takes a probe.
	start := time.Now()
	b.router.Wait(context.Background(), time.Minute)
	require.Less(t, time.Since(start), 30*time.Second, "Wait ends with the cool-down, not at maxWait")
	serving, probing = b.router.Health()
	require.Empty(t, serving)
	require.Equal(t, []gateway.Model{gateway.ModelInstant}, probing)

	// A successful probe closes its circuit (and wakes whoever waits:
	// TestTheRouterReportsTheRoutesInUse).
	b.fakes["a"].SetMode(fakeupstream.OK)
	_, err = b.router.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	serving, _ = b.router.Health()
	require.Equal(t, []gateway.Model{gateway.ModelInstant}, serving)
}

// logged is the lines of a JSON log, decoded.
func logged(t *testing.T, log *syncbuf.Buffer) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(log.String()), "\n") {
		var entry map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &entry), line)
		lines = append(lines, entry)
	}
	return lines
}

// counting is an in-process provider that counts calls and answers each at
// once, or as its outcome says when it has one.
type counting struct {
	outcome func(context.Context, *upstream.Request) (upstream.Result, error)

	mu sync.Mutex
	n  int
}

// failing is a provider whose calls of prompt fail with err, and whose other
// calls are answered.
func failing(prompt string, err error) *counting {
	return &counting{outcome: func(_ context.Context, req *upstream.Request) (upstream.Result, error) {
		if req.Prompt == prompt {
			return upstream.Result{}, err
		}
		return answer, nil
	}}
}

var answer = upstream.Result{Content: "ok", UsageReported: true}

func (c *counting) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
	if c.outcome != nil {
		return c.outcome(ctx, req)
	}
	return answer, nil
}

func (c *counting) Stream(ctx context.Context, req *upstream.Request, _ func(upstream.Delta) error) (upstream.Result, error) {
	return c.Complete(ctx, req)
}

func (c *counting) calls() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// only is routes sending the instant model to targets, in order.
func only(targets ...routing.Target) map[gateway.Model]routing.Route {
	return map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: targets}}
}

// TestWeightedSpread: with weights 3:1, the first target gets 75 % of 4,000
// calls within ±5 points (seven standard deviations); the same two targets
// weigh 1:3 in another model's route, and a weight left zero weighs 1.
func TestWeightedSpread(t *testing.T) {
	t.Parallel()
	heavy, light := &counting{}, &counting{}
	targets := func(heavyWeight, lightWeight int) routing.Route {
		return routing.Route{Strategy: routing.Weighted, Targets: []routing.Target{
			{Provider: "heavy", UpstreamModel: "m", Weight: heavyWeight, Client: heavy},
			{Provider: "light", UpstreamModel: "m", Weight: lightWeight, Client: light},
		}}
	}
	r, err := routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{
		gateway.ModelInstant:   targets(3, 1),
		gateway.ModelReasoning: targets(1, 3),
		gateway.ModelElements:  targets(0, 0),
	}})
	require.NoError(t, err)
	for model, share := range map[gateway.Model]float64{gateway.ModelInstant: 0.75, gateway.ModelReasoning: 0.25, gateway.ModelElements: 0.5} {
		const n = 4000
		before := heavy.calls()
		req := request("p")
		req.Model = model
		for range n {
			_, err := r.Complete(context.Background(), req)
			require.NoError(t, err)
		}
		require.InDelta(t, share, float64(heavy.calls()-before)/n, 0.05, model)
	}
	require.Equal(t, 3*4000, heavy.calls()+light.calls())
}

func TestNewRefusesBadRoutes(t *testing.T) {
	t.Parallel()
	_, err := routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {}}})
	require.ErrorContains(t, err, "no targets")
	_, err = routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{{Provider: "p", UpstreamModel: "m"}}}}})
	require.ErrorContains(t, err, "no client")
	_, err = routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Strategy: "random", Targets: []routing.Target{{Provider: "p", UpstreamModel: "m", Client: &counting{}}}}}})
	require.ErrorContains(t, err, "unknown strategy")
	r, err := routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{{Provider: "p", UpstreamModel: "m", Client: &counting{}}}}}})
	require.NoError(t, err)
	require.True(t, r.Available(gateway.ModelInstant))
	require.False(t, r.Available(gateway.ModelReasoning))
	_, err = r.Complete(context.Background(), &upstream.Request{Model: gateway.ModelReasoning})
	require.True(t, errors.Is(err, upstream.ErrUnavailable))
}

// TestReplaceServesNewRoutesFromTheNextCall: replaced routes serve the calls
// that start after, with circuits that start closed; a call running finishes
// on the route it started on; a target no longer routed leaves the metrics;
// a configuration that does not build changes nothing.
func TestReplaceServesNewRoutesFromTheNextCall(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	target := func(name string) routing.Target {
		return routing.Target{Provider: name, UpstreamModel: name + "-model", Client: openai.New(openai.Config{BaseURL: b.fakes[name].BaseURL(), Timeout: 5 * time.Second})}
	}
	m := metrics.New()
	router, err := routing.New(routing.Config{
		Routes:  map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{target("a"), target("b"), target("c")}}},
		Metrics: m, Circuit: routing.CircuitConfig{Failures: 1, Cooldown: time.Hour, MaxCooldown: time.Hour},
	})
	require.NoError(t, err)
	// a's circuit opens for an hour; a call to a slow c is running.
	b.fakes["a"].SetStatus(http.StatusServiceUnavailable)
	_, err = router.Complete(context.Background(), request("opens a"))
	require.NoError(t, err)
	b.fakes["a"].SetStatus(0)
	b.fakes["b"].SetStatus(http.StatusServiceUnavailable)
	b.fakes["c"].SetSlow("running", 300*time.Millisecond)
	running := make(chan upstream.Result, 1)
	go func() {
		res, err := router.Complete(context.Background(), request("running on c"))
		if err == nil {
			running <- res
		}
		close(running)
	}()
	require.Eventually(t, func() bool { return b.calls("c") == 1 }, 5*time.Second, time.Millisecond)
	require.Contains(t, metricstest.Scrape(m), `gateway_upstream_circuit_state{provider="a",upstream_model="a-model"} 2`)

	// Now: instant on a then c (a's circuit closed again), reasoning on c;
	// b is routed no more.
	require.NoError(t, router.Replace(routing.Config{Routes: map[gateway.Model]routing.Route{
		gateway.ModelInstant:   {Targets: []routing.Target{target("a"), target("c")}},
		gateway.ModelReasoning: {Targets: []routing.Target{target("c")}},
	}}))
	res, err := router.Complete(context.Background(), request("after the replace"))
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider, "a's circuit starts closed")
	require.True(t, router.Available(gateway.ModelReasoning))
	reasoning := request("reasoning now")
	reasoning.Model = gateway.ModelReasoning
	res, err = router.Complete(context.Background(), reasoning)
	require.NoError(t, err)
	require.Equal(t, "c", res.Route.Provider)
	serving, _ := router.Health()
	require.Equal(t, []gateway.Model{gateway.ModelInstant, gateway.ModelReasoning}, serving)

	done, ok := <-running
	require.True(t, ok, "the running call finished")
	require.Equal(t, "c", done.Route.Provider)
	require.Equal(t, 2, done.Route.Attempts, "on the routes it started with: a skipped (open), b refusing, then c")
	scrape := metricstest.Scrape(m)
	require.NotContains(t, scrape, `provider="b"`, "b is routed no more")
	require.Contains(t, scrape, `gateway_upstream_circuit_state{provider="a",upstream_model="a-model"} 0`)

	require.Error(t, router.Replace(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {}}}))
	require.True(t, router.Available(gateway.ModelReasoning), "a configuration that does not build changes nothing")
}

// TestReplacedRoutesCloseTheirConnections: the client of a route replaced
// closes the connections it keeps for the next call at once, and the one a
// call running on it uses when that call ends, over HTTP/1.1 and h2c,
// instead of keeping a provider routed no more connected until its idle time
// runs out; the new route's connection stays.
func TestReplacedRoutesCloseTheirConnections(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(map[bool]string{false: "http1", true: "h2c"}[h2c], func(t *testing.T) {
			t.Parallel()
			b := setup(t, routing.Config{})
			router, err := routing.New(b.onlyRoute("a", h2c))
			require.NoError(t, err)
			// A call, then two at once, leave two connections idle over
			// HTTP/1.1, one over h2c (every call shares the first).
			_, err = router.Complete(context.Background(), request("first"))
			require.NoError(t, err)
			b.fakes["a"].SetSlow("pair", 100*time.Millisecond)
			pair := make(chan error, 2)
			for range 2 {
				go func() {
					_, err := router.Complete(context.Background(), request("pair"))
					pair <- err
				}()
			}
			require.NoError(t, <-pair)
			require.NoError(t, <-pair)
			// Counted open, not dialed: over h2c, net/http may dial for a
			// call before the connection it dialed for the call before is
			// back in its pool (on a busy machine), and its HTTP/2 pool then
			// closes the new connection unused.
			conns := map[bool]int{false: 2, true: 1}[h2c]
			require.Eventually(t, func() bool { return b.fakes["a"].OpenConnections() == conns }, 5*time.Second, time.Millisecond)
			dialed := b.fakes["a"].Connections()

			b.fakes["a"].SetSlow("running", 2*time.Second)
			running := make(chan error, 1)
			go func() {
				_, err := router.Complete(context.Background(), request("running on a"))
				running <- err
			}()
			require.Eventually(t, func() bool { return b.calls("a") == 4 }, 5*time.Second, time.Millisecond)

			require.NoError(t, router.Replace(b.onlyRoute("b", h2c)))
			res, err := router.Complete(context.Background(), request("on b"))
			require.NoError(t, err)
			require.Equal(t, "b", res.Route.Provider)
			require.Eventually(t, func() bool { return b.fakes["a"].OpenConnections() == 1 }, 2*time.Second, time.Millisecond,
				"the idle connection closes at once, the running call's stays")
			require.NoError(t, <-running, "the call running on a finishes on its connection")
			require.Eventually(t, func() bool { return b.fakes["a"].OpenConnections() == 0 }, 5*time.Second, time.Millisecond,
				"a's last connection closes when its last call ends, an hour before its idle time would")
			require.Equal(t, dialed, b.fakes["a"].Connections(), "the running call used an idle connection")
			require.Equal(t, 1, b.fakes["b"].OpenConnections(), "the new route's connection is kept")
		})
	}
}

// TestReloadsRacingCallsLeaveOnlyTheLastRoutesConnected: routes replaced
// again and again while calls run on them: every call succeeds, and once
// they have ended only the last route's provider is still connected to.
func TestReloadsRacingCallsLeaveOnlyTheLastRoutesConnected(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	router, err := routing.New(b.onlyRoute("a", false))
	require.NoError(t, err)
	const callers, reloads = 4, 40
	done := make(chan struct{})
	errs := make(chan error, callers)
	for range callers {
		go func() {
			var err error
			for err == nil {
				select {
				case <-done:
					errs <- nil
					return
				default:
				}
				_, err = router.Complete(context.Background(), request("call"))
			}
			errs <- err
		}()
	}
	names := []string{"a", "b", "c"}
	for i := range reloads {
		require.NoError(t, router.Replace(b.onlyRoute(names[(i+1)%len(names)], false)))
		time.Sleep(time.Millisecond)
	}
	close(done)
	for range callers {
		require.NoError(t, <-errs)
	}
	last := names[reloads%len(names)]
	res, err := router.Complete(context.Background(), request("after the reloads"))
	require.NoError(t, err)
	require.Equal(t, last, res.Route.Provider)
	for _, name := range names {
		// The server sees a connection closed a moment after the client
		// closed it; the last route's client keeps one a caller at most.
		want := 0
		if name == last {
			want = callers
		}
		require.Eventually(t, func() bool { return b.fakes[name].OpenConnections() <= want }, 5*time.Second, time.Millisecond,
			"%s: at most %d connections stay open", name, want)
	}
}

// TestTargetsOfOneUpstreamModelShareACircuit: a provider's model serving two
// canonical models has one circuit: opened by one model's calls, it is
// skipped by the other's.
func TestTargetsOfOneUpstreamModelShareACircuit(t *testing.T) {
	t.Parallel()
	down := failing("p", fmt.Errorf("%w: no connection", upstream.ErrUnavailable))
	shared, backup := routing.Target{Provider: "a", UpstreamModel: "m", Client: down}, routing.Target{Provider: "b", UpstreamModel: "m", Client: &counting{}}
	r, err := routing.New(routing.Config{
		Routes: map[gateway.Model]routing.Route{
			gateway.ModelInstant:   {Targets: []routing.Target{shared}},
			gateway.ModelReasoning: {Targets: []routing.Target{shared, backup}},
		},
		Circuit: routing.CircuitConfig{Failures: 1, Cooldown: time.Hour},
	})
	require.NoError(t, err)
	_, err = r.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	req := request("p")
	req.Model = gateway.ModelReasoning
	res, err := r.Complete(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts, "a's circuit, opened by an instant call, is skipped")
	require.Equal(t, 1, down.calls())
}

// TestABrokenStreamIsAFailureAfterDispatch: a stream that broke before any
// output moves on to the next target unless the call is to reach one
// upstream at most, and counts as its tenant's own failure: a run of them
// holds off that tenant alone, which is logged and counted.
func TestABrokenStreamIsAFailureAfterDispatch(t *testing.T) {
	t.Parallel()
	broken := failing("POISON", fmt.Errorf("%w: the connection dropped", upstream.ErrStreamBroken))
	backup := &counting{}
	var log syncbuf.Buffer
	m := metrics.New()
	r, err := routing.New(routing.Config{
		Routes:  only(routing.Target{Provider: "a", UpstreamModel: "m", Client: broken}, routing.Target{Provider: "b", UpstreamModel: "m", Client: backup}),
		Circuit: routing.CircuitConfig{Failures: 2, Cooldown: time.Hour},
		Metrics: m,
		Logger:  slog.New(slog.NewJSONHandler(&log, nil)),
	})
	require.NoError(t, err)
	stream := func(req *upstream.Request) (upstream.Result, error) {
		return r.Stream(context.Background(), req, func(upstream.Delta) error { return nil })
	}
	poisoner, bystander := uuid.New(), uuid.New()
	req := request("POISON")
	req.Tenant = poisoner
	res, err := stream(req)
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	require.Equal(t, 2, res.Route.Attempts)

	req.AtMostOnce = true
	_, err = stream(req)
	require.ErrorIs(t, err, upstream.ErrStreamBroken)
	require.Equal(t, 1, backup.calls(), "a call to reach one upstream at most is not sent again")

	req = request("fine")
	req.Tenant = poisoner
	res, err = stream(req)
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider, "a holds off the poisoner after its two broken streams")
	req.Tenant = bystander
	res, err = stream(req)
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider, "and takes everyone else's calls")

	lines := logged(t, &log)
	require.Len(t, lines, 1)
	entry := lines[0]
	require.Equal(t, "WARN", entry["level"])
	require.Contains(t, entry["msg"], "holds off one account's calls")
	require.Equal(t, []any{"a", poisoner.String()}, []any{entry["provider"], entry["account_id"]})
	require.Contains(t, metricstest.Scrape(m), `gateway_upstream_tenant_holds_total{provider="a",upstream_model="m"} 1`)
}

// TestAnAnswerEndsARunOfFailures: a rejection of the request is an answer:
// like one, it ends the run of failures that opens a circuit.
func TestAnAnswerEndsARunOfFailures(t *testing.T) {
	t.Parallel()
	a := &counting{outcome: func(_ context.Context, req *upstream.Request) (upstream.Result, error) {
		switch req.Prompt {
		case "down":
			return upstream.Result{}, fmt.Errorf("%w: 503", upstream.ErrUnavailable)
		case "refused":
			return upstream.Result{}, &upstream.RejectedError{Status: http.StatusBadRequest, Message: "no"}
		}
		return answer, nil
	}}
	r, err := routing.New(routing.Config{
		Routes:  only(routing.Target{Provider: "a", UpstreamModel: "m", Client: a}, routing.Target{Provider: "b", UpstreamModel: "m", Client: &counting{}}),
		Circuit: routing.CircuitConfig{Failures: 2, Cooldown: time.Hour},
	})
	require.NoError(t, err)
	served := func(prompt string) string {
		res, _ := r.Complete(context.Background(), request(prompt))
		return res.Route.Provider
	}
	for _, between := range []string{"fine", "refused"} {
		require.Equal(t, "b", served("down"))
		require.Equal(t, "a", served(between))
		require.Equal(t, "b", served("down"))
		require.Equal(t, "a", served("fine"), "one failure, %s, one failure: a's circuit stays closed", between)
	}
	require.Equal(t, "b", served("down"))
	require.Equal(t, "b", served("down"))
	require.Equal(t, "b", served("fine"), "two failures in a row open it")
}

// TestACallerLeavingFreesTheProbe: a probe whose caller went away says
// nothing of the target: the next call probes it.
func TestACallerLeavingFreesTheProbe(t *testing.T) {
	t.Parallel()
	a := &counting{outcome: func(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
		switch req.Prompt {
		case "down":
			return upstream.Result{}, fmt.Errorf("%w: 503", upstream.ErrUnavailable)
		case "hang":
			<-ctx.Done()
			return upstream.Result{}, ctx.Err()
		}
		return answer, nil
	}}
	cooldown := 10 * time.Millisecond
	r, err := routing.New(routing.Config{
		Routes:  only(routing.Target{Provider: "a", UpstreamModel: "m", Client: a}),
		Circuit: routing.CircuitConfig{Failures: 1, Cooldown: cooldown, MaxCooldown: cooldown},
	})
	require.NoError(t, err)
	_, err = r.Complete(context.Background(), request("down"))
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	time.Sleep(2 * cooldown)

	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := r.Complete(ctx, request("hang"))
		left <- err
	}()
	require.Eventually(t, func() bool { return a.calls() == 2 }, 5*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-left, context.Canceled)

	res, err := r.Complete(context.Background(), request("fine"))
	require.NoError(t, err)
	require.Equal(t, "a", res.Route.Provider)
	require.Equal(t, 3, a.calls())
}

// TestACallerOutOfTimeIsSentNowhereElse: a call whose caller's deadline
// passed during an attempt ends there, on that target's outcome.
func TestACallerOutOfTimeIsSentNowhereElse(t *testing.T) {
	t.Parallel()
	b := setup(t, routing.Config{})
	b.fakes["a"].SetDelay(2 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	res, err := b.router.Complete(ctx, request("p"))
	require.Error(t, err)
	require.Equal(t, "a", res.Route.Provider)
	require.Equal(t, 1, res.Route.Attempts)
}

// TestCutRepliesAreReported: a reply that passed one of the gateway's bounds
// is logged for the operator, naming its target and the bound, and counted.
func TestCutRepliesAreReported(t *testing.T) {
	t.Parallel()
	var log syncbuf.Buffer
	m := metrics.New()
	long := &counting{outcome: func(context.Context, *upstream.Request) (upstream.Result, error) {
		return upstream.Result{Content: strings.Repeat("x", 1<<20), UsageReported: true}, nil
	}}
	r, err := routing.New(routing.Config{
		Routes:  only(routing.Target{Provider: "a", UpstreamModel: "m", Client: long}),
		Metrics: m,
		Logger:  slog.New(slog.NewJSONHandler(&log, nil)),
	})
	require.NoError(t, err)
	_, err = r.Complete(context.Background(), request("p"))
	require.ErrorIs(t, err, upstream.ErrFailed)
	lines := logged(t, &log)
	require.Len(t, lines, 1)
	entry := lines[0]
	require.Equal(t, "WARN", entry["level"])
	require.Contains(t, entry["msg"], "passed a bound")
	require.Equal(t, map[string]any{"provider": "a", "upstream_model": "m", "bound": "text"},
		map[string]any{"provider": entry["provider"], "upstream_model": entry["upstream_model"], "bound": entry["bound"]})
	require.Contains(t, metricstest.Scrape(m), `gateway_upstream_reply_cuts_total{bound="text",provider="a",upstream_model="m"} 1`)
}

// TestAttemptsAreCounted: each attempt is counted by its target and outcome
// and timed, a move to the next target is counted by model, and an answer
// without usage by its target.
func TestAttemptsAreCounted(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	unmetered := &counting{outcome: func(context.Context, *upstream.Request) (upstream.Result, error) {
		return upstream.Result{Content: "ok"}, nil
	}}
	r, err := routing.New(routing.Config{
		Routes: only(routing.Target{Provider: "a", UpstreamModel: "m", Client: failing("p", fmt.Errorf("%w: 503", upstream.ErrUnavailable))},
			routing.Target{Provider: "b", UpstreamModel: "m", Client: unmetered}),
		Metrics: m,
	})
	require.NoError(t, err)
	res, err := r.Complete(context.Background(), request("p"))
	require.NoError(t, err)
	require.Equal(t, "b", res.Route.Provider)
	scrape := metricstest.Scrape(m)
	for _, want := range []string{
		`gateway_upstream_attempts_total{outcome="unavailable",provider="a",upstream_model="m"} 1`,
		`gateway_upstream_attempts_total{outcome="ok",provider="b",upstream_model="m"} 1`,
		`gateway_upstream_attempt_duration_seconds_count{provider="a",upstream_model="m"} 1`,
		`gateway_upstream_fallbacks_total{model="instant"} 1`,
		`gateway_upstream_usage_unreported_total{provider="a",upstream_model="m"} 0`,
		`gateway_upstream_usage_unreported_total{provider="b",upstream_model="m"} 1`,
	} {
		require.Contains(t, scrape, want)
	}
}
