package server_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/upstream"
)

// rawRequest is an HTTP/1.x request as written on the wire.
func (b *testBundle) rawRequest(method, path, proto, body string, header ...string) string {
	var sb strings.Builder
	sb.WriteString(method + " " + path + " " + proto + "\r\nHost: test\r\n")
	if body != "" {
		sb.WriteString("Authorization: Bearer " + b.key + "\r\nContent-Type: application/json\r\n")
		sb.WriteString("Content-Length: " + strconv.Itoa(len(body)) + "\r\n")
	}
	for _, h := range header {
		sb.WriteString(h + "\r\n")
	}
	sb.WriteString("\r\n" + body)
	return sb.String()
}

// dialRaw opens a connection to the test server.
func (b *testBundle) dialRaw(t *testing.T) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", b.http.Listener.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	require.NoError(t, conn.SetDeadline(time.Now().Add(30*time.Second)))
	return conn, bufio.NewReader(conn)
}

// readStream reads a stream's reply from r and checks its events.
func readStream(t *testing.T, r *bufio.Reader) (*http.Response, apitest.Stream) {
	t.Helper()
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	s := apitest.ParseEvents(t, strings.NewReader(string(body)))
	apitest.ValidateEvents(t, s)
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	return resp, s
}

// TestStreamsKeepTheirConnection: streams slower than DetachAfter are served
// off their connection's goroutine, quicker ones by net/http, both as chunks,
// and the connection then serves the client's next requests, streamed or
// not: one connection for all of them.
func TestStreamsKeepTheirConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var dials atomic.Int32
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}}
	for i, streamed := range []bool{true, true, false, true} {
		delay := 50 * time.Millisecond // detached
		if i == 1 {
			delay = 0 // done before DetachAfter, most likely
		}
		b.upstream.configure(func(s *scripted) { s.firstDelay = delay })
		body := `{"prompt":"again"}`
		if streamed {
			body = `{"prompt":"again","stream":true}`
		}
		req, err := http.NewRequest(http.MethodPost, b.http.URL+"/api/v1/responses", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+b.key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		require.NoError(t, err)
		raw, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "request %d", i)
		if streamed {
			require.Equal(t, []string{"chunked"}, resp.TransferEncoding)
			require.False(t, resp.Close, "the connection stays open")
			s := apitest.ParseEvents(t, strings.NewReader(string(raw)))
			apitest.ValidateEvents(t, s)
			require.NotEmpty(t, resp.Header.Get(server.RequestIDHeader), "the middleware's headers are in the head")
			require.NotEmpty(t, resp.Header.Get("Date"))
		}
	}
	require.Equal(t, int32(1), dials.Load(), "one connection served every request")
}

// TestStreamThenPipelinedRequest: a request the client sent behind a stream's,
// before the stream ended, is answered after it on the same connection.
func TestStreamThenPipelinedRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.upstream.configure(func(s *scripted) { s.firstDelay = 50 * time.Millisecond })
	conn, r := b.dialRaw(t)
	_, err := io.WriteString(conn, b.rawRequest(http.MethodPost, "/api/v1/responses", "HTTP/1.1", `{"prompt":"first","stream":true}`)+
		b.rawRequest(http.MethodGet, "/healthz", "HTTP/1.1", ""))
	require.NoError(t, err)
	readStream(t, r)
	readOK(t, r)

	// And a request sent once the stream is over is served too.
	_, err = io.WriteString(conn, b.rawRequest(http.MethodPost, "/api/v1/responses", "HTTP/1.1", `{"prompt":"second","stream":true}`))
	require.NoError(t, err)
	readStream(t, r)
}

// readOK reads a reply from r, which must be a 200, to its end.
func readOK(t *testing.T, r *bufio.Reader) {
	t.Helper()
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	_, err = io.Copy(io.Discard, resp.Body)
	require.NoError(t, err)
}

// TestStreamConnectionClose: a client that asks to close gets its stream, told
// the connection closes, and then it does.
func TestStreamConnectionClose(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.upstream.configure(func(s *scripted) { s.firstDelay = 50 * time.Millisecond })
	conn, r := b.dialRaw(t)
	_, err := io.WriteString(conn, b.rawRequest(http.MethodPost, "/api/v1/responses", "HTTP/1.1", `{"prompt":"bye","stream":true}`, "Connection: close"))
	require.NoError(t, err)
	resp, _ := readStream(t, r)
	require.True(t, resp.Close)
	_, err = r.ReadByte()
	require.ErrorIs(t, err, io.EOF, "the server closed the connection")
}

// TestStreamHTTP10: an HTTP/1.0 client, which has no chunks, gets its stream
// delimited by the connection's end, a stream that runs past DetachAfter too
// (it is not detached: a detached stream is written as chunks).
func TestStreamHTTP10(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.upstream.configure(func(s *scripted) { s.firstDelay = 200 * time.Millisecond })
	conn, r := b.dialRaw(t)
	_, err := io.WriteString(conn, b.rawRequest(http.MethodPost, "/api/v1/responses", "HTTP/1.0", `{"prompt":"old","stream":true}`))
	require.NoError(t, err)
	resp, _ := readStream(t, r)
	require.Empty(t, resp.TransferEncoding)
	require.True(t, resp.Close)
}

// TestStreamIsLoggedWhenItEnds: the access log line of a detached stream is
// written when it ends, with its whole duration and size.
func TestStreamIsLoggedWhenItEnds(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(protoName(h2c), func(t *testing.T) {
			t.Parallel()
			logs := &syncbuf.Buffer{}
			b := setupWith(t, options{h2c: h2c, logs: logs})
			b.upstream.configure(func(s *scripted) { s.firstDelay = 200 * time.Millisecond })
			r, _ := b.stream("/api/v1/responses", map[string]any{"prompt": "log me"})
			require.Equal(t, protoName(h2c), r.proto)
			id := r.header.Get(server.RequestIDHeader)
			line, found := loggedRequest(t, logs, func(l accessLogLine) bool { return l.RequestID == id })
			require.True(t, found, "the stream's log line:\n%s", logs.String())
			require.Equal(t, "/api/v1/responses", line.Route)
			require.Equal(t, http.StatusOK, line.Status)
			require.Equal(t, len(r.body), line.Bytes, "the bytes of the events sent")
			require.GreaterOrEqual(t, line.DurationMS, 200.0, "the stream's whole duration")
			require.Equal(t, "acme", line.Account)
		})
	}
}

// protoName is the protocol the bundle's client speaks, as a response
// names it.
func protoName(h2c bool) string {
	if h2c {
		return "HTTP/2.0"
	}
	return "HTTP/1.1"
}

// TestHTTP2StreamsLeaveTheirHandlers: over HTTP/2, streams slower than
// DetachAfter go on after their handlers returned through echo (whose
// response objects then serve other requests), each writing only its own
// response, beside quick streams and JSON replies on the same connection.
func TestHTTP2StreamsLeaveTheirHandlers(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{h2c: true})
	b.upstream.configure(func(s *scripted) { s.firstDelay = 50 * time.Millisecond })
	const n = 20
	type result struct {
		r reply
		s apitest.Stream
	}
	results := make(chan result, n)
	for range n {
		go func() {
			r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "mine"})
			results <- result{r, s}
		}()
	}
	// Meanwhile, echo's contexts serve other requests.
	for range n {
		r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": "json"})
		require.Equal(t, http.StatusOK, r.status)
		require.Equal(t, "HTTP/2.0", r.proto)
	}
	for range n {
		res := <-results
		require.Equal(t, "HTTP/2.0", res.r.proto)
		id := res.r.header.Get(server.RequestIDHeader)
		require.NotEmpty(t, id)
		chunks := chunks(t, res.s)
		require.True(t, chunks[len(chunks)-1].Done, "the stream ends whole")
		for _, c := range chunks {
			require.Equal(t, id, c.RequestId.String(), "every event is of this stream's request")
		}
	}
	require.EqualValues(t, 2*n, b.usage(t, b.key).Totals.Requests)
}

// TestHTTP2StreamEndsWithItsClient: a client that resets its HTTP/2 stream
// after it was detached from its handler ends its call; what it produced is
// billed.
func TestHTTP2StreamEndsWithItsClient(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{h2c: true})
	b.upstream.configure(func(s *scripted) { s.hang = true })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp := b.openStream(ctx, t, `{"prompt":"hang on","stream":true}`)
	require.Equal(t, "HTTP/2.0", resp.Proto)
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "event: response.output_text.delta\n", line, "the first piece is out")
	time.Sleep(30 * time.Millisecond) // past DetachAfter
	cancel()

	b.requireBilledOnce(t)
}

// TestAnHTTP2StreamWhoseClientLeftIsDone: once a client has reset its HTTP/2
// stream, the server holds nothing of it: no write deadline is set on the
// closed stream, whose timer would keep it for the write timeout and then
// reset it again (RST_STREAM INTERNAL_ERROR, for a stream the client
// already closed). An event stream, left before or after its first token,
// before or after it is detached from its handler; a JSON reply done as its
// client left.
func TestAnHTTP2StreamWhoseClientLeftIsDone(t *testing.T) {
	t.Parallel()
	for name, firstDelay := range map[string]time.Duration{"before its first token": time.Minute, "after it": 0} {
		for _, wait := range []time.Duration{0, 30 * time.Millisecond} { // before DetachAfter, past it
			t.Run(fmt.Sprintf("%s, reset after %s", name, wait), func(t *testing.T) {
				t.Parallel()
				b := setupWith(t, options{h2c: true, server: func(c *server.Config) { c.StreamWriteTimeout = 100 * time.Millisecond }})
				b.upstream.configure(func(s *scripted) { s.hang, s.firstDelay = true, firstDelay })
				conn, framer := b.dialHTTP2(t)
				b.writeResponseRequest(t, framer, 1, `{"prompt":"leave me","stream":true}`)
				for {
					f, err := framer.ReadFrame()
					require.NoError(t, err)
					if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == 1 {
						break // the stream's head
					}
				}
				time.Sleep(wait)
				require.NoError(t, framer.WriteRSTStream(1, http2.ErrCodeCancel))
				// Past the write timeout (set at the stream's end, it would fire
				// 100 ms after it), nothing more comes for stream 1.
				requireNotResetAgain(t, conn, framer, 1)
			})
		}
	}
	// A JSON reply that was done as its client left (its upstream answered
	// as the call was cancelled) is not given a deadline either.
	t.Run("a JSON reply", func(t *testing.T) {
		t.Parallel()
		left := make(chan struct{})
		b := setupWith(t, options{h2c: true, provider: answersAsItsCallerLeaves{left}, server: func(c *server.Config) { c.ReplyWriteTimeout = 100 * time.Millisecond }})
		conn, framer := b.dialHTTP2(t)
		b.writeResponseRequest(t, framer, 1, `{"prompt":"leave me"}`)
		<-left // the call is running
		require.NoError(t, framer.WriteRSTStream(1, http2.ErrCodeCancel))
		requireNotResetAgain(t, conn, framer, 1)
		require.EqualValues(t, 1, b.usage(t, b.key).Totals.Requests, "the reply was done, and billed")
	})
}

// answersAsItsCallerLeaves is an upstream whose answer comes as its caller
// leaves: it says on left that the call is running, and answers once the
// call's context ends.
type answersAsItsCallerLeaves struct{ left chan struct{} }

func (a answersAsItsCallerLeaves) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	close(a.left)
	<-ctx.Done()
	return answer(req), nil
}

func (a answersAsItsCallerLeaves) Stream(ctx context.Context, req *upstream.Request, _ func(upstream.Delta) error) (upstream.Result, error) {
	return a.Complete(ctx, req)
}

// requireNotResetAgain reads framer's connection for a second, answering
// pings, and fails if the server resets stream id, which the client reset.
func requireNotResetAgain(t *testing.T, conn net.Conn, framer *http2.Framer, id uint32) {
	t.Helper()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(time.Second)))
	for {
		f, err := framer.ReadFrame()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return
		}
		require.NoError(t, err)
		if rst, ok := f.(*http2.RSTStreamFrame); ok {
			require.NotEqual(t, id, rst.StreamID, "stream %d was reset again (%v)", id, rst.ErrCode)
		}
		if p, ok := f.(*http2.PingFrame); ok && !p.IsAck() {
			require.NoError(t, framer.WritePing(true, p.Data))
		}
	}
}

// dialHTTP2 opens an HTTP/2 connection without TLS to the test server,
// its preface and settings sent, and returns it with its framer.
func (b *testBundle) dialHTTP2(t *testing.T) (net.Conn, *http2.Framer) {
	t.Helper()
	conn, _ := b.dialRaw(t)
	_, err := io.WriteString(conn, http2.ClientPreface)
	require.NoError(t, err)
	framer := http2.NewFramer(conn, conn)
	require.NoError(t, framer.WriteSettings())
	return conn, framer
}

// writeResponseRequest sends a request to the responses route (body, JSON) on
// stream id of framer's connection.
func (b *testBundle) writeResponseRequest(t *testing.T, framer *http2.Framer, id uint32, body string) {
	t.Helper()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":authority", "test"}, {":path", "/api/v1/responses"},
		{"authorization", "Bearer " + b.key}, {"content-type", "application/json"}, {"content-length", strconv.Itoa(len(body))},
	} {
		require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
	}
	require.NoError(t, framer.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndHeaders: true}))
	require.NoError(t, framer.WriteData(id, true, []byte(body)))
}

// openStream posts a streamed request (body, JSON) through the bundle's
// client, ended by ctx, and returns the response once its head is in; its
// body is closed when the test ends.
func (b *testBundle) openStream(ctx context.Context, t *testing.T, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.http.URL+"/api/v1/responses", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// panicsMidStream is an upstream whose streams panic after their first piece,
// 50 ms later (past the tests' DetachAfter).
type panicsMidStream struct{ upstream.Provider }

func (panicsMidStream) Stream(_ context.Context, _ *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	_ = emit(upstream.Delta{Content: "half"})
	time.Sleep(50 * time.Millisecond)
	panic("upstream client bug")
}

// TestAStreamThatPanicsIsCut: a stream that panics, once detached or still
// its handler's, is logged (as a stream's panic, or as any handler's) and
// cut (the connection closed before the last chunk, the HTTP/2 stream
// reset), never ended as if whole; the server goes on.
func TestAStreamThatPanicsIsCut(t *testing.T) {
	t.Parallel()
	for _, detached := range []bool{true, false} {
		for _, h2c := range []bool{false, true} {
			logged := "panic serving a stream"
			o := options{h2c: h2c, provider: panicsMidStream{}, logs: &syncbuf.Buffer{}}
			if !detached {
				logged = "panic serving request"
				o.server = func(c *server.Config) { c.DetachAfter = time.Hour }
			}
			t.Run(fmt.Sprintf("%s, detached %t", protoName(h2c), detached), func(t *testing.T) {
				t.Parallel()
				b := setupWith(t, o)
				resp := b.openStream(context.Background(), t, `{"prompt":"p","stream":true}`)
				require.Equal(t, http.StatusOK, resp.StatusCode)
				body, err := io.ReadAll(resp.Body)
				require.Error(t, err, "the stream is cut, not ended")
				require.Contains(t, string(body), "half", "what was sent before the panic arrived")
				require.NotContains(t, string(body), "response.completed")
				require.Eventually(t, func() bool { return strings.Contains(o.logs.String(), logged) }, 5*time.Second, 10*time.Millisecond)
				if !detached {
					require.NotContains(t, o.logs.String(), "panic serving a stream", "not detached")
				}
				require.Equal(t, http.StatusOK, b.do(http.MethodGet, "/healthz", "", "", nil).status, "the server lives on")
			})
		}
	}
}

// TestWaitStreams: shutdown can wait for the streams served off their
// connections' goroutines, and cut those still open past its grace.
func TestWaitStreams(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, _, resp := b.hangingStream(t)

	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		defer cancel()
		return errors.Is(b.server.WaitStreams(ctx), context.DeadlineExceeded)
	}, 5*time.Second, 10*time.Millisecond, "the stream is detached, and open")

	b.server.CloseStreams()
	_, err := io.ReadAll(resp.Body)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF, "the stream was cut before its last chunk")
	require.NoError(t, b.server.WaitStreams(context.Background()))
	b.requireBilledOnce(t)
}

// hangingStream opens a stream whose upstream stops after its first piece,
// on a connection of its own, and returns them once the head is in, with
// the connection's reader (what follows the stream's reply).
func (b *testBundle) hangingStream(t *testing.T) (net.Conn, *bufio.Reader, *http.Response) {
	t.Helper()
	b.upstream.configure(func(s *scripted) { s.hang = true })
	conn, r := b.rawStream(t, 0)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	return conn, r, resp
}

// rawStream asks for a stream, whose upstream's first piece comes after
// firstDelay, on a connection of its own, and returns it.
func (b *testBundle) rawStream(t *testing.T, firstDelay time.Duration) (net.Conn, *bufio.Reader) {
	t.Helper()
	b.upstream.configure(func(s *scripted) { s.firstDelay = firstDelay })
	conn, r := b.dialRaw(t)
	_, err := io.WriteString(conn, b.rawRequest(http.MethodPost, "/api/v1/responses", "HTTP/1.1", `{"prompt":"first","stream":true}`))
	require.NoError(t, err)
	return conn, r
}

// awaitDetached waits until a stream is detached: shutdown would wait for
// it.
func (b *testBundle) awaitDetached(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		defer cancel()
		return b.server.WaitStreams(ctx) != nil
	}, 5*time.Second, time.Millisecond, "the stream is detached")
}

// requireBilledOnce waits until one request is billed and nothing is
// reserved any more.
func (b *testBundle) requireBilledOnce(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		v := b.usage(t, b.key)
		return v.Totals.Requests == 1 && v.Budget.ReservedRungs == 0
	}, 5*time.Second, 10*time.Millisecond, "the output sent is billed, the reservation settled")
}

// TestARequestBegunDuringADetachedStreamIsServedAfterIt: the next request's
// first bytes, sent while a detached stream still runs (its client watched),
// are not lost: the request is answered after the stream, on the same
// connection.
func TestARequestBegunDuringADetachedStreamIsServedAfterIt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	conn, r := b.rawStream(t, 200*time.Millisecond)
	b.awaitDetached(t)
	_, err := io.WriteString(conn, b.rawRequest(http.MethodGet, "/healthz", "HTTP/1.1", ""))
	require.NoError(t, err)
	readStream(t, r)
	readOK(t, r)
}

// TestADrainingReplicaClosesAStreamsConnectionAtItsEnd: a detached stream
// that ends once its replica drains closes its connection after the last
// chunk rather than giving it back for another request.
func TestADrainingReplicaClosesAStreamsConnectionAtItsEnd(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	conn, r := b.rawStream(t, 200*time.Millisecond)
	b.awaitDetached(t)
	b.server.Drain()
	readStream(t, r)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := r.ReadByte()
	require.ErrorIs(t, err, io.EOF, "the connection is closed")
}

// TestAConnectionBackAfterAStreamKeepsNoDeadline: the write deadline that
// bounded a detached stream's end is lifted when its connection goes back
// to the server: a request sent on it later than that is answered, even by
// net/http itself (which sets no deadline of its own: a 400 for a request
// it cannot read).
func TestAConnectionBackAfterAStreamKeepsNoDeadline(t *testing.T) {
	t.Parallel()
	const timeout = 100 * time.Millisecond
	b := setupWith(t, options{server: func(c *server.Config) { c.StreamWriteTimeout = timeout }})
	conn, r := b.rawStream(t, 50*time.Millisecond)
	readStream(t, r)
	time.Sleep(3 * timeout) // past the deadline set as the stream ended
	_, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: gateway\r\nBad Header\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

// TestAStreamEndsWithItsClient: the client of a stream going away ends its
// call, before the stream is detached (seen by net/http) or after (seen by
// the watch on its connection, long before a keep-alive would fail); what
// it produced is billed.
func TestAStreamEndsWithItsClient(t *testing.T) {
	t.Parallel()
	for name, o := range map[string]options{
		"not yet detached": {server: func(c *server.Config) { c.DetachAfter = time.Hour }},
		"detached":         {keepalive: time.Hour},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupWith(t, o)
			conn, _, resp := b.hangingStream(t)
			if name == "detached" {
				b.awaitDetached(t)
			}
			line, err := bufio.NewReader(resp.Body).ReadString('\n')
			require.NoError(t, err)
			require.Equal(t, "event: response.output_text.delta\n", line, "the first piece is out")
			require.NoError(t, conn.Close())

			b.requireBilledOnce(t)
			require.NoError(t, b.server.WaitStreams(context.Background()), "nothing is left open")
		})
	}
}

// TestADetachedStreamWhoseClientStopsSendingEnds: a client that shuts its
// side of the connection down (a half-close) while its detached stream waits
// has gone as far as the gateway can tell: its call ends, what it produced
// is billed, and the stream's end, its last chunk, is the last the client
// reads before the connection closes: nothing taken for a next request
// follows it.
func TestADetachedStreamWhoseClientStopsSendingEnds(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{keepalive: time.Hour})
	conn, r, resp := b.hangingStream(t)
	b.awaitDetached(t)

	require.NoError(t, conn.(*net.TCPConn).CloseWrite())
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err, "the stream ends with its last chunk")
	require.Contains(t, string(body), "event: response.output_text.delta\n", "the first piece is out")
	b.requireBilledOnce(t)
	rest, err := io.ReadAll(r)
	require.NoError(t, err, "the connection is closed")
	require.Empty(t, string(rest))
}

// TestStreamsStayWithoutTheListener: a server whose listener is not wrapped
// (nothing would take connections back) keeps its streams on their
// connections' goroutines, however long they run.
func TestStreamsStayWithoutTheListener(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{plainListener: true})
	b.upstream.configure(func(s *scripted) { s.firstDelay = 100 * time.Millisecond })
	streamed := make(chan apitest.Stream, 1)
	go func() {
		_, s := b.stream("/api/v1/responses", map[string]any{"prompt": "stay"})
		streamed <- s
	}()
	require.Eventually(t, func() bool { return b.upstream.callCount() == 1 }, 5*time.Second, time.Millisecond)
	time.Sleep(30 * time.Millisecond) // past DetachAfter, before the first piece
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.NoError(t, b.server.WaitStreams(ctx), "no stream is detached")
	s := <-streamed
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
}
