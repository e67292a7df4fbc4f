package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/upstream"
)

// stream posts a streamed request and returns the validated reply and its events.
func (b *testBundle) stream(path string, body map[string]any) (reply, apitest.Stream) {
	b.t.Helper()
	return b.streamAs(b.key, path, body)
}

func (b *testBundle) streamAs(key, path string, body map[string]any) (reply, apitest.Stream) {
	b.t.Helper()
	body["stream"] = true
	r := b.post(path, key, body)
	require.Equal(b.t, http.StatusOK, r.status, "a streamed request always answers 200")
	require.Equal(b.t, "text/event-stream", r.header.Get("Content-Type"))
	s := apitest.ParseEvents(b.t, bytes.NewReader(r.body))
	apitest.ValidateEvents(b.t, s)
	return r, s
}

func chunks(t *testing.T, s apitest.Stream) []api.StreamChunk {
	t.Helper()
	out := make([]api.StreamChunk, len(s.Events))
	for i, e := range s.Events {
		e.Decode(t, &out[i])
	}
	return out
}

func TestStreamHappyPath(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "hello stream", "model": "reasoning", "web_search": true, "include_regions": true})
	require.Equal(t, "no-cache, no-transform", r.header.Get("Cache-Control"), "no proxy may hold events to compress them")
	require.Equal(t, "no", r.header.Get("X-Accel-Buffering"))
	require.Empty(t, r.header.Get("x-service-output-rungs"), "no output rung header on the stream")
	require.Empty(t, r.header.Get("x-service-total-rungs"), "no total rung header on the stream")
	require.Equal(t, "8", r.header.Get("x-service-input-rungs"), "the estimate (the upstream counted more, see the final usage)")
	require.Equal(t, "600", r.header.Get("x-ratelimit-limit"), "the head carries the rate-limit headers")
	require.Equal(t, "599", r.header.Get("x-ratelimit-remaining"))
	require.NotContains(t, string(r.body), "sources_url")

	pieces := streamPieces("hello stream")
	require.Len(t, s.Events, len(pieces)+1)
	all := chunks(t, s)
	var text strings.Builder
	for i, c := range all[:len(pieces)] {
		require.Equal(t, "response.output_text.delta", s.Events[i].Name)
		require.Equal(t, i, c.Index)
		require.False(t, c.Done)
		require.NotNil(t, c.RequestId)
		require.Equal(t, api.StreamChunkModel("reasoning"), *c.Model)
		if i == 0 {
			require.Len(t, *c.Sources, 2, "evidence on the first chunk")
		} else {
			require.Nil(t, c.Sources, "no empty sources array on the wire")
		}
		text.WriteString(c.Content)
	}
	require.Equal(t, "answer to hello stream", text.String())

	final := all[len(pieces)]
	require.Equal(t, "response.completed", s.Events[len(pieces)].Name)
	require.True(t, final.Done)
	require.Empty(t, final.Content)
	require.Equal(t, len(pieces), final.Index)
	require.Equal(t, &api.RungUsage{InputRungs: 44, OutputRungs: 20, TotalRungs: 64}, final.Usage)
	var raw struct{ Usage map[string]any }
	require.NoError(t, json.Unmarshal(s.Events[len(pieces)].Data, &raw))
	require.NotContains(t, raw.Usage, "regions_activated")

	// The evidence was committed under the streamed request's id.
	ev := b.do(http.MethodGet, "/api/v1/sources/"+final.RequestId.String(), b.key, "", nil)
	require.Equal(t, http.StatusOK, ev.status)
	require.Equal(t, "supported", ev.json(t)["evidence_verdict"])
}

func TestStreamValidationFailure(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for code, body := range map[gateway.ErrorCode]map[string]any{
		gateway.EEmptyPrompt:    {"prompt": ""},
		gateway.EInvalidModel:   {"prompt": "p", "model": "nope"},
		gateway.EInvalidRequest: {"prompt": "p", "max_output_rungs": 0},
	} {
		r, s := b.stream("/api/v1/chat", body)
		require.Len(t, s.Events, 1, code)
		require.Equal(t, "response.error", s.Events[0].Name)
		var env api.ErrorEnvelope
		s.Events[0].Decode(t, &env)
		require.Equal(t, api.ErrorCode(code), env.Error.Code)
		require.Equal(t, "0", r.header.Get("x-service-input-rungs"))
	}
	require.Zero(t, b.upstream.callCount())
}

// TestABodyThatDoesNotDecodeIsNoStream: a body that is not read as a request
// (malformed JSON, a field of the wrong type or named twice, bytes that are
// not UTF-8) is answered 400 in the envelope, whatever its stream says: only
// a request read whole streams.
func TestABodyThatDoesNotDecodeIsNoStream(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, body := range []string{
		`{"prompt":"p","stream":true,}`,
		`{"prompt":"p","stream":true,"max_output_rungs":"5"}`,
		`{"prompt":"p","stream":true,"model":"instant","model":"reasoning"}`,
		"{\"prompt\":\"caf\xe9\",\"stream\":true}",
	} {
		r := b.postRaw("/api/v1/responses", body)
		require.Equal(t, http.StatusBadRequest, r.status, body)
		require.Equal(t, "application/json", r.header.Get("Content-Type"), body)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t), body)
	}
	require.Zero(t, b.upstream.callCount())
}

func TestStreamFailsToStart(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.upstream.fail(upstream.ErrUnavailable)
	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
	require.Len(t, s.Events, 1, "an error and no completion")
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)
}

func TestStreamBreaksMidway(t *testing.T) {
	t.Parallel()
	// An error of no known kind, its client still there, is the upstream's
	// failure too, not its client's leaving.
	for _, cause := range []error{upstream.ErrStreamBroken, upstream.ErrFailed, errors.New("a failure of no known kind")} {
		streamBreaksMidway(t, cause)
	}
}

// streamBreaksMidway: an upstream failure after output, of any kind, ends the
// stream with response.error then response.completed with what was billed,
// and the request is stored as failed.
func streamBreaksMidway(t *testing.T, cause error) {
	b := setup(t, nil)
	b.upstream.configure(func(s *scripted) { s.breakAfter, s.breakWith = 2, cause })
	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "p"})
	require.Equal(t, []string{"response.output_text.delta", "response.output_text.delta", "response.error", "response.completed"},
		[]string{s.Events[0].Name, s.Events[1].Name, s.Events[2].Name, s.Events[3].Name})
	require.Len(t, s.Events, 4)
	var env api.ErrorEnvelope
	s.Events[2].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)
	var final api.StreamChunk
	s.Events[3].Decode(t, &final)
	require.Equal(t, 2, final.Index)
	// The upstream sent no usage: the output received ("answer to ") is counted with the tokenizer.
	require.Positive(t, final.Usage.OutputRungs)
	require.Positive(t, final.Usage.InputRungs)
	require.Equal(t, final.Usage.InputRungs+final.Usage.OutputRungs, final.Usage.TotalRungs)
	var status string
	var begunBefore bool
	require.NoError(t, b.store.Pool().QueryRow(context.Background(), `SELECT status, created_at < completed_at FROM requests`).Scan(&status, &begunBefore))
	require.Equal(t, "failed", status, "the request is stored as failed, with what it produced")
	require.True(t, begunBefore, "stored as begun when it was routed, before it ended")
}

func TestStreamKeepAlive(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{keepalive: 20 * time.Millisecond})
	// Fifty beats of silence before the first token: a busy machine that
	// runs the keep-alive timer late still sends two.
	b.upstream.configure(func(s *scripted) { s.firstDelay = time.Second })
	r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "slow"})
	require.GreaterOrEqual(t, s.Comments, 2, "keep-alives while waiting for the first token")
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	require.True(t, strings.HasPrefix(string(r.body), ":"), "the first bytes are a keep-alive, before any event")
}

// TestStreamClientDisconnect runs alone (not parallel) so that the goroutine
// count is this test's own: after the client goes away mid-stream, the upstream
// call is cancelled, the output so far is committed, and nothing is left running.
func TestStreamClientDisconnect(t *testing.T) {
	b := setupWith(t, options{keepalive: 10 * time.Millisecond})
	// Warm up (database connections, HTTP keep-alives, and the process's one
	// watch on detached streams' clients, which starts with the first), then
	// settle, then count.
	require.Equal(t, http.StatusOK, b.post("/api/v1/responses", b.key, map[string]any{"prompt": "warm up"}).status)
	b.upstream.configure(func(s *scripted) { s.firstDelay = 30 * time.Millisecond })
	b.stream("/api/v1/responses", map[string]any{"prompt": "warm up, detached"})
	b.upstream.configure(func(s *scripted) { s.firstDelay = 0 })
	quiesce := func() {
		http.DefaultClient.CloseIdleConnections()
		b.http.CloseClientConnections()
		// pgx reads a connection on a goroutine of its own once a write to
		// it has taken 15 ms (a loaded machine), and that goroutine waits
		// for the connection's next reply, however long it stays idle: a
		// ping of each idle connection gives it one.
		for _, c := range b.store.Pool().AcquireAllIdle(context.Background()) {
			_ = c.Ping(context.Background())
			c.Release()
		}
	}
	quiesce()
	time.Sleep(100 * time.Millisecond)
	baseline := runtime.NumGoroutine()
	b.upstream.configure(func(s *scripted) { s.hang = true })

	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.http.URL+"/api/v1/responses", strings.NewReader(`{"prompt": "leave early", "stream": true}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Transport: &http.Transport{}}
	resp, err := client.Do(req)
	require.NoError(t, err)
	reader := bufio.NewReader(resp.Body)
	var first api.StreamChunk
	for {
		line, err := reader.ReadString('\n')
		require.NoError(t, err)
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			require.NoError(t, json.Unmarshal([]byte(data), &first))
			break
		}
	}
	cancel()
	resp.Body.Close()
	client.CloseIdleConnections()

	// The partial output is committed: its evidence appears.
	require.Eventually(t, func() bool {
		r := b.do(http.MethodGet, "/api/v1/sources/"+first.RequestId.String(), b.key, "", nil)
		return r.status == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond)

	// Poll in this goroutine: require.Eventually would add goroutines of its own.
	deadline := time.Now().Add(10 * time.Second)
	for {
		quiesce()
		if n := runtime.NumGoroutine(); n <= baseline {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("goroutines leaked: %d now, %d before\n%s", n, baseline, goroutineDump())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func goroutineDump() string {
	buf := make([]byte, 1<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

// flood is a provider whose stream sends pieces of 64 KiB until it has sent
// n, or emit fails; emitFailed is closed then. Its reply is the n pieces.
type flood struct {
	n          int
	emitFailed chan struct{}
}

func (f *flood) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	return upstream.Result{Content: strings.Repeat("x", f.n*64<<10), UsageReported: true, InputTokens: 1, OutputTokens: 1}, nil
}

func (f *flood) Stream(_ context.Context, _ *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	piece := strings.Repeat("x", 64<<10)
	var sent upstream.Result
	for range f.n {
		if err := emit(upstream.Delta{Content: piece}); err != nil {
			close(f.emitFailed)
			return sent, err
		}
		sent.Content += piece
	}
	return sent, nil
}

// TestStreamToAClientThatReadsNothing: a client that sends a streamed request
// and then reads nothing, its connection alive (its receive window shut), is
// not waited for: once a write has waited StreamWriteTimeout (at the next
// keep-alive beat), the stream ends as when a client disconnects, the
// upstream call stops, and the output produced is billed and settled, the
// stream counted as a client's leaving, not an upstream failure. Without the
// bound the stream would wait on the write for as long as the client keeps
// its connection, its admitted estimate never settled.
func TestStreamToAClientThatReadsNothing(t *testing.T) {
	t.Parallel()
	const body = `{"prompt": "flood", "model": "reasoning", "stream": true}`
	eachStreamWay(t, func(t *testing.T, h2c bool, way func(*server.Config)) {
		up := &flood{n: 200, emitFailed: make(chan struct{})} // 12.5 MiB, past any socket buffer or window
		m := metrics.New()
		b := setupWith(t, options{provider: up, h2c: h2c, keepalive: 50 * time.Millisecond, server: func(c *server.Config) {
			c.StreamWriteTimeout = 200 * time.Millisecond
			c.Metrics = m
			way(c)
		}})
		if h2c {
			// The client's window fills as the body goes unread.
			req, err := http.NewRequest(http.MethodPost, b.http.URL+"/api/v1/responses", strings.NewReader(body))
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+b.key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := b.client.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, 2, resp.ProtoMajor)
		} else {
			b.postUnread(body)
		}

		select {
		case <-up.emitFailed:
		case <-time.After(20 * time.Second):
			t.Fatal("the stream still waits for a client that reads nothing")
		}
		var usage api.UsageView
		require.Eventually(t, func() bool {
			r := b.do(http.MethodGet, "/api/v1/usage", b.key, "", nil)
			require.Equal(t, http.StatusOK, r.status)
			require.NoError(t, json.Unmarshal(r.body, &usage))
			return usage.Totals.Requests == 1 && usage.Budget.ReservedRungs == 0
		}, 10*time.Second, 20*time.Millisecond, "the request is settled: %+v", usage)
		require.Positive(t, usage.Totals.OutputRungs, "the output produced is billed")
		require.Contains(t, metricstest.Scrape(m), `gateway_stream_errors_total{code="INFERENCE_BUSY"} 0`,
			"a client gone, not the upstream's failure")
	})
}

// postUnread posts body to the responses route over HTTP/1.1 from a client
// that reads nothing of the reply (a small receive buffer, soon full), and
// keeps its connection open until the test ends.
func (b *testBundle) postUnread(body string) {
	b.t.Helper()
	conn := b.narrowConn(b.t)
	_, err := fmt.Fprintf(conn, "POST /api/v1/responses HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer %s\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", b.key, len(body), body)
	require.NoError(b.t, err)
}

// narrowConn is a connection to the server whose receive buffer is as small
// as the kernel allows, closed when the test ends.
func (b *testBundle) narrowConn(t testing.TB) net.Conn {
	t.Helper()
	dialer := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
	conn, err := dialer.Dial("tcp", strings.TrimPrefix(b.http.URL, "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// TestReplyToAClientThatReadsNothing: a reply that is not a stream, too large
// for the sockets' buffers, to a client that reads nothing, its connection
// alive, holds the handler no longer than ReplyWriteTimeout (its log line is
// written when the handler returns); the usage was billed before the reply.
func TestReplyToAClientThatReadsNothing(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{provider: &flood{n: 200}, logs: logs, server: func(c *server.Config) {
		c.ReplyWriteTimeout = 200 * time.Millisecond
	}})
	b.postUnread(`{"prompt": "flood", "model": "reasoning"}`)
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `"route":"/api/v1/responses","status":200`)
	}, 20*time.Second, 20*time.Millisecond, "the handler still writes to a client that reads nothing")
}

// eachStreamWay runs test, in parallel, for each way a stream is served: over
// HTTP/1.1 detached from its handler, over HTTP/1.1 on its handler, and over
// HTTP/2 (h2c); way sets the server's configuration for it.
func eachStreamWay(t *testing.T, test func(t *testing.T, h2c bool, way func(*server.Config))) {
	for name, h2c := range map[string]bool{"HTTP/1.1 detached": false, "HTTP/1.1 on its handler": false, "HTTP/2": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, h2c, func(c *server.Config) {
				if name == "HTTP/1.1 on its handler" {
					c.DetachAfter = -1
				}
			})
		})
	}
}

// TestStreamOutlastsTheBodyTimeout: the body's read deadline ends with the
// body (net/http lifts it once the body is read, to watch for the client
// leaving); a stream that waits past it for its first token is not taken
// for a client gone.
func TestStreamOutlastsTheBodyTimeout(t *testing.T) {
	t.Parallel()
	eachStreamWay(t, func(t *testing.T, h2c bool, way func(*server.Config)) {
		const timeout = 100 * time.Millisecond
		b := setupWith(t, options{h2c: h2c, server: func(c *server.Config) {
			c.BodyTimeout = timeout
			way(c)
		}})
		b.upstream.configure(func(s *scripted) { s.firstDelay = 4 * timeout })
		_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "slow to start"})
		require.NotEmpty(t, s.Events)
		require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	})
}

// TestStreamWriteDeadlineSparesClientsThatRead: the write bound is a write's,
// not a stream's: a stream silent for longer than StreamWriteTimeout before
// its first token is served whole, and its connection, kept alive, serves the
// next request, and the next, later than that and than ReplyWriteTimeout (a
// reply's deadline is lifted once it is written).
func TestStreamWriteDeadlineSparesClientsThatRead(t *testing.T) {
	t.Parallel()
	eachStreamWay(t, func(t *testing.T, h2c bool, way func(*server.Config)) {
		const timeout = 100 * time.Millisecond
		b := setupWith(t, options{h2c: h2c, keepalive: timeout / 2, server: func(c *server.Config) {
			c.StreamWriteTimeout, c.ReplyWriteTimeout = timeout, timeout
			way(c)
		}})
		if !h2c {
			tr := &http.Transport{MaxConnsPerHost: 1}
			b.client = &http.Client{Transport: tr}
			t.Cleanup(tr.CloseIdleConnections)
		}
		b.upstream.configure(func(s *scripted) { s.firstDelay = 3 * timeout })
		_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "slow to start"})
		require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)

		for range 2 {
			time.Sleep(3 * timeout)
			var reused bool
			ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused }})
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.http.URL+"/api/v1/usage", nil)
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+b.key)
			resp, err := b.client.Do(req)
			require.NoError(t, err)
			_, err = io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.NoError(t, resp.Body.Close())
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.True(t, reused, "the stream's connection serves the next requests")
		}
	})
}
