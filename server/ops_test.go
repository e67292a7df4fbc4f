package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

func TestHealthAndReadiness(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.do(http.MethodGet, "/healthz", "", "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, map[string]any{"status": "ok"}, r.json(t))
	r = b.do(http.MethodGet, "/readyz", "", "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, map[string]any{"status": "ok"}, r.json(t))

	b.server.Drain()
	r = b.do(http.MethodGet, "/readyz", "", "", nil)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, map[string]any{"status": "unavailable", "detail": "shutting down"}, r.json(t))
	require.Equal(t, http.StatusOK, b.do(http.MethodGet, "/healthz", "", "", nil).status, "alive while draining")
}

// readiness is a ReadinessChecker that answers err.
type readiness struct{ err error }

func (r readiness) Ready(context.Context) error { return r.err }

// TestAllReadyIsReadyWhenEveryCheckerIs: none, or every one ready, is ready;
// otherwise the first checker not ready says why.
func TestAllReadyIsReadyWhenEveryCheckerIs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	away, notListening := errors.New("the database is away"), errors.New("not listening for changes to keys yet")
	require.NoError(t, server.AllReady{}.Ready(ctx))
	require.NoError(t, server.AllReady{readiness{}, readiness{}}.Ready(ctx))
	require.Equal(t, notListening, server.AllReady{readiness{}, readiness{notListening}}.Ready(ctx))
	require.Equal(t, away, server.AllReady{readiness{away}, readiness{notListening}}.Ready(ctx), "the first that is not says why")
}

func TestRequestID(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for id, why := range map[string]string{
		"trace-abc-123":          "a client's id is echoed",
		"!trace~":                "the first and last printable characters are the id's",
		strings.Repeat("x", 128): "128 characters is not too long",
	} {
		r := b.doWith(http.MethodGet, "/healthz", "", "", nil, http.Header{"X-Request-Id": {id}})
		require.Equal(t, id, r.header.Get("x-request-id"), why)
	}
	r := b.do(http.MethodGet, "/healthz", "", "", nil)
	require.Len(t, r.header.Get("x-request-id"), 36, "one is generated otherwise")
	for _, unusable := range []string{strings.Repeat("x", 200), "trace abc", "trace\tabc", "tracé"} {
		r = b.doWith(http.MethodGet, "/healthz", "", "", nil, http.Header{"X-Request-Id": {unusable}})
		require.Len(t, r.header.Get("x-request-id"), 36, "an unusable one is replaced: %q", unusable)
	}
	r = b.do(http.MethodGet, "/nowhere", "", "", nil)
	require.NotEmpty(t, r.header.Get("x-request-id"), "errors carry it too")
}

// accessLogLine is a request's line of the access log.
type accessLogLine struct {
	Msg        string  `json:"msg"`
	RequestID  string  `json:"request_id"`
	Route      string  `json:"route"`
	Status     int     `json:"status"`
	DurationMS float64 `json:"duration_ms"`
	Bytes      int     `json:"bytes"`
	Account    string  `json:"account"`
	ErrorCode  string  `json:"error_code"`
	ClientLeft bool    `json:"client_left"`
	// What a response was billed.
	Model             string `json:"model"`
	InputRungs        *int64 `json:"input_rungs"`
	OutputRungs       *int64 `json:"output_rungs"`
	Provider          string `json:"provider"`
	UpstreamModel     string `json:"upstream_model"`
	ResponseRequestID string `json:"response_request_id"`
	BatchID           string `json:"batch_id"`
}

// loggedRequest is the first access log line in logs (JSON lines) that
// matches, and whether one was written.
func loggedRequest(t *testing.T, logs *syncbuf.Buffer, match func(accessLogLine) bool) (accessLogLine, bool) {
	t.Helper()
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if l == "" {
			continue
		}
		var line accessLogLine
		require.NoError(t, json.Unmarshal([]byte(l), &line), l)
		if line.Msg == "request" && match(line) {
			return line, true
		}
	}
	return accessLogLine{}, false
}

// awaitLogged waits for the access log line of the request with id, and
// returns it.
func awaitLogged(t *testing.T, logs *syncbuf.Buffer, id string) accessLogLine {
	t.Helper()
	var line accessLogLine
	require.Eventually(t, func() bool {
		var ok bool
		line, ok = loggedRequest(t, logs, func(l accessLogLine) bool { return l.RequestID == id })
		return ok
	}, 5*time.Second, 10*time.Millisecond)
	return line
}

// loggedLine is the first line of logs (JSON lines) with msg.
func loggedLine(t *testing.T, logs *syncbuf.Buffer, msg string) map[string]any {
	t.Helper()
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var line map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &line), l)
		if line["msg"] == msg {
			return line
		}
	}
	require.Failf(t, "no such log line", "%q in\n%s", msg, logs.String())
	return nil
}

func TestAccessLogNeverLeaksSecrets(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})
	prompt := "my very private prompt about payroll"
	r := b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": prompt, "stream": true}, http.Header{"X-Request-Id": {"log-me"}})
	require.Equal(t, http.StatusOK, r.status)
	b.post("/api/v1/responses", b.key, map[string]any{"prompt": prompt})
	b.post("/api/v1/responses", "igw_"+strings.Repeat("b", 52), map[string]any{"prompt": prompt})

	out := logs.String()
	require.Contains(t, out, `"request_id":"log-me"`)
	require.Contains(t, out, `"route":"/api/v1/responses"`)
	require.Contains(t, out, `"status":200`)
	require.Contains(t, out, `"status":401`)
	require.Contains(t, out, `"account":"acme"`)
	require.NotContains(t, out, b.key)
	require.NotContains(t, out, b.key[12:], "not even the secret part")
	require.NotContains(t, out, strings.Repeat("b", 52))
	require.NotContains(t, out, "payroll")
}

// TestRepliesAndRefusalsWriteNoWarning: a reply, a stream and the refusals
// of a client's mistakes (401, 400, 404) each write their access log line
// and nothing else: a warning or an error tells of the gateway's trouble.
func TestRepliesAndRefusalsWriteNoWarning(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})
	require.Equal(t, http.StatusOK, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"}).status)
	require.Equal(t, http.StatusOK, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p", "stream": true}).status)
	require.Equal(t, http.StatusUnauthorized, b.post("/api/v1/responses", "", map[string]any{"prompt": "p"}).status)
	require.Equal(t, http.StatusBadRequest, b.post("/api/v1/responses", b.key, map[string]any{"prompt": ""}).status)
	require.Equal(t, http.StatusNotFound, b.do(http.MethodGet, "/api/v1/batch/"+uuid.Must(uuid.NewV7()).String(), b.key, "", nil).status)

	require.Eventually(t, func() bool { return strings.Count(logs.String(), "\n") >= 5 }, 5*time.Second, 10*time.Millisecond)
	for line := range strings.Lines(logs.String()) {
		require.Contains(t, line, `"level":"INFO"`)
		require.Contains(t, line, `"route":`, "an access log line")
	}
}

// TestAccessLogNamesTheClient: the access log names the connection's peer, or
// the client a trusted proxy names in X-Forwarded-For.
func TestAccessLogNamesTheClient(t *testing.T) {
	t.Parallel()
	forwarded := http.Header{"X-Forwarded-For": {"192.0.2.66, 198.51.100.7"}, "X-Request-Id": {"forwarded"}}
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})
	b.doWith(http.MethodGet, "/healthz", "", "", nil, forwarded)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), `"request_id":"forwarded"`) }, 5*time.Second, 10*time.Millisecond)
	require.Contains(t, logs.String(), `"client":"127.0.0.1"`, "no proxy is trusted: the peer")

	logs = &syncbuf.Buffer{}
	b = setupWith(t, options{logs: logs, server: func(c *server.Config) { c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")} }})
	b.doWith(http.MethodGet, "/healthz", "", "", nil, forwarded)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), `"request_id":"forwarded"`) }, 5*time.Second, 10*time.Millisecond)
	require.Contains(t, logs.String(), `"client":"198.51.100.7"`, "the address the trusted proxy saw, not the one its client wrote")
	require.NotContains(t, logs.String(), "192.0.2.66")
}

// TestAccessLogNamesTheBatch: a batch route's log line names the batch it
// created or named, not a malformed id.
func TestAccessLogNamesTheBatch(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})
	batchOf := func(id string) string { return awaitLogged(t, logs, id).BatchID }
	r := b.postWith("/api/v1/batch", b.key, map[string]any{"requests": []map[string]any{{"prompt": "p"}}}, http.Header{"X-Request-Id": {"create"}})
	require.Equal(t, http.StatusAccepted, r.status)
	created := r.json(t)["id"].(string)
	require.Equal(t, created, batchOf("create"))
	b.doWith(http.MethodPost, "/api/v1/batch/"+created+"/cancel", b.key, "", nil, http.Header{"X-Request-Id": {"cancel"}})
	require.Equal(t, created, batchOf("cancel"))
	missing := uuid.Must(uuid.NewV7()).String()
	r = b.doWith(http.MethodGet, "/api/v1/batch/"+missing, b.key, "", nil, http.Header{"X-Request-Id": {"missing"}})
	require.Equal(t, http.StatusNotFound, r.status)
	require.Equal(t, missing, batchOf("missing"), "the id asked for, found or not")
	b.doWith(http.MethodGet, "/api/v1/batch/not-an-id/results", b.key, "", nil, http.Header{"X-Request-Id": {"malformed"}})
	require.Empty(t, batchOf("malformed"))
}

// TestAccessLogSaysWhatWasBilled: a response's log line names the model used,
// the target that answered and the rungs billed, and, when the client named
// the request (x-request-id), the response's own request_id; a refused one
// names none of it.
func TestAccessLogSaysWhatWasBilled(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})

	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "what does this cost", "model": "reasoning"})
	require.Equal(t, http.StatusOK, r.status)
	var body api.Response
	require.NoError(t, json.Unmarshal(r.body, &body))
	line := awaitLogged(t, logs, body.RequestId.String())
	require.Equal(t, "reasoning", line.Model)
	require.Equal(t, body.Usage.InputRungs, *line.InputRungs)
	require.Equal(t, body.Usage.OutputRungs, *line.OutputRungs)
	require.NotZero(t, *line.OutputRungs)
	require.NotNil(t, body.Route.Provider)
	require.Equal(t, *body.Route.Provider, line.Provider)
	require.Equal(t, *body.Route.UpstreamModel, line.UpstreamModel)
	require.Empty(t, line.ResponseRequestID, "one id everywhere: the log's is the response's")

	r = b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": "stream it", "stream": true}, http.Header{"X-Request-Id": {"client-named"}})
	require.Equal(t, http.StatusOK, r.status)
	events := apitest.ParseEvents(t, strings.NewReader(string(r.body))).Events
	var final api.StreamChunk
	events[len(events)-1].Decode(t, &final)
	require.True(t, final.Done)
	line = awaitLogged(t, logs, "client-named")
	require.Equal(t, final.RequestId.String(), line.ResponseRequestID, "the id to give the sources endpoint")
	require.Equal(t, final.Usage.InputRungs, *line.InputRungs)
	require.Equal(t, final.Usage.OutputRungs, *line.OutputRungs)
	require.Equal(t, string(*final.Model), line.Model)

	r = b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": "p", "model": "nope"}, http.Header{"X-Request-Id": {"refused"}})
	require.Equal(t, http.StatusBadRequest, r.status)
	line = awaitLogged(t, logs, "refused")
	require.Equal(t, "INVALID_MODEL", line.ErrorCode)
	require.Empty(t, line.Model)
	require.Nil(t, line.OutputRungs, "nothing billed, nothing said")
}

// panicking is an upstream that panics.
type panicking struct{ upstream.Provider }

func (panicking) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	panic("upstream client bug")
}

func TestPanicBecomesInternalError(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{provider: panicking{}, logs: logs})
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, gateway.EInternal, r.errorCode(t))
	require.NotContains(t, string(r.body), "upstream client bug")
	panicked := loggedLine(t, logs, "panic serving request")
	require.Equal(t, r.header.Get("x-request-id"), panicked["request_id"])
	require.Contains(t, panicked["error"], "upstream client bug", "the operator is told")
	require.Equal(t, http.StatusOK, b.do(http.MethodGet, "/healthz", "", "", nil).status, "the server lives on")
}

func TestCORS(t *testing.T) {
	t.Parallel()
	preflight := func(b *testBundle) http.Header {
		return apitest.Preflight(t, b.http.URL+"/api/v1/responses", "https://app.example.com")
	}
	off := setup(t, nil)
	require.Empty(t, preflight(off).Get("Access-Control-Allow-Origin"), "CORS is off unless configured")

	on := setupWith(t, options{server: func(c *server.Config) { c.CORSOrigins = []string{"https://app.example.com"} }})
	h := preflight(on)
	require.Equal(t, "https://app.example.com", h.Get("Access-Control-Allow-Origin"))
	allowed := strings.Split(strings.ToLower(h.Get("Access-Control-Allow-Headers")), ",")
	for _, name := range []string{"authorization", "content-type", "idempotency-key", "if-none-match", "x-request-id", "traceparent", "tracestate"} {
		require.Contains(t, allowed, name, "every request header the document names, a browser's trace context too")
	}
	doc := on.doWith(http.MethodGet, "/openapi.json", "", "", nil, http.Header{"Origin": {"https://app.example.com"}})
	require.Contains(t, strings.Split(strings.ToLower(doc.header.Get("Access-Control-Expose-Headers")), ","), "etag", "a browser's script may read the tag to revalidate")
}

// TestOneRequestID: without an X-Request-Id from the client, the reply's header
// and its request_id are the same id (so logs, headers, bodies and the sources
// endpoint agree); a client's own id is echoed in the header.
func TestOneRequestID(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, r.header.Get("x-request-id"), r.json(t)["request_id"])

	sr, s := b.stream("/api/v1/responses", map[string]any{"prompt": "hi"})
	var first api.StreamChunk
	s.Events[0].Decode(t, &first)
	require.Equal(t, sr.header.Get("x-request-id"), first.RequestId.String())

	r = b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": "hi"}, http.Header{"X-Request-Id": {"client-chosen-1"}})
	require.Equal(t, "client-chosen-1", r.header.Get("x-request-id"))
	require.NotEqual(t, "client-chosen-1", r.json(t)["request_id"], "the body's id is always a UUID")
}

// TestHeadIsServedWhereGetIs: HEAD gets a GET operation's status and headers,
// through its authentication, and no body, so a load balancer's HEAD health
// check works; a path without GET still refuses it.
func TestHeadIsServedWhereGetIs(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs})

	// On one connection: a HEAD, then a GET. Had the HEAD's reply carried a
	// body, the GET's reply would be read from the middle of it.
	conn, err := net.Dial("tcp", b.http.Listener.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "HEAD /readyz HTTP/1.1\r\nHost: gateway\r\n\r\nGET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
	require.NoError(t, err)
	br := bufio.NewReader(conn)
	head, err := http.ReadResponse(br, &http.Request{Method: http.MethodHead})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, head.StatusCode)
	require.Equal(t, "application/json", head.Header.Get("Content-Type"))
	require.NotEmpty(t, head.Header.Get("X-Request-Id"))
	get, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet})
	require.NoError(t, err)
	body, err := io.ReadAll(get.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, get.StatusCode)
	require.JSONEq(t, `{"status":"ok"}`, string(body))

	r := b.do(http.MethodHead, "/api/v1/usage", b.key, "", nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Empty(t, r.body)
	require.NotEmpty(t, r.header.Get("X-Ratelimit-Limit"), "the GET's headers")
	require.Equal(t, http.StatusUnauthorized, b.do(http.MethodHead, "/api/v1/usage", "", "", nil).status, "and its authentication")
	require.Equal(t, http.StatusNotFound, b.do(http.MethodHead, "/api/v1/batch/"+uuid.NewString(), b.key, "", nil).status)

	// Outside the document, so not through b.do, which checks replies against it.
	resp := b.outside(http.MethodHead, "/api/v1/responses")
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode, "no GET, no HEAD")
	require.NotContains(t, resp.Header.Get("Allow"), http.MethodHead)
	resp = b.outside(http.MethodDelete, "/openapi.json")
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Allow"), http.MethodHead, "the methods a path allows name HEAD beside GET")

	require.Eventually(t, func() bool { return strings.Contains(logs.String(), `"method":"HEAD","route":"/api/v1/usage"`) }, 5*time.Second, 10*time.Millisecond,
		"the access log names the method as sent")
}

// leaveDuring posts body to path with a client that leaves once reached
// returns (the request got where it should), and returns the request's
// access log line once it is written.
func (b *testBundle) leaveDuring(t *testing.T, logs *syncbuf.Buffer, path, body string, reached func()) accessLogLine {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	status := async(func() int { return b.postBody(ctx, path, b.key, strings.NewReader(body)) })
	reached()
	cancel()
	require.Zero(t, <-status, "no reply")
	var line accessLogLine
	require.Eventually(t, func() bool {
		var found bool
		line, found = loggedRequest(t, logs, func(l accessLogLine) bool { return l.Route == path })
		return found
	}, 5*time.Second, 5*time.Millisecond, "the request is logged")
	return line
}

// setupObserved serves, over HTTP/2 when h2c, with its log in logs and its
// metrics in m, configured by configure when set.
func setupObserved(t *testing.T, h2c bool, configure func(*server.Config)) (b *testBundle, logs *syncbuf.Buffer, m *metrics.Metrics) {
	logs, m = &syncbuf.Buffer{}, metrics.New()
	b = setupWith(t, options{h2c: h2c, logs: logs, server: func(c *server.Config) {
		c.Metrics = m
		if configure != nil {
			configure(c)
		}
	}})
	return b, logs, m
}

// TestAClientThatLeavesIsNotAServerError: a client that leaves before its
// reply (its connection closed, its HTTP/2 stream reset) ends its upstream
// call unbilled, and the request is logged and counted with status 499, as
// proxies do: not as a failed request (no error logged, no 500 counted), for
// clients that give up are no fault of the gateway's.
func TestAClientThatLeavesIsNotAServerError(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(protoName(h2c), func(t *testing.T) {
			t.Parallel()
			b, logs, m := setupObserved(t, h2c, nil)
			b.upstream.configure(func(s *scripted) { s.hang = true })
			line := b.leaveDuring(t, logs, "/api/v1/responses", `{"prompt": "p"}`, func() {
				require.Eventually(t, func() bool { return b.upstream.callCount() > 0 }, 5*time.Second, time.Millisecond, "the call runs")
			})
			require.Equal(t, 499, line.Status)
			require.Zero(t, line.Bytes, "nothing is sent")
			require.NotContains(t, logs.String(), `"level":"ERROR"`)
			scraped := metricstest.Scrape(m)
			require.Contains(t, scraped, `gateway_http_requests_total{method="POST",route="/api/v1/responses",status="499"} 1`)
			require.NotContains(t, scraped, `status="500"`)
			require.Eventually(t, func() bool {
				v := b.usage(t, b.key)
				return v.Totals.Requests == 0 && v.Budget.ReservedRungs == 0 && v.Daily.ChargedRungs == 0
			}, 5*time.Second, 10*time.Millisecond, "nothing is billed, and the estimate is released")
		})
	}
}

// leavingLedger is the real ledger whose admissions wait until their
// request's context ends, and fail with its error, as an admission that
// meets the database would.
type leavingLedger struct {
	inference.Ledger
	entered chan struct{}
}

func (l *leavingLedger) Admit(ctx context.Context, _ gateway.Admission) error {
	l.entered <- struct{}{}
	<-ctx.Done()
	return fmt.Errorf("error leasing quota: %w", ctx.Err())
}

// TestAStreamWhoseClientLeavesBeforeItsHead: a streamed request whose client
// leaves while it is admitted is treated as a JSON one (see
// TestAClientThatLeavesIsNotAServerError): no head is sent, and it is logged
// with status 499, not as a failure.
func TestAStreamWhoseClientLeavesBeforeItsHead(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(protoName(h2c), func(t *testing.T) {
			t.Parallel()
			l := &leavingLedger{entered: make(chan struct{}, 1)}
			b, logs, m := setupObserved(t, h2c, func(c *server.Config) { l.Ledger, c.Inference.Ledger = c.Inference.Ledger, l })
			line := b.leaveDuring(t, logs, "/api/v1/responses", `{"prompt": "p", "stream": true}`, func() { <-l.entered })
			require.Equal(t, 499, line.Status)
			require.Zero(t, line.Bytes, "no head")
			require.Empty(t, line.ErrorCode)
			require.NotContains(t, logs.String(), `"level":"ERROR"`)
			scraped := metricstest.Scrape(m)
			require.Contains(t, scraped, `gateway_stream_errors_total{code="INTERNAL"} 0`)
			require.Contains(t, scraped, `gateway_open_streams 0`, "no stream was opened")
			require.Zero(t, b.upstream.callCount())
		})
	}
}

// leftStore is the real store whose batch creations wait until their
// request's context ends, then go on to the database with it, or fail with
// fault when it is set.
type leftStore struct {
	batch.Store
	entered chan struct{}
	fault   error
}

func (s *leftStore) CreateBatch(ctx context.Context, nb store.NewBatch) (store.CreateResult, error) {
	s.entered <- struct{}{}
	<-ctx.Done()
	if s.fault != nil {
		return store.CreateResult{}, s.fault
	}
	return s.Store.CreateBatch(ctx, nb)
}

// TestAClientThatLeavesWhileItsBatchIsStored: a client that leaves as its
// batch goes to the database has nothing stored (the store is given the
// ended context), and the request is logged 499 without an error; a failure
// its leaving did not cause is still logged as one.
func TestAClientThatLeavesWhileItsBatchIsStored(t *testing.T) {
	t.Parallel()
	for name, fault := range map[string]error{"ended with it": nil, "a fault of its own": errors.New("disk on fire")} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			logs := &syncbuf.Buffer{}
			left := &leftStore{entered: make(chan struct{}, 1), fault: fault}
			b := setupWith(t, options{logs: logs, server: func(c *server.Config) {
				svc := c.Batches.(*batch.Service)
				left.Store, svc.Store = svc.Store, left
			}})
			line := b.leaveDuring(t, logs, "/api/v1/batch", `{"requests": [{"prompt": "p"}]}`, func() { <-left.entered })
			require.Equal(t, 499, line.Status)
			if fault == nil {
				require.NotContains(t, logs.String(), `"level":"ERROR"`)
			} else {
				failed := loggedLine(t, logs, "request failed as its client left")
				require.Equal(t, line.RequestID, failed["request_id"], "the error line finds the request's")
				require.Contains(t, logs.String(), "disk on fire")
			}
			var batches int
			require.NoError(t, b.store.Pool().QueryRow(context.Background(), "SELECT count(*) FROM batches").Scan(&batches))
			require.Zero(t, batches, "nothing is stored")
		})
	}
}

// TestStreamErrorsAreLoggedAndCounted: a stream's head says 200 before its
// call has run, so the code of the response.error it sends is named in its
// access log line (as a JSON error reply's is) and counted by code, and a
// failure of the gateway's own is logged as an error, as a JSON reply's
// would be; a stream whose client left before its end is logged so.
func TestStreamErrorsAreLoggedAndCounted(t *testing.T) {
	t.Parallel()
	type bundle struct {
		*testBundle
		logs   *syncbuf.Buffer
		m      *metrics.Metrics
		ledger *failingLedger
	}
	setup := func(t *testing.T, h2c bool) bundle {
		b := bundle{ledger: &failingLedger{}}
		b.testBundle, b.logs, b.m = setupObserved(t, h2c, withLedger(b.ledger).server)
		return b
	}
	lastError := func(t *testing.T, s apitest.Stream) gateway.ErrorCode {
		var env api.ErrorEnvelope
		for _, e := range s.Events {
			if e.Name == "response.error" {
				e.Decode(t, &env)
			}
		}
		return gateway.ErrorCode(env.Error.Code)
	}

	t.Run("the gateway's own failure", func(t *testing.T) {
		t.Parallel()
		b := setup(t, false)
		b.ledger.fails, b.ledger.err = 1000, errors.New("disk on fire")
		r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
		require.Equal(t, gateway.EInternal, lastError(t, s), "the settlement was refused")
		id := r.header.Get("x-request-id")
		line := awaitLogged(t, b.logs, id)
		require.Equal(t, http.StatusOK, line.Status)
		require.Equal(t, "INTERNAL", line.ErrorCode)
		require.False(t, line.ClientLeft)
		failed := loggedLine(t, b.logs, "stream failed")
		require.Equal(t, id, failed["request_id"], "the error line finds the request's")
		require.Contains(t, failed["error"], "disk on fire")
		require.Contains(t, metricstest.Scrape(b.m), `gateway_stream_errors_total{code="INTERNAL"} 1`)

		// A JSON request's error line names its request too.
		r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "p"})
		require.Equal(t, http.StatusInternalServerError, r.status)
		require.Equal(t, "INTERNAL", awaitLogged(t, b.logs, r.header.Get("x-request-id")).ErrorCode)
		failed = loggedLine(t, b.logs, "request failed")
		require.Equal(t, r.header.Get("x-request-id"), failed["request_id"])
		require.Contains(t, failed["error"], "disk on fire")
	})
	t.Run("the upstream's failure and refusals", func(t *testing.T) {
		t.Parallel()
		b := setup(t, false)
		b.upstream.fail(upstream.ErrUnavailable)
		r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
		require.Equal(t, gateway.EInferenceBusy, lastError(t, s))
		require.Equal(t, "INFERENCE_BUSY", awaitLogged(t, b.logs, r.header.Get("x-request-id")).ErrorCode)
		r, s = b.stream("/api/v1/chat", map[string]any{"prompt": ""})
		require.Equal(t, gateway.EEmptyPrompt, lastError(t, s))
		require.Equal(t, "EMPTY_PROMPT", awaitLogged(t, b.logs, r.header.Get("x-request-id")).ErrorCode)
		r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": ""})
		require.Equal(t, http.StatusBadRequest, r.status)
		require.Equal(t, "EMPTY_PROMPT", awaitLogged(t, b.logs, r.header.Get("x-request-id")).ErrorCode, "a JSON reply's too")
		require.NotContains(t, b.logs.String(), `"level":"ERROR"`, "none is the gateway's failure")
		scraped := metricstest.Scrape(b.m)
		require.Contains(t, scraped, `gateway_stream_errors_total{code="INFERENCE_BUSY"} 1`)
		require.Contains(t, scraped, `gateway_stream_errors_total{code="EMPTY_PROMPT"} 1`)
		require.Contains(t, scraped, `gateway_stream_errors_total{code="INTERNAL"} 0`, "exported from the start, for the alert")
	})
	for _, h2c := range []bool{false, true} {
		t.Run("a stream that ends well, and one whose client left, "+protoName(h2c), func(t *testing.T) {
			t.Parallel()
			b := setup(t, h2c)
			r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
			require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
			line := awaitLogged(t, b.logs, r.header.Get("x-request-id"))
			require.Empty(t, line.ErrorCode)
			require.False(t, line.ClientLeft)

			// A client that leaves after the first delta, and one that leaves
			// before it, having read the head.
			for _, firstDelta := range []bool{true, false} {
				b.upstream.configure(func(s *scripted) {
					s.hang = true
					if !firstDelta {
						s.firstDelay = time.Minute
					}
				})
				ctx, cancel := context.WithCancel(context.Background())
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.http.URL+"/api/v1/responses", strings.NewReader(`{"prompt": "leave early", "stream": true}`))
				require.NoError(t, err)
				req.Header.Set("Authorization", "Bearer "+b.key)
				req.Header.Set("Content-Type", "application/json")
				resp, err := b.client.Do(req)
				require.NoError(t, err)
				if firstDelta {
					_, err = bufio.NewReader(resp.Body).ReadString('}')
					require.NoError(t, err)
				}
				cancel()
				_ = resp.Body.Close()
				line = awaitLogged(t, b.logs, resp.Header.Get("x-request-id"))
				require.Equal(t, http.StatusOK, line.Status, "the head said 200")
				require.True(t, line.ClientLeft)
				require.Empty(t, line.ErrorCode)
			}
			require.NotContains(t, b.logs.String(), `"level":"ERROR"`)
			require.Contains(t, metricstest.Scrape(b.m), `gateway_stream_errors_total{code="INTERNAL"} 0`)
		})
	}
}

// TestOpenStreamsAreCounted: gateway_open_streams counts a stream while it
// is open, and no longer once it ends.
func TestOpenStreamsAreCounted(t *testing.T) {
	t.Parallel()
	b, _, m := setupObserved(t, false, nil)
	b.upstream.configure(func(s *scripted) { s.hang = true })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel) // runs before the server's, which waits for its streams
	resp := b.openStream(ctx, t, `{"prompt": "held", "stream": true}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Eventually(t, func() bool { return b.upstream.callCount() == 1 }, 10*time.Second, time.Millisecond)
	require.Contains(t, metricstest.Scrape(m), "gateway_open_streams 1\n")
	cancel()
	require.Eventually(t, func() bool { return strings.Contains(metricstest.Scrape(m), "gateway_open_streams 0\n") },
		10*time.Second, 10*time.Millisecond, "the stream ended as its client left")
}
