package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/access"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/ledger"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// scripted is an upstream whose answer the test sets.
type scripted struct {
	mu    sync.Mutex
	err   error
	calls []upstream.Request
	// Streams: wait firstDelay before the first piece; break with
	// ErrStreamBroken after breakAfter pieces; or, with hang, stop after the first
	// piece until the caller goes away (Complete: answer nothing until then).
	firstDelay time.Duration
	breakAfter int
	breakWith  error // what a break returns; ErrStreamBroken when nil
	hang       bool
}

// streamPieces is what a scripted stream sends for a prompt.
func streamPieces(prompt string) []string { return []string{"answer ", "to ", prompt} }

func (s *scripted) Stream(ctx context.Context, req *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	s.mu.Lock()
	s.calls = append(s.calls, *req)
	err, firstDelay, breakAfter, breakWith, hang := s.err, s.firstDelay, s.breakAfter, s.breakWith, s.hang
	if breakWith == nil {
		breakWith = upstream.ErrStreamBroken
	}
	s.mu.Unlock()
	if err != nil {
		return upstream.Result{}, err
	}
	select {
	case <-time.After(firstDelay):
	case <-ctx.Done():
		return upstream.Result{}, ctx.Err()
	}
	whole := answer(req)
	var sent upstream.Result
	for i, piece := range streamPieces(req.Prompt) {
		if breakAfter > 0 && i == breakAfter {
			return sent, breakWith
		}
		d := upstream.Delta{Content: piece}
		if i == 0 {
			d.Sources = whole.Sources
			sent.Sources = whole.Sources
		}
		if err := emit(d); err != nil {
			return sent, err
		}
		sent.Content += piece
		if hang {
			<-ctx.Done()
			return sent, ctx.Err()
		}
	}
	return whole, nil
}

func (s *scripted) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	s.mu.Lock()
	s.calls = append(s.calls, *req)
	err, hang := s.err, s.hang
	s.mu.Unlock()
	if err != nil {
		return upstream.Result{}, err
	}
	if hang {
		<-ctx.Done()
		return upstream.Result{}, ctx.Err()
	}
	return answer(req), nil
}

// answer is the scripted upstream's reply: 11 input and 5 output tokens.
func answer(req *upstream.Request) upstream.Result {
	res := upstream.Result{Content: "answer to " + req.Prompt, UsageReported: true, InputTokens: 11, OutputTokens: 5}
	if req.Hints.WebSearch {
		res.Sources = []gateway.Source{{Title: "Doc", URL: "https://example.org", Snippet: "snip"}, {Title: "Other", URL: "https://example.com"}}
		res.Verdict = "supported"
	}
	return res
}

func (s *scripted) fail(err error) { s.configure(func(s *scripted) { s.err = err }) }

func (s *scripted) configure(f func(*scripted)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func (s *scripted) callCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.calls)
}

type testBundle struct {
	t        testing.TB
	store    *store.Store
	upstream *scripted
	server   *server.Server
	http     *httptest.Server
	// client speaks to http: HTTP/1.1, or HTTP/2 only with options.h2c.
	client *http.Client
	keys   *access.Keys
	// heardTables are the announcements of changes the replica has heard.
	heardTables *heardTables
	key         string // developer, inference + usage
}

// heardTables records the payloads of change announcements.
type heardTables struct {
	mu    sync.Mutex
	heard map[string]bool
}

func (h *heardTables) add(table string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.heard == nil {
		h.heard = map[string]bool{}
	}
	h.heard[table] = true
}

// heard reports whether the replica heard an announcement with payload.
func (b *testBundle) heard(payload string) bool {
	b.heardTables.mu.Lock()
	defer b.heardTables.mu.Unlock()
	return b.heardTables.heard[payload]
}

// waitListening waits until the key cache listens for changes (it caches
// nothing before).
func (b *testBundle) waitListening(t testing.TB) {
	t.Helper()
	require.Eventually(t, b.keys.Listening, 5*time.Second, 5*time.Millisecond)
}

func setup(t testing.TB, models map[gateway.Model]string) *testBundle {
	t.Helper()
	return setupWith(t, options{models: models})
}

// options vary the server a test runs against.
type options struct {
	// models maps the models served to upstream model names; nil: every
	// model under its own name.
	models    map[gateway.Model]string
	keepalive time.Duration
	rates     ratelimit.Config
	pool      *pgxpool.Pool // nil: a fresh database
	provider  upstream.Provider
	server    func(*server.Config)
	// plainListener serves without the server's listener wrapper.
	plainListener bool
	// h2c serves HTTP/2 without TLS beside HTTP/1.1, as behind a load
	// balancer that speaks it, and the bundle's client speaks only HTTP/2.
	h2c bool
	// logs, when set, receives the server's log as JSON lines.
	logs *syncbuf.Buffer
	// dayAhead is the ledger's DayAhead.
	dayAhead time.Duration
}

func setupWith(t testing.TB, o options) *testBundle {
	t.Helper()
	if o.pool == nil {
		o.pool = testdb.New(t)
	}
	st := store.New(o.pool)
	ctx, stop := context.WithCancel(context.Background())
	ledge := ledger.New(ledger.Config{Unavailable: store.Transient, DayAhead: o.dayAhead}, st)
	heard := &heardTables{}
	keys := access.NewKeys(access.Config{OnChange: func(table string, account uuid.UUID) {
		ledge.Invalidate(account)
		heard.add(table)
	}}, st)
	rates := ratelimit.New(o.rates, st)
	var wg sync.WaitGroup
	for _, run := range []func(context.Context){ledge.Run, keys.Run, rates.Run} {
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx) }()
	}
	t.Cleanup(func() { stop(); wg.Wait() })
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}, "0.5")
	require.NoError(t, err)
	if o.models == nil {
		o.models = gateway.OwnNames()
	}
	if o.keepalive == 0 {
		o.keepalive = time.Minute
	}
	up := &scripted{}
	var provider upstream.Provider = up
	if o.provider != nil {
		provider = o.provider
	}
	routes := map[gateway.Model]routing.Route{}
	for m, name := range o.models {
		routes[m] = routing.Route{Targets: []routing.Target{{Provider: "test", UpstreamModel: name, Client: provider}}}
	}
	router, err := routing.New(routing.Config{Routes: routes})
	require.NoError(t, err)
	estimator := &metering.Estimator{Tokenizer: tok, RateCard: rc}
	cfg := server.Config{
		Auth: &access.Authenticator{Keys: keys, Rates: rates},
		Inference: &inference.Service{
			Provider: router, Models: router, Estimator: estimator,
			Ledger: ledge, EvidenceRetention: time.Hour, RetryAfter: 5 * time.Second,
		},
		Evidence:     st,
		Usage:        st,
		Batches:      &batch.Service{Store: st, Models: router, Estimator: estimator},
		BatchData:    st,
		Readiness:    st,
		SSEKeepalive: o.keepalive,
		// Streams slower than this are detached from their connections'
		// goroutines: the tests see both ways.
		DetachAfter: 10 * time.Millisecond,
	}
	if o.logs != nil {
		cfg.Logger = slog.New(logsample.New(slog.NewJSONHandler(o.logs, nil))) // as the command's
	}
	if o.server != nil {
		o.server(&cfg)
	}
	srv, err := server.New(cfg)
	require.NoError(t, err)
	b := &testBundle{t: t, store: st, upstream: up, server: srv, http: serveAPI(t, srv, o), client: http.DefaultClient, keys: keys, heardTables: heard}
	if o.h2c {
		b.client = &http.Client{Transport: &http.Transport{Protocols: unencryptedHTTP2()}}
		t.Cleanup(b.client.CloseIdleConnections)
	}
	b.key = b.newKey("acme", gateway.TierDeveloper, gateway.ScopeInference, gateway.ScopeUsage)
	return b
}

func (b *testBundle) newKey(account string, tier gateway.Tier, scopes ...gateway.Scope) string {
	b.t.Helper()
	token, err := b.store.CreateKey(context.Background(), store.CreateKeyParams{Account: account, Project: "default", Tier: &tier, Scopes: scopes})
	require.NoError(b.t, err)
	return token
}

// serveAPI serves srv as a replica does: through its listener, which takes
// back the connections of streams that ended (unless o.plainListener), and
// with HTTP/2 beside HTTP/1.1 when o.h2c.
func serveAPI(t testing.TB, srv *server.Server, o options) *httptest.Server {
	t.Helper()
	ts := httptest.NewUnstartedServer(srv)
	if !o.plainListener {
		ts.Listener = srv.Listener(ts.Listener)
	}
	if o.h2c {
		ts.Config.Protocols = unencryptedHTTP2()
		ts.Config.Protocols.SetHTTP1(true)
	}
	ts.Start()
	t.Cleanup(func() {
		srv.Abort()
		srv.CloseStreams()
		ts.Close()
	})
	return ts
}

// unencryptedHTTP2 is HTTP/2 without TLS, alone.
func unencryptedHTTP2() *http.Protocols {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return p
}

type reply struct {
	proto  string
	status int
	header http.Header
	body   []byte
}

// do sends a request and validates the reply against the OpenAPI document.
func (b *testBundle) do(method, path, key, contentType string, body []byte) reply {
	b.t.Helper()
	return b.doWith(method, path, key, contentType, body, nil)
}

// postRaw posts body, bytes as they are, as JSON with the bundle's key.
func (b *testBundle) postRaw(path, body string) reply {
	b.t.Helper()
	return b.do(http.MethodPost, path, b.key, "application/json", []byte(body))
}

// outside sends a request without a body or a key and returns the reply's
// head, unchecked against the OpenAPI document: for a method or path the
// document does not declare.
func (b *testBundle) outside(method, path string) *http.Response {
	b.t.Helper()
	req, err := http.NewRequest(method, b.http.URL+path, nil)
	require.NoError(b.t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(b.t, err)
	resp.Body.Close()
	return resp
}

func (b *testBundle) doWith(method, path, key, contentType string, body []byte, header http.Header) reply {
	b.t.Helper()
	req, err := http.NewRequest(method, b.http.URL+path, bytes.NewReader(body))
	require.NoError(b.t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := b.client.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	// Re-create the request for validation (its body was consumed).
	vreq, _ := http.NewRequest(method, b.http.URL+path, bytes.NewReader(body))
	vreq.Header = req.Header
	raw := apitest.Validate(b.t, vreq, resp)
	return reply{proto: resp.Proto, status: resp.StatusCode, header: resp.Header, body: raw}
}

// postBody posts body to path with key and returns the reply's status, 0
// when there was none; the reply's body is read whole.
func (b *testBundle) postBody(ctx context.Context, path, key string, body io.Reader) int {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.http.URL+path, body)
	if err != nil {
		return 0
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := b.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

func (b *testBundle) post(path, key string, body any) reply {
	b.t.Helper()
	return b.postWith(path, key, body, nil)
}

func (b *testBundle) postWith(path, key string, body any, header http.Header) reply {
	b.t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(b.t, err)
	return b.doWith(http.MethodPost, path, key, "application/json", raw, header)
}

func (r reply) errorCode(t *testing.T) gateway.ErrorCode {
	t.Helper()
	var env struct {
		Error struct{ Code, Message string }
	}
	require.NoError(t, json.Unmarshal(r.body, &env), string(r.body))
	require.NotEmpty(t, env.Error.Message)
	return gateway.ErrorCode(env.Error.Code)
}

func (r reply) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

func TestCreateResponse(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.post("/api/v1/responses", b.key, map[string]any{
		"prompt": "hello", "model": " Think ", "custom_instructions": "be brief", "web_search": true,
		"include_regions": true, "studio_id": "st_1", "max_output_rungs": 100, "unknown_field": []int{1},
	})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	body := r.json(t)
	require.Equal(t, "answer to hello", body["content"])
	require.Equal(t, "reasoning", body["model"])
	require.Equal(t, "supported", body["evidence_verdict"])
	id := body["request_id"].(string)
	require.Equal(t, "/api/v1/sources/"+id, body["sources_url"])
	require.Len(t, body["sources"], 2)
	// 11 and 5 tokens at multiplier 4.
	require.Equal(t, map[string]any{"input_rungs": 44.0, "output_rungs": 20.0, "total_rungs": 64.0, "regions_activated": 0.0}, body["usage"])
	require.Equal(t, "44", r.header.Get("x-service-input-rungs"))
	require.Equal(t, "20", r.header.Get("x-service-output-rungs"))
	require.Equal(t, "64", r.header.Get("x-service-total-rungs"))
	route := body["route"].(map[string]any)
	require.Equal(t, "responses", route["selected_entry_point"])
	require.Equal(t, "reasoning", route["primary_model"])
	require.Equal(t, "reasoning", route["evidence_model"])
	require.Equal(t, "explicit", route["route_class"])
	require.Equal(t, false, route["studio_required"])
	require.Equal(t, false, route["approval_required"])
	require.NotZero(t, route["decided_at_ns"])

	call := b.upstream.calls[0]
	require.Equal(t, "be brief", call.System)
	require.Equal(t, uint64(100), call.MaxOutputTokens)
	require.Equal(t, "reasoning", call.UpstreamModel)

	// The evidence was committed with the request, on both paths.
	for _, path := range []string{"/api/v1/sources/" + id, "/api/v1/responses/" + id + "/sources"} {
		ev := b.do(http.MethodGet, path, b.key, "", nil)
		require.Equal(t, http.StatusOK, ev.status)
		evBody := ev.json(t)
		require.Equal(t, id, evBody["request_id"])
		require.Equal(t, "supported", evBody["evidence_verdict"])
		require.Equal(t, []any{
			map[string]any{"title": "Doc", "url": "https://example.org", "snippet": "snip"},
			map[string]any{"title": "Other", "url": "https://example.com"},
		}, evBody["sources"])
	}
}

func TestCreateResponseAbsentFieldsAreOmitted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.post("/api/v1/chat", b.key, map[string]any{"prompt": "plain", "code_mode": true})
	require.Equal(t, http.StatusOK, r.status)
	body := r.json(t)
	require.NotContains(t, body, "evidence_verdict")
	require.Equal(t, []any{}, body["sources"], "sources is [] when empty, never null")
	usage := body["usage"].(map[string]any)
	require.Contains(t, usage, "regions_activated")
	require.Nil(t, usage["regions_activated"])
	route := body["route"].(map[string]any)
	require.Equal(t, "chat", route["selected_entry_point"])
	require.Equal(t, "auto", route["route_class"])
	require.Equal(t, "elements", body["model"], "code_mode routes to elements")
	require.NotContains(t, route, "evidence_model")

	id := body["request_id"].(string)
	ev := b.do(http.MethodGet, "/api/v1/sources/"+id, b.key, "", nil).json(t)
	require.Equal(t, []any{}, ev["sources"])
	require.NotContains(t, ev, "evidence_verdict")
}

func TestCreateResponseValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, map[gateway.Model]string{gateway.ModelInstant: "small", gateway.ModelElements: "big"})
	tests := []struct {
		name string
		body string
		ct   string
		code gateway.ErrorCode
	}{
		{"empty prompt", `{"prompt": ""}`, "", gateway.EEmptyPrompt},
		{"missing prompt", `{}`, "", gateway.EEmptyPrompt},
		{"prompt too large", `{"prompt": "` + strings.Repeat("a", 100001) + `"}`, "", gateway.EPromptTooLarge},
		{"invalid model", `{"prompt": "p", "model": "gpt-5"}`, "", gateway.EInvalidModel},
		{"unavailable model", `{"prompt": "p", "model": "reasoning"}`, "", gateway.EModelUnavailable},
		{"max zero", `{"prompt": "p", "max_output_rungs": 0}`, "", gateway.EInvalidRequest},
		{"max above limit", `{"prompt": "p", "max_output_rungs": 32001}`, "", gateway.EInvalidRequest},
		{"max beyond uint64", `{"prompt": "p", "max_output_rungs": 18446744073709551616}`, "", gateway.EInvalidRequest},
		{"max at uint64 limit", `{"prompt": "p", "max_output_rungs": 18446744073709551615}`, "", gateway.EInvalidRequest},
		{"max negative", `{"prompt": "p", "max_output_rungs": -1}`, "", gateway.EInvalidRequest},
		{"wrong type", `{"prompt": 5}`, "", gateway.EInvalidRequest},
		{"malformed json", `{"prompt": "p"`, "", gateway.EInvalidRequest},
		{"trailing data", `{"prompt": "p"} {}`, "", gateway.EInvalidRequest},
		{"not an object", `["p"]`, "", gateway.EInvalidRequest},
		{"null", ` null `, "", gateway.EInvalidRequest},
		{"empty body", ``, "", gateway.EInvalidRequest},
		{"wrong content type", `{"prompt": "p"}`, "text/plain", gateway.EInvalidRequest},
		{"no content type", `{"prompt": "p"}`, "-", gateway.EInvalidRequest},
	}
	for _, tt := range tests {
		ct := tt.ct
		switch ct {
		case "":
			ct = "application/json"
		case "-":
			ct = ""
		}
		r := b.do(http.MethodPost, "/api/v1/responses", b.key, ct, []byte(tt.body))
		require.Equal(t, http.StatusBadRequest, r.status, tt.name)
		require.Equal(t, tt.code, r.errorCode(t), tt.name)
	}
	require.Empty(t, b.upstream.calls, "nothing invalid reaches the upstream")

	r := b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": 5}`))
	require.Contains(t, string(r.body), "prompt", "the message names the field")
	// A large value is not repeated whole in the message (nor in the log).
	r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "model": "`+strings.Repeat("m", 500000)+`"}`))
	require.Equal(t, gateway.EInvalidModel, r.errorCode(t))
	require.Less(t, len(r.body), 300, string(r.body))
	r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "max_output_rungs": 1`+strings.Repeat("0", 500000)+`}`))
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	require.Less(t, len(r.body), 300, string(r.body))
	require.Contains(t, r.message(t), "out of range (at most 18446744073709551615)", "a whole number past any field's range is said so")
	r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "max_output_rungs": 18446744073709551616}`))
	require.Equal(t, `field "max_output_rungs": number 18446744073709551616 is out of range (at most 18446744073709551615)`, r.message(t))
	r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "max_output_rungs": 1.5}`))
	require.Equal(t, `field "max_output_rungs": number 1.5 is not a valid non-negative integer`, r.message(t))
	// OpenAPI 3.0's integer is digits alone: a whole number with a fraction
	// or an exponent is refused as one with a fraction is.
	for _, n := range []string{"1000.0", "1e3", "1E+3"} {
		r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "max_output_rungs": `+n+`}`))
		require.Equal(t, `field "max_output_rungs": number `+n+` is not a valid non-negative integer`, r.message(t))
	}
	r = b.do(http.MethodGet, "/api/v1/sources/"+strings.Repeat("s", 20000), b.key, "", nil)
	require.Equal(t, gateway.ESourcesNotFound, r.errorCode(t))
	require.Less(t, len(r.body), 300, string(r.body))
	for _, body := range []string{`null`, `[{"prompt":"p"}]`, `"p"`} {
		r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(body))
		require.Equal(t, "the body must be a JSON object", r.message(t), body)
	}
	r = b.do(http.MethodPost, "/api/v1/batch", b.key, "application/json", []byte(`{"requests":{"prompt":"p"}}`))
	require.Equal(t, `field "requests": object is not a valid array`, r.message(t))
	require.Empty(t, r.header.Get("x-service-batch-index"), "an object where the items go names no item")
	deep := strings.Repeat("[", 10001) + strings.Repeat("]", 10001)
	r = b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(`{"prompt": "p", "x": `+deep+`}`))
	require.Equal(t, "the body nests arrays and objects deeper than 10000 levels", r.message(t), "said as such, not as malformed")
}

func TestBodyLimit(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	big := []byte(`{"prompt": "p", "custom_instructions": "` + strings.Repeat("a", 1<<20) + `"}`)
	r := b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", big)
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status)
	require.Equal(t, gateway.ERequestTooLarge, r.errorCode(t))
	// A body of the limit exactly is read.
	whole := []byte(`{"prompt": "p", "x": "` + strings.Repeat("a", 1<<20-24) + `"}`)
	require.Len(t, whole, 1<<20)
	require.Equal(t, http.StatusOK, b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", whole).status)

	// Without a Content-Length the limit applies while reading.
	req, err := http.NewRequest(http.MethodPost, b.http.URL+"/api/v1/responses", io.MultiReader(bytes.NewReader(big)))
	require.NoError(t, err)
	req.ContentLength = -1
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	revoked := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeInference)
	require.NoError(t, b.store.RevokeKey(context.Background(), revoked[:12]))
	unknown := "igw_" + strings.Repeat("a", 52)

	for name, key := range map[string]string{"missing": "", "malformed": "sk-123", "unknown": unknown, "revoked": revoked} {
		// Auth is checked before the body is read: a malformed body still gets 401.
		r := b.do(http.MethodPost, "/api/v1/responses", key, "application/json", []byte(`{`))
		require.Equal(t, http.StatusUnauthorized, r.status, name)
		require.Equal(t, gateway.EUnauthorized, r.errorCode(t), name)
		require.Equal(t, `Bearer realm="gateway"`, r.header.Get("WWW-Authenticate"), name)
	}
	// The scheme is Bearer in any case (RFC 9110 §11.1); spaces around the
	// token are left out.
	for header, status := range map[string]int{
		"Basic " + b.key: http.StatusUnauthorized, "Bearer": http.StatusUnauthorized, "Bearer   ": http.StatusUnauthorized,
		"bearer " + b.key: http.StatusOK, "BEARER  " + b.key + " ": http.StatusOK,
	} {
		r := b.doWith(http.MethodGet, "/api/v1/usage", "", "", nil, http.Header{"Authorization": {header}})
		require.Equal(t, status, r.status, header)
	}
}

func TestScopesAndTiers(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	usageOnly := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeUsage)
	free := b.newKey("freeco", gateway.TierFree, gateway.ScopeInference, gateway.ScopeUsage)
	freeUsageOnly := b.newKey("freeco", gateway.TierFree, gateway.ScopeUsage)

	r := b.post("/api/v1/responses", usageOnly, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusForbidden, r.status)
	require.Equal(t, gateway.EInsufficientScope, r.errorCode(t))
	r = b.do(http.MethodGet, "/api/v1/sources/x", usageOnly, "", nil)
	require.Equal(t, gateway.EInsufficientScope, r.errorCode(t))

	// Batch routes: scope first, then tier.
	batchRoutes := []struct{ method, path string }{
		{http.MethodPost, "/api/v1/batch"}, {http.MethodGet, "/api/v1/batch/x"}, {http.MethodGet, "/api/v1/batch/x/results"},
		{http.MethodPost, "/api/v1/batch/x/cancel"}, {http.MethodGet, "/api/v1/batches"},
	}
	for _, rt := range batchRoutes {
		r := b.do(rt.method, rt.path, freeUsageOnly, "application/json", []byte(`{"requests":[{"prompt":"p"}]}`))
		require.Equal(t, gateway.EInsufficientScope, r.errorCode(t), rt.path)
		r = b.do(rt.method, rt.path, free, "application/json", []byte(`{"requests":[{"prompt":"p"}]}`))
		require.Equal(t, http.StatusForbidden, r.status, rt.path)
		require.Equal(t, gateway.EInsufficientTier, r.errorCode(t), rt.path)
	}

	// A free account may use responses.
	r = b.post("/api/v1/responses", free, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusOK, r.status)
}

func TestEvidenceOwnership(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	other := b.newKey("other", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p", "web_search": true}).json(t)["request_id"].(string)

	for name, c := range map[string]struct{ key, id string }{
		"foreign":   {other, id},
		"unknown":   {b.key, "01900000-0000-7000-8000-000000000000"},
		"malformed": {b.key, "not-a-uuid"},
	} {
		r := b.do(http.MethodGet, "/api/v1/sources/"+c.id, c.key, "", nil)
		require.Equal(t, http.StatusNotFound, r.status, name)
		require.Equal(t, gateway.ESourcesNotFound, r.errorCode(t), name)
	}
}

func TestUpstreamFailureIsInferenceBusy(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for name, err := range map[string]error{
		"unavailable": upstream.ErrUnavailable,
		"rejected":    &upstream.RejectedError{Status: 400, Message: "content policy"},
		"other":       errors.New("garbled reply"),
	} {
		b.upstream.fail(err)
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
		require.Equal(t, http.StatusServiceUnavailable, r.status, name)
		require.Equal(t, gateway.EInferenceBusy, r.errorCode(t), name)
		require.Equal(t, "5", r.header.Get("Retry-After"), name)
		require.NotContains(t, string(r.body), "garbled", "internal causes are not leaked")
	}
}

func TestPublicDocuments(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.do(http.MethodGet, "/openapi.json", "", "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, "3.0.3", r.json(t)["openapi"])
	require.Equal(t, "public, max-age=300", r.header.Get("Cache-Control"), "as the document says")
	r = b.do(http.MethodGet, "/api/schema.json", "", "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, "application/schema+json", r.header.Get("Content-Type"))
	require.Equal(t, "public, max-age=300", r.header.Get("Cache-Control"))
	require.Contains(t, r.json(t)["$defs"], "Response")
}

// TestPublicDocumentsRevalidate: each document's ETag names its content, and
// a request whose If-None-Match names it (weakly, in a list, over several
// lines, or as *) is answered 304 without the document; any other, a stale or
// malformed tag or an empty header, gets the document.
func TestPublicDocumentsRevalidate(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	get := func(method, path string, ifNoneMatch ...string) reply {
		t.Helper()
		var h http.Header
		if ifNoneMatch != nil {
			h = http.Header{"If-None-Match": ifNoneMatch}
		}
		return b.doWith(method, path, "", "", nil, h)
	}
	for _, path := range []string{"/openapi.json", "/api/schema.json"} {
		first := get(http.MethodGet, path)
		require.Equal(t, http.StatusOK, first.status, path)
		tag := first.header.Get("ETag")
		require.Regexp(t, `^W/"[A-Za-z0-9_-]+"$`, tag, path)
		require.Equal(t, tag, get(http.MethodGet, path).header.Get("ETag"), "the same document, the same tag")
		strong := strings.TrimPrefix(tag, "W/")

		for _, inm := range [][]string{{tag}, {strong}, {`W/"older", ` + tag}, {`W/"older"`, tag}, {"*"}, {` ` + tag + ` ,`}} {
			r := get(http.MethodGet, path, inm...)
			require.Equal(t, http.StatusNotModified, r.status, "%s %q", path, inm)
			require.Empty(t, r.body, path)
			require.Equal(t, tag, r.header.Get("ETag"), path)
			require.Equal(t, "public, max-age=300", r.header.Get("Cache-Control"), "a 304 says what the 200 would (RFC 9110 §15.4.5)")
		}
		require.Equal(t, http.StatusNotModified, get(http.MethodHead, path, tag).status, "HEAD as GET")

		for _, inm := range [][]string{{`W/"older"`}, {"no-quotes"}, {`W/"unterminated`}, {""}, {"", " , "}, {`"older", ` + tag[3:len(tag)-1]}} {
			r := get(http.MethodGet, path, inm...)
			require.Equal(t, http.StatusOK, r.status, "%s %q", path, inm)
			require.Equal(t, first.body, r.body, path)
			require.Equal(t, tag, r.header.Get("ETag"), path)
		}
	}
	require.NotEqual(t, get(http.MethodGet, "/openapi.json").header.Get("ETag"), get(http.MethodGet, "/api/schema.json").header.Get("ETag"))
	schemaTag := get(http.MethodGet, "/api/schema.json").header.Get("ETag")
	require.Equal(t, http.StatusOK, get(http.MethodGet, "/openapi.json", schemaTag).status, "another document's tag is no copy of this one")
}

func TestUnknownRouteAndMethod(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// An empty path segment where a parameter goes is no route either, as a
	// missing last one is.
	for _, path := range []string{"/api/v2/nothing", "/api/v1/batch/", "/api/v1/batch//results", "/api/v1/responses//sources", "/api/v1/sources/a/b"} {
		r := b.do(http.MethodGet, path, b.key, "", nil)
		require.Equal(t, http.StatusNotFound, r.status, path)
		require.Equal(t, gateway.ENotFound, r.errorCode(t), path)
		require.Equal(t, "no such route", r.message(t), "%s is near no route that GET serves", path)
	}
	r := b.do(http.MethodPost, "/api/v1/batch//cancel", b.key, "", nil)
	require.Equal(t, http.StatusNotFound, r.status)

	// A route but for a trailing slash or the letter case is named.
	for path, want := range map[string]string{
		"POST /api/v1/responses/":            "/api/v1/responses",
		"POST /API/V1/Chat//":                "/api/v1/chat",
		"POST /api/v1/batch/":                "/api/v1/batch",
		"GET /api/v1/Batch/abc/Results":      "/api/v1/batch/{batch_id}/results",
		"POST /api/v1/batch/abc/cancel/":     "/api/v1/batch/{batch_id}/cancel",
		"GET /api/v1/sources/abc/":           "/api/v1/sources/{request_id}",
		"GET /api/v1/responses/abc/sources/": "/api/v1/responses/{request_id}/sources",
	} {
		method, target, _ := strings.Cut(path, " ")
		r := b.do(method, target, b.key, "application/json", []byte(`{"prompt":"p"}`))
		require.Equal(t, http.StatusNotFound, r.status, path)
		require.Equal(t, "no such route; did you mean "+want+"?", r.message(t), path)
	}

	require.Equal(t, http.StatusMethodNotAllowed, b.outside(http.MethodDelete, "/api/v1/responses").StatusCode)
}

func ptr[T any](v T) *T { return &v }
