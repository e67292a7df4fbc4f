package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/upstream/tryout"
)

// routed is a gateway over two fake providers from a configuration file:
// instant goes to primary then backup, reasoning to primary only, elements to
// backup only. Connections to primary are kept idle for an hour; backup knows
// the output limit only as max_tokens.
type routed struct {
	*testBundle
	primary, backup *fakeupstream.Server
	g               *gateway
	file            string // GATEWAY_CONFIG
}

func serveRouted(t *testing.T, extra map[string]string) *routed {
	t.Helper()
	b := setup(t)
	backup := fakeupstream.New()
	t.Cleanup(backup.Close)
	file := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(`providers:
  primary:
    base_url: %s
    api_key_env: PRIMARY_KEY
    timeout: 2s
    idle_timeout: 1h
    headers:
      X-Tenant: acme
  backup:
    base_url: %s
    timeout: 2s
    max_tokens_field: max_tokens
models:
  instant:
    targets: [primary/p-instant, backup/b-instant]
  reasoning:
    targets: [primary/p-reasoning]
  elements:
    targets: [backup/b-elements]
circuit:
  failures: 3
  cooldown: 300ms
  max_cooldown: 1s
`, b.fake.BaseURL(), backup.BaseURL())), 0o600))
	env := map[string]string{"DATABASE_URL": b.db, "GATEWAY_CONFIG": file, "PRIMARY_KEY": "sk-primary"}
	for k, v := range extra {
		env[k] = v
	}
	return &routed{testBundle: b, primary: b.fake, backup: backup, g: start(t, env, "serve"), file: file}
}

// provider is the provider that served a response of model.
func (r *routed) provider(t *testing.T, model string) string {
	t.Helper()
	body := expect[api.Response](t, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "which target", "model": model}), http.StatusOK)
	return *body.Route.Provider
}

// TestSIGHUPReloadsTheRoutes: a replica sent SIGHUP serves the routes of its
// configuration file as it is now, from the next request on; a file that
// does not check changes nothing; neither stops the replica.
func TestSIGHUPReloadsTheRoutes(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	provider := func(model string) string { return r.provider(t, model) }
	reload := func(content, logged string) {
		require.NoError(t, os.WriteFile(r.file, []byte(content), 0o600))
		before := strings.Count(r.g.stderr.String(), logged)
		require.NoError(t, r.g.cmd.Process.Signal(syscall.SIGHUP))
		require.Eventually(t, func() bool { return strings.Count(r.g.stderr.String(), logged) == before+1 }, 10*time.Second, 20*time.Millisecond, logged)
	}
	require.Equal(t, "primary", provider("instant"))
	scrape := r.g.scrape()
	require.Contains(t, scrape, `gateway_upstream_circuit_state{provider="primary",upstream_model="p-instant"} 0`)
	require.Contains(t, scrape, "\ngateway_config_last_reload_successful 1\n", "the routes loaded at start")

	reload(fmt.Sprintf(`providers:
  primary:
    base_url: %s
    api_key_env: PRIMARY_KEY
  backup:
    base_url: %s
models:
  instant:
    targets: [backup/b-instant]
  reasoning:
    targets: [backup/b-reasoning]
`, r.primary.BaseURL(), r.backup.BaseURL()), "SIGHUP: routes reloaded")
	require.Equal(t, "backup", provider("instant"))
	require.Equal(t, "backup", provider("reasoning"))
	require.Eventually(t, func() bool { return r.primary.OpenConnections() == 0 }, 10*time.Second, 20*time.Millisecond,
		"primary, routed no more, is not kept connected for the hour of its idle_timeout")
	res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "p", "model": "elements"})
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Equal(t, "MODEL_UNAVAILABLE", res.code(t), "a model the file no longer routes")
	require.NotContains(t, r.g.scrape(), `provider="primary"`, "the targets no longer routed leave the metrics")

	reload("providers:\n  backup: {type: sim}\nmodels:\n  instant: {targets: [elsewhere/m]}\n", "SIGHUP: the configuration file was not loaded; the routes in use stay")
	require.Contains(t, r.g.stderr.String(), `names provider \"elsewhere\"`)
	require.Equal(t, "backup", provider("instant"), "the routes in use stay")
	require.Equal(t, "backup", provider("reasoning"))
	require.Contains(t, r.g.scrape(), "\ngateway_config_last_reload_successful 0\n")

	// A key kept in a file is read again: a rotated key is taken without a
	// restart.
	require.NoError(t, os.WriteFile(filepath.Join(filepath.Dir(r.file), "primary.key"), []byte("sk-rotated\n"), 0o600))
	reload(fmt.Sprintf("providers:\n  primary:\n    base_url: %s\n    api_key_file: primary.key\nmodels:\n  instant:\n    targets: [primary/p-instant]\n",
		r.primary.BaseURL()), "SIGHUP: routes reloaded")
	require.Equal(t, "primary", provider("instant"))
	calls := r.primary.Calls()
	require.Equal(t, "Bearer sk-rotated", calls[len(calls)-1].Header.Get("Authorization"))
	require.Contains(t, r.g.scrape(), "\ngateway_config_last_reload_successful 1\n")
}

// TestChangedFilesReloadTheRoutes: without a signal, a replica serves the
// routes of its configuration file once the file has changed (as a mounted
// ConfigMap changes), and takes a key file's new key once it has changed
// (as a mounted Secret does), within moments (config.FileCheck).
func TestChangedFilesReloadTheRoutes(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	require.Equal(t, "primary", r.provider(t, "instant"))
	keyFile := filepath.Join(filepath.Dir(r.file), "primary.key")
	require.NoError(t, os.WriteFile(keyFile, []byte("sk-first\n"), 0o600))
	require.NoError(t, os.WriteFile(r.file, []byte(fmt.Sprintf(`providers:
  primary: {base_url: %s, api_key_file: primary.key}
  backup: {base_url: %s}
models:
  instant: {targets: [backup/b-instant]}
  reasoning: {targets: [primary/p-reasoning]}
`, r.primary.BaseURL(), r.backup.BaseURL())), 0o600))
	require.Eventually(t, func() bool { return r.provider(t, "instant") == "backup" }, 20*time.Second, 100*time.Millisecond,
		"the file's routes, without a signal")
	logged := func() bool {
		return strings.Contains(r.g.stderr.String(), "the configuration's files changed: routes reloaded")
	}
	require.Eventually(t, logged, 10*time.Second, 20*time.Millisecond, "the replica's log lines go out in groups, after the reload")
	lastKey := func() string {
		require.Equal(t, "primary", r.provider(t, "reasoning"))
		calls := r.primary.Calls()
		return calls[len(calls)-1].Header.Get("Authorization")
	}
	require.Equal(t, "Bearer sk-first", lastKey())

	require.NoError(t, os.WriteFile(keyFile, []byte("sk-second\n"), 0o600))
	require.Eventually(t, func() bool { return lastKey() == "Bearer sk-second" }, 20*time.Second, 100*time.Millisecond,
		"the key file's new key, the configuration file unchanged")
}

// TestSIGHUPWithoutAConfigurationFile: routes from the environment cannot be
// read again; a SIGHUP says so and stops nothing.
func TestSIGHUPWithoutAConfigurationFile(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	require.NoError(t, g.cmd.Process.Signal(syscall.SIGHUP))
	require.Eventually(t, func() bool { return strings.Contains(g.stderr.String(), "nothing was reloaded") }, 10*time.Second, 20*time.Millisecond)
	res := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "still serving"})
	require.Equal(t, http.StatusOK, res.status, string(res.body))
}

func TestFallbackAcrossProviders(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	var got received

	r.primary.SetMode(fakeupstream.Down)
	body := expect[api.Response](t, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "fall back please"}), http.StatusOK)
	require.Equal(t, fakeupstream.Reply("fall back please"), body.Content)
	require.Equal(t, "backup", *body.Route.Provider)
	require.Equal(t, "b-instant", *body.Route.UpstreamModel)
	require.Equal(t, 2, *body.Route.Attempts)
	got.add(rungs(body.Usage))
	primaryCall := r.primary.Calls()[0]
	require.Equal(t, "p-instant", primaryCall.Model)
	require.Equal(t, "Bearer sk-primary", primaryCall.Header.Get("Authorization"), "the key comes from the variable the file names")
	require.Equal(t, "acme", primaryCall.Header.Get("X-Tenant"), "the provider's headers from the file")
	backupCall := r.backup.Calls()[0]
	require.Empty(t, backupCall.Header.Get("Authorization"))
	require.Empty(t, backupCall.Header.Get("X-Tenant"), "another provider's headers are its own")
	require.Equal(t, [2]uint64{32000, 0}, [2]uint64{primaryCall.MaxCompletionTokens, primaryCall.MaxTokens}, "the output limit as OpenAI names it")
	require.Equal(t, [2]uint64{0, 32000}, [2]uint64{backupCall.MaxCompletionTokens, backupCall.MaxTokens}, "as the backup's file says it knows it")

	// A stream falls back before its first byte.
	r.primary.SetMode(fakeupstream.Down)
	_, s := r.g.stream(r.key, map[string]any{"prompt": "stream fall back"})
	require.Equal(t, "response.completed", names(s)[len(s.Events)-1])
	require.NotContains(t, names(s), "response.error")
	got.add(finalUsage(t, s.Events[len(s.Events)-1].Data))

	// A model whose only target is down: INFERENCE_BUSY, nothing billed.
	res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "think", "model": "reasoning"})
	require.Equal(t, http.StatusServiceUnavailable, res.status)
	require.Equal(t, "INFERENCE_BUSY", res.code(t))

	// A rejection is not sent elsewhere.
	r.primary.SetMode(fakeupstream.Reject)
	backupCalls := len(r.backup.Calls())
	res = r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "rejected"})
	require.Equal(t, http.StatusServiceUnavailable, res.status)
	require.Contains(t, string(res.body), "content policy violation")
	require.Len(t, r.backup.Calls(), backupCalls)

	// Once output reached the caller, a failure is the stream's: no fallback.
	r.primary.SetMode(fakeupstream.OK)
	r.primary.SetBreakAfter(2)
	_, s = r.g.stream(r.key, map[string]any{"prompt": "one two three four five"})
	require.Contains(t, names(s), "response.error")
	require.Len(t, r.backup.Calls(), backupCalls)
	got.add(finalUsage(t, s.Events[len(s.Events)-1].Data))

	settledExactly(t, r.g, r.key, got)

	metrics := r.g.scrape()
	require.Contains(t, metrics, `gateway_upstream_attempts_total{outcome="unavailable",provider="primary",upstream_model="p-instant"}`)
	require.Contains(t, metrics, `gateway_upstream_attempts_total{outcome="ok",provider="backup",upstream_model="b-instant"} 2`)
	require.Contains(t, metrics, `gateway_upstream_fallbacks_total{model="instant"} 2`)
	require.Contains(t, metrics, `gateway_upstream_circuit_state{provider="backup",upstream_model="b-instant"} 0`)
}

// TestCircuitSkipsADownTarget: after three failures the primary is skipped
// (its circuit is open) until a probe finds it back.
func TestCircuitSkipsADownTarget(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	r.primary.SetMode(fakeupstream.Down)
	for i := range 6 {
		res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": fmt.Sprintf("p%d", i)})
		require.Equal(t, http.StatusOK, res.status)
	}
	require.Len(t, r.primary.Calls(), 3, "the circuit opened after three failures")
	require.Contains(t, r.g.scrape(), `gateway_upstream_circuit_state{provider="primary",upstream_model="p-instant"} 2`)

	r.primary.SetMode(fakeupstream.OK)
	require.Eventually(t, func() bool {
		body := expect[api.Response](t, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "probe"}), http.StatusOK)
		return *body.Route.Provider == "primary"
	}, 10*time.Second, 50*time.Millisecond, "a probe closes the circuit")
}

// TestBatchDrainsThroughTheSecondTarget: the first target refuses
// connections; every item runs once, on the second.
func TestBatchDrainsThroughTheSecondTarget(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	r.primary.Close()
	batch := r.g.createBatch(r.key, prompts("drain", 20))
	res := r.g.waitTerminal(r.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
		require.Equal(t, api.UpstreamRoute{Provider: "backup", UpstreamModel: "b-instant", Attempts: it.Route.Attempts}, *it.Route)
		require.Contains(t, []int{1, 2}, it.Route.Attempts, "tried the primary, or skipped it once its circuit opened")
	}
	atMostOnce(t, r.backup, "drain")
	require.Len(t, callsPerPrompt(r.backup), 20)
	require.Equal(t, sumItems(res), r.g.usage(r.key).Totals.TotalRungs)
}

// TestOtherModelsDrainWhileOneHasNoTarget: reasoning's only target is down;
// instant and elements items keep draining, and reasoning's wait (unfailed)
// until it is back.
func TestOtherModelsDrainWhileOneHasNoTarget(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	r.primary.SetMode(fakeupstream.Down)
	reasoning := prompts("deep", 10)
	for _, p := range reasoning {
		p["model"] = "reasoning"
	}
	stuck := r.g.createBatch(r.key, reasoning)
	elements := prompts("elem", 10)
	for _, p := range elements {
		p["model"] = "elements"
	}
	flowing := r.g.createBatch(r.key, append(elements, prompts("inst", 10)...))
	done := r.g.waitTerminal(r.key, flowing.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), done.Status)
	for _, it := range r.g.results(r.key, stuck.Id.String()).Results {
		require.Contains(t, []api.BatchItemStatus{"queued", "in_progress"}, it.Status, "an outage fails nothing")
	}
	require.Positive(t, len(r.primary.Calls()), "the reasoning target was probed")
	// Its items are not claimed only to be handed back: the first ones
	// failed, then one probe at a time (cool-downs of 0.3 s growing to 1 s).
	requeued := metricValue(t, r.g.scrape(), `gateway_batch_items_total{outcome="requeued"}`)
	require.Less(t, requeued, 40.0, "items of a model with no target taking calls stay in the queue")

	r.primary.SetMode(fakeupstream.OK)
	res := r.g.waitTerminal(r.key, stuck.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, "primary", it.Route.Provider)
	}
	atMostOnce(t, r.backup, "elem")
	atMostOnce(t, r.backup, "inst")
	require.Equal(t, sumItems(done, res), r.g.usage(r.key).Totals.TotalRungs, "billed once")
}

// TestADeniedKeyIsAnOutageForTheOperator: the primary refuses the gateway's
// key (401). Requests fall back to the backup; a model with no other target
// is INFERENCE_BUSY without the upstream's message; its batch items wait in
// the queue, none failed, and run once the key is mended, billed once; the
// operator is told in the log and the metrics.
func TestADeniedKeyIsAnOutageForTheOperator(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, nil)
	r.primary.SetStatus(http.StatusUnauthorized)

	body := expect[api.Response](t, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "falls back"}), http.StatusOK)
	require.Equal(t, "backup", *body.Route.Provider)

	res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "think", "model": "reasoning"})
	require.Equal(t, http.StatusServiceUnavailable, res.status)
	require.Equal(t, "INFERENCE_BUSY", res.code(t))
	require.NotEmpty(t, res.header.Get("Retry-After"))
	require.NotContains(t, string(res.body), "401", "the upstream's refusal is the operator's business")

	items := prompts("denied", 10)
	for _, p := range items {
		p["model"] = "reasoning"
	}
	batch := r.g.createBatch(r.key, items)
	deniedCalls := func() (n int) {
		for p, calls := range callsPerPrompt(r.primary) {
			if strings.HasPrefix(p, "denied") {
				n += calls
			}
		}
		return n
	}
	require.Eventually(t, func() bool { return deniedCalls() >= 3 }, 10*time.Second, 20*time.Millisecond, "the drainer probes the primary")
	for _, it := range r.g.results(r.key, batch.Id.String()).Results {
		require.Contains(t, []api.BatchItemStatus{"queued", "in_progress"}, it.Status, "a refused key fails no item")
	}
	require.Contains(t, r.g.stderr.String(), "refused the gateway's access")
	require.Positive(t, metricValue(t, r.g.scrape(), `gateway_upstream_attempts_total{outcome="denied",provider="primary",upstream_model="p-reasoning"}`))

	r.primary.SetStatus(0)
	done := r.g.waitTerminal(r.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), done.Status)
	for _, it := range done.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
	}
	require.Equal(t, body.Usage.TotalRungs+sumItems(done), r.g.usage(r.key).Totals.TotalRungs, "billed once")
}

// otlpReceiver is an in-process OTLP/HTTP trace receiver.
type otlpReceiver struct {
	mu       sync.Mutex
	spans    []*tracepb.Span
	services map[string]bool // the service.name of the resources exported
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	raw, err := io.ReadAll(r.Body)
	var req collectortrace.ExportTraceServiceRequest
	if err != nil || r.URL.Path != "/v1/traces" || proto.Unmarshal(raw, &req) != nil {
		http.Error(w, "bad export", http.StatusBadRequest)
		return
	}
	o.mu.Lock()
	for _, rs := range req.ResourceSpans {
		for _, a := range rs.GetResource().GetAttributes() {
			if a.Key == "service.name" {
				if o.services == nil {
					o.services = map[string]bool{}
				}
				o.services[a.Value.GetStringValue()] = true
			}
		}
		for _, ss := range rs.ScopeSpans {
			o.spans = append(o.spans, ss.Spans...)
		}
	}
	o.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

// serveTraced is serveRouted exporting its spans (flushed every 50 ms) to an
// in-process OTLP/HTTP receiver.
func serveTraced(t *testing.T, extra map[string]string) (*routed, *otlpReceiver) {
	t.Helper()
	receiver := &otlpReceiver{}
	collector := httptest.NewServer(receiver)
	t.Cleanup(collector.Close)
	env := map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": collector.URL, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50",
	}
	for k, v := range extra {
		env[k] = v
	}
	return serveRouted(t, env), receiver
}

func (o *otlpReceiver) named(name string) []*tracepb.Span {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range o.spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s *tracepb.Span, key string) *commonpb.AnyValue {
	for _, a := range s.Attributes {
		if a.Key == key {
			return a.Value
		}
	}
	return nil
}

// TestTracesFollowTheRequest: a request carrying a traceparent yields a server
// span in that trace with a client span per upstream attempt, GenAI attributes
// on both, and the trace context sent upstream; no prompt text; the service
// named gateway. A request every target fails has its failure's kind on its
// span; one refused for its own fault (400) is not marked failed.
func TestTracesFollowTheRequest(t *testing.T) {
	t.Parallel()
	r, receiver := serveTraced(t, map[string]string{"GATEWAY_TRUSTED_PROXIES": "127.0.0.1"})
	r.primary.SetMode(fakeupstream.Down)
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	res := r.g.callWith(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "secret prompt text"},
		http.Header{"Traceparent": {"00-" + traceID + "-" + parentID + "-01"}, "X-Forwarded-For": {"198.51.100.7"}})
	require.Equal(t, http.StatusOK, res.status)

	var server *tracepb.Span
	require.Eventually(t, func() bool {
		spans := receiver.named("POST /api/v1/responses")
		if len(spans) == 1 {
			server = spans[0]
		}
		return server != nil && len(receiver.named("chat b-instant")) == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, traceID, fmt.Sprintf("%x", server.TraceId), "the caller's trace continues")
	require.Equal(t, parentID, fmt.Sprintf("%x", server.ParentSpanId))
	require.Equal(t, tracepb.Span_SPAN_KIND_SERVER, server.Kind)
	require.Equal(t, "198.51.100.7", attr(server, "client.address").GetStringValue(), "the client the trusted proxy names")
	require.Equal(t, "chat", attr(server, "gen_ai.operation.name").GetStringValue())
	require.Equal(t, "instant", attr(server, "gen_ai.request.model").GetStringValue())
	require.Equal(t, int64(http.StatusOK), attr(server, "http.response.status_code").GetIntValue())
	require.Equal(t, res.object(t)["request_id"], attr(server, "gateway.request_id").GetStringValue())
	call := r.backup.Calls()[0]
	require.Equal(t, int64(max(call.MaxCompletionTokens, call.MaxTokens)), attr(server, "gen_ai.request.max_tokens").GetIntValue(), "the output ceiling sent")
	pt, ct := fakeupstream.Usage("secret prompt text")
	require.Equal(t, int64(pt), attr(server, "gen_ai.usage.input_tokens").GetIntValue())
	require.Equal(t, int64(ct), attr(server, "gen_ai.usage.output_tokens").GetIntValue())

	failed, answered := receiver.named("chat p-instant")[0], receiver.named("chat b-instant")[0]
	for i, s := range []*tracepb.Span{failed, answered} {
		require.Equal(t, server.SpanId, s.ParentSpanId, "attempts are children of the request")
		require.Equal(t, tracepb.Span_SPAN_KIND_CLIENT, s.Kind)
		require.Equal(t, int64(i+1), attr(s, "gateway.attempt").GetIntValue())
	}
	require.Equal(t, "primary", attr(failed, "gen_ai.system").GetStringValue())
	require.Equal(t, "unavailable", attr(failed, "error.type").GetStringValue())
	require.Equal(t, tracepb.Status_STATUS_CODE_ERROR, failed.Status.Code)
	require.Equal(t, "backup", attr(answered, "gen_ai.system").GetStringValue())
	require.Equal(t, "b-instant", attr(answered, "gen_ai.response.model").GetStringValue())
	require.Equal(t, int64(pt), attr(answered, "gen_ai.usage.input_tokens").GetIntValue())

	require.Eventually(t, func() bool { return len(receiver.named("settle usage")) == 1 }, 10*time.Second, 50*time.Millisecond)
	settled := receiver.named("settle usage")[0]
	require.Equal(t, server.SpanId, settled.ParentSpanId, "the settlement is a child of the request")
	require.Equal(t, tracepb.Span_SPAN_KIND_INTERNAL, settled.Kind)
	require.NotEqual(t, tracepb.Status_STATUS_CODE_ERROR, settled.GetStatus().GetCode(), "stored")
	require.GreaterOrEqual(t, settled.StartTimeUnixNano, answered.EndTimeUnixNano, "settled once the upstream answered")
	require.LessOrEqual(t, settled.EndTimeUnixNano, server.EndTimeUnixNano, "settled before the reply")

	// A request every target fails: its span says how.
	r.backup.SetMode(fakeupstream.Down)
	require.NotEqual(t, http.StatusOK, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "down"}).status)
	var refused *tracepb.Span
	require.Eventually(t, func() bool {
		for _, s := range receiver.named("POST /api/v1/responses") {
			if !bytes.Equal(s.SpanId, server.SpanId) {
				refused = s
			}
		}
		return refused != nil
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, "unavailable", attr(refused, "error.type").GetStringValue())
	require.Equal(t, tracepb.Status_STATUS_CODE_ERROR, refused.Status.Code)

	// A request refused for its own fault is no error of the server's.
	require.Equal(t, http.StatusBadRequest, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": ""}).status)
	var invalid *tracepb.Span
	require.Eventually(t, func() bool {
		for _, s := range receiver.named("POST /api/v1/responses") {
			if attr(s, "http.response.status_code").GetIntValue() == http.StatusBadRequest {
				invalid = s
			}
		}
		return invalid != nil
	}, 10*time.Second, 50*time.Millisecond)
	require.NotEqual(t, tracepb.Status_STATUS_CODE_ERROR, invalid.GetStatus().GetCode())

	sent := r.backup.Calls()[0].Header.Get("Traceparent")
	require.Equal(t, "00-"+traceID+"-"+fmt.Sprintf("%x", answered.SpanId)+"-01", sent, "the attempt's context goes upstream")
	receiver.mu.Lock()
	defer receiver.mu.Unlock()
	for _, s := range receiver.spans {
		for _, a := range s.Attributes {
			require.NotContains(t, a.Value.GetStringValue(), "secret prompt", "no prompt text in spans unless opted in")
		}
	}
	require.Equal(t, map[string]bool{"gateway": true}, receiver.services, "the service's name unless OTEL_SERVICE_NAME says otherwise")
}

// TestSettlementCommitTraces: the transactions that store requests' usage
// together have spans of their own, linked to the settlement span of every
// request they store, each request's commit within its wait.
func TestSettlementCommitTraces(t *testing.T) {
	t.Parallel()
	r, receiver := serveTraced(t, nil)
	const n = 8
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": fmt.Sprintf("settle together %d", i)})
			require.Equal(t, http.StatusOK, res.status)
		})
	}
	wg.Wait()

	settles, commits := receiver.awaitCommits(t, "settle usage", "commit settlements", "gateway.requests", n)
	for _, c := range commits {
		require.NotEqual(t, tracepb.Status_STATUS_CODE_ERROR, c.GetStatus().GetCode())
		for _, l := range c.Links {
			settled := settles[spanKey(l.TraceId, l.SpanId)]
			require.GreaterOrEqual(t, c.EndTimeUnixNano, settled.StartTimeUnixNano)
			require.LessOrEqual(t, c.EndTimeUnixNano, settled.EndTimeUnixNano, "a request's settlement ends once its commit has")
		}
	}
}

// TestARefusedSettlementFailsItsSpans: a request whose usage the database
// refuses (a trigger here refuses its model's rows) has its settlement span
// failed as refused and the commit that tried to store it failed as the
// store's; a request stored beside it has neither.
func TestARefusedSettlementFailsItsSpans(t *testing.T) {
	t.Parallel()
	r, receiver := serveTraced(t, nil)
	pool := testdb.Connect(t, r.db)
	_, err := pool.Exec(context.Background(), `CREATE FUNCTION refuse_elements() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN IF NEW.model = 'elements' THEN RAISE EXCEPTION 'no elements here'; END IF; RETURN NEW; END $$;
		CREATE TRIGGER refuse_elements BEFORE INSERT ON requests FOR EACH ROW EXECUTE FUNCTION refuse_elements()`)
	require.NoError(t, err)

	res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "refused", "model": "elements"})
	require.Equal(t, http.StatusInternalServerError, res.status, string(res.body))
	require.Equal(t, http.StatusOK, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "stored"}).status)

	var settles, commits []*tracepb.Span
	require.Eventually(t, func() bool {
		settles, commits = receiver.named("settle usage"), receiver.named("commit settlements")
		return len(settles) == 2 && len(commits) == 2
	}, 10*time.Second, 50*time.Millisecond)
	failed := map[string]string{}
	for _, s := range append(settles, commits...) {
		if s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR {
			failed[s.Name] = attr(s, "error.type").GetStringValue()
		}
	}
	require.Equal(t, map[string]string{"settle usage": "refused", "commit settlements": "store"}, failed,
		"one settlement and its commit failed, the other request's stored")
}

// awaitCommits waits until n spans named name have arrived, each linked from
// a span named commit, and checks every such commit span: a trace of its own,
// internal, linking only to spans named name, its count attribute summing to
// n over them all. It returns the spans named name by spanKey, and the
// commits.
func (o *otlpReceiver) awaitCommits(t *testing.T, name, commit, count string, n int) (map[string]*tracepb.Span, []*tracepb.Span) {
	t.Helper()
	var spans, commits []*tracepb.Span
	require.Eventually(t, func() bool {
		spans, commits = o.named(name), o.named(commit)
		linked := 0
		for _, c := range commits {
			linked += len(c.Links)
		}
		return len(spans) == n && linked == n
	}, 10*time.Second, 50*time.Millisecond, "%d %q spans, each linked from a %q span", n, name, commit)
	byKey := map[string]*tracepb.Span{}
	for _, s := range spans {
		byKey[spanKey(s.TraceId, s.SpanId)] = s
	}
	counted := int64(0)
	for _, c := range commits {
		require.Empty(t, c.ParentSpanId, "a commit is a trace of its own")
		require.Equal(t, tracepb.Span_SPAN_KIND_INTERNAL, c.Kind)
		counted += attr(c, count).GetIntValue()
		for _, l := range c.Links {
			require.Contains(t, byKey, spanKey(l.TraceId, l.SpanId), "a commit links to the %q spans whose work it stores", name)
		}
	}
	require.Equal(t, int64(n), counted)
	return byKey, commits
}

func spanKey(traceID, spanID []byte) string { return fmt.Sprintf("%x/%x", traceID, spanID) }

// TestBatchItemTraces: each batch item has a span of its own (a consumer
// span with its batch and index) with its upstream attempt as a child, and
// the transactions that store the outcomes have spans linked to every item's.
func TestBatchItemTraces(t *testing.T) {
	t.Parallel()
	r, receiver := serveTraced(t, nil)
	batch := r.g.createBatch(r.key, prompts("traced", 3))
	done := r.g.waitTerminal(r.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), done.Status)

	items, _ := receiver.awaitCommits(t, "chat instant", "commit batch outcomes", "gateway.batch_items", 3)
	indexes := map[int64]bool{}
	for _, it := range items {
		require.Equal(t, tracepb.Span_SPAN_KIND_CONSUMER, it.Kind)
		require.Equal(t, batch.Id.String(), attr(it, "gateway.batch_id").GetStringValue())
		indexes[attr(it, "gateway.batch_index").GetIntValue()] = true
		attempts := 0
		for _, a := range receiver.named("chat p-instant") {
			if string(a.ParentSpanId) == string(it.SpanId) {
				attempts++
			}
		}
		require.Equal(t, 1, attempts, "the upstream attempt is the item's child")
	}
	require.Equal(t, map[int64]bool{0: true, 1: true, 2: true}, indexes)
}

// TestTraceContentWhenOptedIn: GATEWAY_TRACE_CONTENT puts the prompt and the
// output in the request's span, as GenAI messages.
func TestTraceContentWhenOptedIn(t *testing.T) {
	t.Parallel()
	r, receiver := serveTraced(t, map[string]string{"GATEWAY_TRACE_CONTENT": "true"})
	res := r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "visible prompt", "custom_instructions": "be brief"})
	require.Equal(t, http.StatusOK, res.status)
	require.Eventually(t, func() bool { return len(receiver.named("POST /api/v1/responses")) == 1 }, 10*time.Second, 50*time.Millisecond)
	span := receiver.named("POST /api/v1/responses")[0]
	require.JSONEq(t, `[{"role":"system","parts":[{"type":"text","content":"be brief"}]},{"role":"user","parts":[{"type":"text","content":"visible prompt"}]}]`,
		attr(span, "gen_ai.input.messages").GetStringValue())
	require.JSONEq(t, `[{"role":"assistant","parts":[{"type":"text","content":"`+fakeupstream.Reply("visible prompt")+`"}]}]`,
		attr(span, "gen_ai.output.messages").GetStringValue())
}

// TestACollectorAwayIsAWarning: spans whose export fails (the collector not
// listening) are counted and a warning in the replica's log, in its format,
// and the requests are served as before.
func TestACollectorAwayIsAWarning(t *testing.T) {
	t.Parallel()
	r := serveRouted(t, map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50", // nothing listens
	})
	expect[api.Response](t, r.g.call(http.MethodPost, "/api/v1/responses", r.key, map[string]any{"prompt": "traced nowhere"}), http.StatusOK)
	waitForLine(t, r.g.stderr, `"level":"WARN","msg":"error exporting traces; the spans of the export are lost","error":"traces export: `)
	require.Positive(t, metricValue(t, r.g.scrape(), "gateway_trace_export_failures_total"), "counted")
	for _, line := range strings.Split(strings.TrimSpace(r.g.stderr.String()), "\n") {
		require.True(t, json.Valid([]byte(line)), "a line not in the log's format: %s", line)
	}
}

// TestConfigCheck: the operator's check names each problem's line.
func TestConfigCheck(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("providers:\n  local: {type: sim}\nmodels:\n  instant: {targets: [local/tiny]}\n"), 0o600))
	out, err := cli(t, "", "config", "check", good)
	require.NoError(t, err)
	require.Equal(t, "instant   ordered: local/tiny\nreasoning not served\nelements  not served\n", out)

	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("providers:\n  local: {type: sim}\nmodels:\n  instant: {targets: [remote/tiny]}\n"), 0o600))
	_, err = cli(t, "", "config", "check", bad)
	require.ErrorContains(t, err, `bad.yaml:4: model instant: target "remote/tiny" names provider "remote"`)
}

// TestConfigCheckCalls: with --call, the check calls each target once whole
// and once streamed, and says how each answered (what, with what usage, or
// why not); a target that fails a call makes it exit non-zero. The calls
// reach the upstream, once a target and kind. Without a file, it checks the
// environment's routes, the shorthand's here.
func TestConfigCheckCalls(t *testing.T) {
	t.Parallel()
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	down := fakeupstream.New()
	down.Close()
	file := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(`providers:
  up: {base_url: %q}
  quiet: {base_url: %q, stream_options: false}
  gone: {base_url: %q}
models:
  instant: {targets: [up/small]}
  reasoning: {targets: [up/small, gone/big]}
  elements: {targets: [quiet/small]}
`, fake.BaseURL(), fake.BaseURL(), down.BaseURL())), 0o600))

	out, err := cli(t, "", "config", "check", "--call", file)
	require.ErrorContains(t, err, "1 of 3 targets failed a call")
	reply := regexp.QuoteMeta(strconv.Quote(fakeupstream.Reply(tryout.Prompt)))
	pt, ct := fakeupstream.Usage(tryout.Prompt)
	usage := fmt.Sprintf("usage %d in, %d out", pt, ct)
	require.Regexp(t, `(?m)^up/small \(instant, reasoning\)
  whole:    ok in [0-9.]+ ms: `+reply+`, `+usage+`
  streamed: ok in [0-9.]+ ms, first output after [0-9.]+ ms: `+reply+`, `+usage+`
gone/big \(reasoning\)
  whole:    failed after [0-9.]+ ms: .+
  streamed: failed after [0-9.]+ ms: .+
quiet/small \(elements\)
  whole:    ok in [0-9.]+ ms: `+reply+`, `+usage+`
  streamed: ok in [0-9.]+ ms, first output after [0-9.]+ ms: `+reply+`, no usage reported \(billed from the gateway's tokenizer\)
$`, out)
	calls := fake.Calls()
	require.Len(t, calls, 4, "a whole call and a streamed one, of each target that answers")
	for _, c := range calls {
		require.Equal(t, tryout.Prompt, c.Prompt)
		require.Equal(t, "small", c.Model)
	}

	// Without a file, the environment's routes: here the shorthand's.
	out, err = cliWith(t, map[string]string{"GATEWAY_UPSTREAM": fake.BaseURL(), "GATEWAY_MODEL_MAP": "instant=small"}, "config", "check", "--call")
	require.NoError(t, err)
	require.Regexp(t, `(?m)^upstream/small \(instant\)
  whole:    ok in [0-9.]+ ms: `+reply+`, `+usage+`
  streamed: ok in [0-9.]+ ms, first output after [0-9.]+ ms: `+reply+`, `+usage+`
$`, out)
	require.Len(t, fake.Calls(), 6)
}

// metricValue is the value of one sample of a scrape; zero when absent.
func metricValue(t *testing.T, scrape, sample string) float64 {
	t.Helper()
	for _, line := range strings.Split(scrape, "\n") {
		if rest, ok := strings.CutPrefix(line, sample+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			require.NoError(t, err)
			return v
		}
	}
	return 0
}

// TestOneAccountsFailingPromptsHoldOffOnlyItsCalls: prompts of one account's
// that make the upstream fail (500, after dispatch) hold off that account's
// calls once three have failed: INFERENCE_BUSY with a Retry-After, the
// upstream not called, its batch items left queued (not failed). Another
// account's requests, streams and batch are served meanwhile, by the same
// target, whose circuit stays closed.
func TestOneAccountsFailingPromptsHoldOffOnlyItsCalls(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bystander := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "bystander"))
	b.fake.SetHostile("POISON", fakeupstream.Hostile{Status: http.StatusInternalServerError})
	file := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(`providers:
  only:
    base_url: %s
models:
  instant:
    targets: [only/o-instant]
circuit:
  failures: 3
  cooldown: 1m
  max_cooldown: 1m
`, b.fake.BaseURL())), 0o600))
	g := start(t, map[string]string{"DATABASE_URL": b.db, "GATEWAY_CONFIG": file}, "serve")
	respond := func(key, prompt string) reply {
		return g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": prompt, "model": "instant"})
	}

	for range 3 {
		r := respond(b.key, "POISON")
		require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
		require.Equal(t, "INFERENCE_BUSY", r.code(t))
	}
	sent := len(b.fake.Calls())
	r := respond(b.key, "a fine prompt")
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	require.Contains(t, string(r.body), "this account's last requests failed")
	require.NotEmpty(t, r.header.Get("Retry-After"))
	_, s := g.stream(b.key, map[string]any{"prompt": "a fine stream", "model": "instant"})
	require.Equal(t, []string{"response.error"}, names(s))
	held := g.createBatch(b.key, prompts("fine", 3))
	require.Equal(t, sent, len(b.fake.Calls()), "nothing of the held account's reached the upstream")

	var theirs received
	theirs.add(rungs(expect[api.Response](t, respond(bystander, "a fine prompt"), http.StatusOK).Usage))
	sr, s := g.stream(bystander, map[string]any{"prompt": "a fine stream", "model": "instant"})
	require.Equal(t, "response.completed", names(s)[len(s.Events)-1])
	theirs.add(finalUsage(t, sr.body))
	done := g.waitTerminal(bystander, g.createBatch(bystander, prompts("clean", 5)).Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), done.Status)
	theirs.items(done)
	scrape := g.scrape()
	require.Contains(t, scrape, `gateway_upstream_circuit_state{provider="only",upstream_model="o-instant"} 0`)
	require.Contains(t, scrape, `gateway_upstream_tenant_holds_total{provider="only",upstream_model="o-instant"} 1`)
	require.Contains(t, waitForLine(t, g.stderr, "holds off one account's calls"), `"account_id":"`)

	// The drainer learns of the hold from its first try of the held
	// account's items, which it hands back: until then one may be claimed.
	require.Eventually(t, func() bool {
		for _, it := range g.results(b.key, held.Id.String()).Results {
			if it.Status != api.BatchItemStatus("queued") {
				return false
			}
		}
		return true
	}, 10*time.Second, 20*time.Millisecond, "the held account's items wait")
	require.Len(t, b.fake.Calls(), sent+1+1+5, "since the hold, only the bystander's calls were sent")

	// The ledgers: the bystander's is what it received; the held account,
	// its waiting batch cancelled, was billed nothing for the calls that
	// failed or were held off.
	settledExactly(t, g, bystander, theirs)
	c := g.call(http.MethodPost, "/api/v1/batch/"+held.Id.String()+"/cancel", b.key, nil)
	require.Equal(t, http.StatusOK, c.status, string(c.body))
	settledExactly(t, g, b.key, received{})
}
