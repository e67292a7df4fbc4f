package http1_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/blackhole"
	"github.com/rungworks/gateway/internal/lostpeer"
	"github.com/rungworks/gateway/internal/testlisten"
	"github.com/rungworks/gateway/upstream/http1"
)

// testBundle is an upstream that records the connections its calls came on.
type testBundle struct {
	server *httptest.Server
	client *http1.Client

	mu      sync.Mutex
	remotes []string // the client's address of each call, in order
	closed  atomic.Int32
	release chan struct{} // closed when the test ends
}

func setup(t *testing.T, cfg http1.Config, handler http.HandlerFunc) *testBundle {
	t.Helper()
	b := &testBundle{client: http1.New(cfg), release: make(chan struct{})}
	b.server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		b.remotes = append(b.remotes, r.RemoteAddr)
		b.mu.Unlock()
		handler(w, r)
	}))
	b.server.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateClosed {
			b.closed.Add(1)
		}
	}
	b.server.Start()
	t.Cleanup(b.server.Close)
	t.Cleanup(b.client.CloseIdleConnections)
	t.Cleanup(func() { close(b.release) })
	return b
}

// hold keeps a handler until the client closes its connection (the server
// sees it once the request's body was read) or the test ends.
func (b *testBundle) hold(r *http.Request) {
	select {
	case <-b.release:
	case <-r.Context().Done():
	}
}

func (b *testBundle) calls() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.remotes...)
}

func echo(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("X-Path", r.URL.Path)
	_, _ = fmt.Fprintf(w, "%s %s", r.Header.Get("Authorization"), body)
}

// call makes a POST and returns the reply's body read to its end.
func call(t *testing.T, ctx context.Context, c *http1.Client, url, body string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer k")
	resp, err := c.Do(req, nil)
	require.NoError(t, err)
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	return resp, string(raw)
}

func TestCallsReuseTheirConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{}, echo)
	for i := range 3 {
		resp, got := call(t, context.Background(), b.client, b.server.URL+"/v1/chat", fmt.Sprintf("body %d", i))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "/v1/chat", resp.Header.Get("X-Path"))
		require.Equal(t, fmt.Sprintf("Bearer k body %d", i), got)
	}
	calls := b.calls()
	require.Len(t, calls, 3)
	require.Equal(t, calls[0], calls[1])
	require.Equal(t, calls[0], calls[2])
	require.Zero(t, b.closed.Load())
	b.client.CloseIdleConnections()
	require.Eventually(t, func() bool { return b.closed.Load() == 1 }, 5*time.Second, time.Millisecond, "closed with the idle connections")
}

// TestLargeBodiesAndChunkedRepliesPassTheSmallBuffer: a 100 KB request and
// its reply, chunked, pass a read buffer of 16 bytes and a bound of 4 KiB on
// a reply's head; a reply to HEAD has no body, whatever its length says.
func TestLargeBodiesAndChunkedRepliesPassTheSmallBuffer(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{BufferSize: 16, MaxHeaderBytes: 4 << 10}, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Length", "5") // the length a GET would have, and no body
			return
		}
		body, _ := io.ReadAll(r.Body)
		for i := 0; i < len(body); i += 1000 {
			_, _ = w.Write(body[i:min(i+1000, len(body))])
			w.(http.Flusher).Flush() // chunked
		}
	})
	big := strings.Repeat("0123456789", 10_000)
	resp, got := call(t, context.Background(), b.client, b.server.URL, big)
	require.Equal(t, []string{"chunked"}, resp.TransferEncoding)
	require.Equal(t, big, got)
	call(t, context.Background(), b.client, b.server.URL, "again")
	calls := b.calls()
	require.Equal(t, calls[0], calls[1])

	// A reply to HEAD has no body, whatever its length says.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, b.server.URL, nil)
	require.NoError(t, err)
	resp, err = b.client.Do(req, nil)
	require.NoError(t, err)
	require.Equal(t, int64(5), resp.ContentLength)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Empty(t, body)
	require.NoError(t, resp.Body.Close())
}

func TestConnectedIsCalledOnlyWithAConnection(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())

	client := http1.New(http1.Config{})
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/", strings.NewReader("x"))
	require.NoError(t, err)
	connected := false
	_, err = client.Do(req, func() { connected = true })
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	require.False(t, connected)

	b := setup(t, http1.Config{}, echo)
	req, err = http.NewRequest(http.MethodPost, b.server.URL, strings.NewReader("x"))
	require.NoError(t, err)
	resp, err := b.client.Do(req, func() { connected = true })
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.True(t, connected)
}

// TestOnlyPlainHTTPIsSpoken: an https:// URL is refused before any
// connection; an http:// URL without a port is called on port 80.
func TestOnlyPlainHTTPIsSpoken(t *testing.T) {
	t.Parallel()
	client := http1.New(http1.Config{})
	t.Cleanup(client.CloseIdleConnections)
	connected := false
	req, err := http.NewRequest(http.MethodPost, "https://127.0.0.1:1/", strings.NewReader("x"))
	require.NoError(t, err)
	_, err = client.Do(req, func() { connected = true })
	require.ErrorContains(t, err, `unsupported scheme "https"`)
	require.False(t, connected)

	req, err = http.NewRequest(http.MethodPost, "http://127.0.0.1/port", strings.NewReader("x"))
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:80")
	if err != nil {
		// Port 80 is taken, or not ours to listen on: the call's dial
		// names it.
		_, err = client.Do(req, nil)
		require.ErrorContains(t, err, "127.0.0.1:80")
		return
	}
	server := &http.Server{Handler: http.HandlerFunc(echo), ReadHeaderTimeout: time.Minute}
	go func() { _ = server.Serve(ln) }()
	t.Cleanup(func() { _ = server.Close() })
	resp, err := client.Do(req, nil)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, "/port", resp.Header.Get("X-Path"))
}

func TestAConnectionTheUpstreamClosedIsNotUsed(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{}, echo)
	call(t, context.Background(), b.client, b.server.URL, "first")
	b.server.CloseClientConnections()
	require.Eventually(t, func() bool { return b.closed.Load() == 1 }, 5*time.Second, time.Millisecond)

	_, got := call(t, context.Background(), b.client, b.server.URL, "second")
	require.Equal(t, "Bearer k second", got)
	calls := b.calls()
	require.Len(t, calls, 2)
	require.NotEqual(t, calls[0], calls[1])
}

func TestConnectionCloseIsHonoured(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		echo(w, r)
	})
	call(t, context.Background(), b.client, b.server.URL, "one")
	call(t, context.Background(), b.client, b.server.URL, "two")
	calls := b.calls()
	require.NotEqual(t, calls[0], calls[1])
}

// TestAClosingExchangeIsNotReused: after a reply that says Connection:
// close, or a request that did, the next call takes a new connection, even
// where the upstream keeps the old one open; otherwise it takes the old one.
func TestAClosingExchangeIsNotReused(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct{ replyCloses, requestCloses, reused bool }{
		"neither":            {reused: true},
		"the reply closes":   {replyCloses: true},
		"the request closes": {requestCloses: true},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			url := serveRaw(t, func(conn net.Conn, _ *http.Request) bool {
				head := "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n"
				if c.replyCloses {
					head += "Connection: close\r\n"
				}
				from := conn.RemoteAddr().String()
				_, _ = fmt.Fprintf(conn, head+"\r\n%s", len(from), from)
				return true // and read on: the connection stays open
			})
			client := http1.New(http1.Config{})
			t.Cleanup(client.CloseIdleConnections)
			var from []string
			for range 2 {
				req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("x"))
				require.NoError(t, err)
				req.Close = c.requestCloses
				resp, err := client.Do(req, nil)
				require.NoError(t, err)
				got, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.NoError(t, resp.Body.Close())
				from = append(from, string(got))
			}
			require.Equal(t, c.reused, from[0] == from[1], from)
		})
	}
}

// TestABodyClosedTwiceGivesItsConnectionBackOnce: a second close of a
// body does nothing: the connection it gave back stays open for the next
// call.
func TestABodyClosedTwiceGivesItsConnectionBackOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{}, echo)
	req, err := http.NewRequest(http.MethodPost, b.server.URL, strings.NewReader("x"))
	require.NoError(t, err)
	resp, err := b.client.Do(req, nil)
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, resp.Body.Close())
	call(t, context.Background(), b.client, b.server.URL, "next")
	calls := b.calls()
	require.Equal(t, calls[0], calls[1])
	require.Zero(t, b.closed.Load())
}

// TestAFailedExchangeClosesItsConnection: a reply that cannot be read
// closes the connection it came on (the upstream reads its end), not left
// open for the collector.
func TestAFailedExchangeClosesItsConnection(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	closed := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			closed <- err
			return
		}
		defer c.Close()
		_, _ = http.ReadRequest(bufio.NewReader(c))
		_, _ = io.WriteString(c, "NOT HTTP\r\n\r\n")
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		closed <- err
	}()
	_, err = post(t, "http://"+ln.Addr().String())
	require.ErrorContains(t, err, "malformed HTTP")
	require.ErrorIs(t, <-closed, io.EOF)
}

// TestTheLastConnectionBackIsUsedFirst: of the idle connections, a call
// takes the one used last (the least likely to have been closed by the
// upstream's own idle timeout).
func TestTheLastConnectionBackIsUsedFirst(t *testing.T) {
	t.Parallel()
	g := newGates("/first", "/second")
	b := setup(t, http1.Config{}, func(w http.ResponseWriter, r *http.Request) {
		g.pass(r.URL.Path)
		_, _ = io.WriteString(w, r.RemoteAddr)
	})
	from := g.callInOrder(b.client, b.server.URL)
	first, second := from[0], from[1]
	require.NotEqual(t, first, second)
	_, next := call(t, context.Background(), b.client, b.server.URL+"/next", "x")
	require.Equal(t, second, next)
}

// TestABodyClosedEarlyClosesItsConnectionWithoutReadingOn: a body closed
// before its end closes its connection at once, without reading what is
// left, even when the client has read all it was sent so far.
func TestABodyClosedEarlyClosesItsConnectionWithoutReadingOn(t *testing.T) {
	t.Parallel()
	var b *testBundle
	b = setup(t, http1.Config{IdleTimeout: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/endless":
			_, _ = w.Write([]byte("a first piece"))
			w.(http.Flusher).Flush()
			b.hold(r)
			return
		case "/longer":
			// All the client has read is all it was sent, but not the
			// body's end.
			w.Header().Set("Content-Length", "100")
			_, _ = w.Write([]byte("ten bytes."))
			w.(http.Flusher).Flush()
			b.hold(r)
			return
		}
		echo(w, r)
	})
	req, err := http.NewRequest(http.MethodPost, b.server.URL+"/endless", strings.NewReader("x"))
	require.NoError(t, err)
	resp, err := b.client.Do(req, nil)
	require.NoError(t, err)
	buf := make([]byte, 5)
	_, err = io.ReadFull(resp.Body, buf)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close()) // returns although the reply never ends
	require.Eventually(t, func() bool { return b.closed.Load() == 1 }, 5*time.Second, time.Millisecond)

	call(t, context.Background(), b.client, b.server.URL, "next")
	calls := b.calls()
	require.NotEqual(t, calls[0], calls[1])

	req, err = http.NewRequest(http.MethodPost, b.server.URL+"/longer", strings.NewReader("x"))
	require.NoError(t, err)
	resp, err = b.client.Do(req, nil)
	require.NoError(t, err)
	buf = make([]byte, len("ten bytes."))
	_, err = io.ReadFull(resp.Body, buf)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Eventually(t, func() bool { return b.closed.Load() == 2 }, 5*time.Second, time.Millisecond)
}

func TestCancellingWakesTheCall(t *testing.T) {
	t.Parallel()
	var b *testBundle
	arrived := make(chan struct{}, 2) // a call reached the upstream
	b = setup(t, http1.Config{}, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		arrived <- struct{}{}
		if r.URL.Path == "/body" {
			_, _ = w.Write([]byte("head sent"))
			w.(http.Flusher).Flush()
		}
		b.hold(r)
	})

	t.Run("WaitingForTheHead", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.server.URL+"/head", strings.NewReader("x"))
		require.NoError(t, err)
		go func() {
			<-arrived // cancelled once connected, however slow the machine
			cancel()
		}()
		_, err = b.client.Do(req, nil)
		require.ErrorIs(t, err, context.Canceled)
	})
	t.Run("ReadingTheBody", func(t *testing.T) {
		// Long enough to connect on a busy machine; the read then waits for it.
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.server.URL+"/body", strings.NewReader("x"))
		require.NoError(t, err)
		resp, err := b.client.Do(req, nil)
		require.NoError(t, err)
		_, err = io.ReadAll(resp.Body)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, resp.Body.Close())
	})
	require.Eventually(t, func() bool { return b.closed.Load() == 2 }, 5*time.Second, time.Millisecond)
}

// rawUpstream answers the first request of every connection with reply,
// whatever it was sent, then closes the connection.
func rawUpstream(t *testing.T, reply func(c net.Conn)) string {
	t.Helper()
	return serveRaw(t, func(c net.Conn, _ *http.Request) bool {
		reply(c)
		return false
	})
}

// serveRaw listens until the test ends and, on each connection, reads
// requests (head and body) and hands each to answer, which writes what it
// likes and says whether to read another.
func serveRaw(tb testing.TB, answer func(c net.Conn, req *http.Request) bool) string {
	tb.Helper()
	return "http://" + testlisten.Serve(tb, func(c net.Conn) {
		r := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(r)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			if !answer(c, req) {
				return
			}
		}
	})
}

// gates hold the calls to their paths at the upstream until released, so
// that each takes a connection of its own.
type gates struct {
	paths   []string
	open    map[string]chan struct{}
	arrived sync.WaitGroup
}

func newGates(paths ...string) *gates {
	g := &gates{paths: paths, open: map[string]chan struct{}{}}
	for _, p := range paths {
		g.open[p] = make(chan struct{})
	}
	return g
}

// pass holds the upstream's handler of a call to path until its gate opens
// (at once for a path without a gate).
func (g *gates) pass(path string) {
	if gate, ok := g.open[path]; ok {
		g.arrived.Done()
		<-gate
	}
}

// callInOrder makes a POST to each path at once and, once all have reached
// the upstream, releases them one at a time, in order, each reply's body
// (or its error) read before the next is released.
func (g *gates) callInOrder(c *http1.Client, base string) []string {
	g.arrived.Add(len(g.paths))
	replies := make([]chan string, len(g.paths))
	for i, path := range g.paths {
		replies[i] = make(chan string, 1)
		go func() {
			req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader("x"))
			if err != nil {
				replies[i] <- err.Error()
				return
			}
			resp, err := c.Do(req, nil)
			if err != nil {
				replies[i] <- err.Error()
				return
			}
			got, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			replies[i] <- string(got)
		}()
	}
	g.arrived.Wait()
	got := make([]string, len(g.paths))
	for i, path := range g.paths {
		close(g.open[path])
		got[i] = <-replies[i]
	}
	return got
}

// post sends a small POST to url with a new client.
func post(t *testing.T, url string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("x"))
	require.NoError(t, err)
	return http1.New(http1.Config{}).Do(req, nil)
}

func TestHostileReplies(t *testing.T) {
	t.Parallel()
	t.Run("EndlessHead", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\n")
			line := "X-Junk: " + strings.Repeat("j", 1000) + "\r\n"
			for {
				if _, err := io.WriteString(c, line); err != nil {
					return
				}
			}
		})
		client := http1.New(http1.Config{MaxHeaderBytes: 64 << 10})
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("x"))
		require.NoError(t, err)
		_, err = client.Do(req, nil)
		require.ErrorIs(t, err, http1.ErrHeaderTooLarge)
	})
	t.Run("InformationalRepliesFirst", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) {
			_, _ = io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		})
		_, got := call(t, context.Background(), http1.New(http1.Config{}), url, "x")
		require.Equal(t, "ok", got)
	})
	t.Run("EndlessInformationalReplies", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) {
			for {
				if _, err := io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n"); err != nil {
					return
				}
			}
		})
		_, err := post(t, url)
		require.ErrorContains(t, err, "informational replies")
	})
	t.Run("SwitchingProtocols", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) {
			_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
		})
		_, err := post(t, url)
		require.ErrorContains(t, err, "101")
	})
	t.Run("NotHTTP", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) { _, _ = io.WriteString(c, "SSH-2.0-OpenSSH_9.6\r\n") })
		_, err := post(t, url)
		require.ErrorContains(t, err, "malformed HTTP")
	})
	t.Run("BodyShorterThanAnnounced", func(t *testing.T) {
		t.Parallel()
		url := rawUpstream(t, func(c net.Conn) {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
		})
		resp, err := post(t, url)
		require.NoError(t, err)
		_, err = io.ReadAll(resp.Body)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		require.NoError(t, resp.Body.Close())
	})
	t.Run("AnswerBeforeTheWholeRequest", func(t *testing.T) {
		t.Parallel()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		t.Cleanup(func() { _ = ln.Close() })
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// Read the head only, refuse the body's size, and leave.
			_, _ = http.ReadRequest(bufio.NewReader(c))
			_, _ = io.WriteString(c, "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n\r\ntoo long")
			_ = c.Close()
		}()
		req, err := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String(), strings.NewReader(strings.Repeat("x", 32<<20)))
		require.NoError(t, err)
		resp, err := http1.New(http1.Config{}).Do(req, nil)
		require.NoError(t, err)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, "too long", string(body))
		require.NoError(t, resp.Body.Close())
	})
	t.Run("BytesAfterTheReplyAreNotTrusted", func(t *testing.T) {
		t.Parallel()
		var conns atomic.Int32
		url := rawUpstream(t, func(c net.Conn) {
			conns.Add(1)
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfake")
			time.Sleep(time.Second) // keep the connection open
		})
		client := http1.New(http1.Config{})
		for range 2 {
			_, got := call(t, context.Background(), client, url, "x")
			require.Equal(t, "ok", got)
		}
		require.Equal(t, int32(2), conns.Load())
	})
}

func TestIdleConnectionsAreBoundedAndExpire(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var waiting sync.WaitGroup
	b := setup(t, http1.Config{MaxIdlePerHost: 1, IdleTimeout: 100 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		waiting.Done()
		<-release
		echo(w, r)
	})
	// Three calls at once take three connections; one is kept idle after.
	waiting.Add(3)
	var calls sync.WaitGroup
	for range 3 {
		calls.Go(func() {
			req, err := http.NewRequest(http.MethodPost, b.server.URL, strings.NewReader("x"))
			if err != nil {
				panic(err)
			}
			resp, err := b.client.Do(req, nil)
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
			if err != nil {
				panic(err)
			}
		})
	}
	waiting.Wait()
	close(release)
	calls.Wait()
	require.Eventually(t, func() bool { return b.closed.Load() == 2 }, 5*time.Second, time.Millisecond)
	// The kept one is closed once it has been idle for IdleTimeout.
	require.Eventually(t, func() bool { return b.closed.Load() == 3 }, 5*time.Second, 10*time.Millisecond)
}

// TestWaitReadableWaitsForTheUpstream: a body's WaitReadable returns at once
// while its buffer holds bytes, waits while the upstream is silent, returns
// once it sends more, and returns the call's end when it is cancelled.
func TestWaitReadableWaitsForTheUpstream(t *testing.T) {
	t.Parallel()
	more := make(chan struct{})
	var b *testBundle
	b = setup(t, http1.Config{}, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "first,second,")
		w.(http.Flusher).Flush()
		select {
		case <-more:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "third")
		w.(http.Flusher).Flush()
		b.hold(r)
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.server.URL, strings.NewReader("x"))
	require.NoError(t, err)
	resp, err := b.client.Do(req, nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	waiter, ok := resp.Body.(interface{ WaitReadable() error })
	require.True(t, ok, "bodies can wait without a buffer")
	require.NoError(t, waiter.WaitReadable())
	buf := make([]byte, 7)
	_, err = io.ReadFull(resp.Body, buf[:6])
	require.NoError(t, err)
	require.Equal(t, "first,", string(buf[:6]))
	require.NoError(t, waiter.WaitReadable(), "bytes are buffered: at once")
	_, err = io.ReadFull(resp.Body, buf[:7])
	require.NoError(t, err)
	require.Equal(t, "second,", string(buf[:7]))

	waited := make(chan error, 1)
	go func() { waited <- waiter.WaitReadable() }()
	select {
	case err := <-waited:
		t.Fatalf("WaitReadable returned %v while the upstream was silent", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(more)
	require.NoError(t, <-waited)
	rest := make([]byte, 5)
	_, err = io.ReadFull(resp.Body, rest)
	require.NoError(t, err)
	require.Equal(t, "third", string(rest))

	go func() { waited <- waiter.WaitReadable() }()
	cancel()
	require.ErrorIs(t, <-waited, context.Canceled)
}

// TestWaitReadableOfAnEmptyBodyReturnsAtOnce: a reply without a body
// (Content-Length: 0) can be read at once, to its end, without a byte more
// from the upstream, which sends none; its connection is then used again.
func TestWaitReadableOfAnEmptyBodyReturnsAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "0")
	})
	for range 2 {
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, b.server.URL, strings.NewReader("x"))
		require.NoError(t, err)
		resp, err := b.client.Do(req, nil)
		require.NoError(t, err)
		waited := make(chan error, 1)
		go func() { waited <- resp.Body.(interface{ WaitReadable() error }).WaitReadable() }()
		select {
		case err := <-waited:
			require.NoError(t, err)
		case <-time.After(5 * time.Second):
			t.Fatal("WaitReadable waited on an empty body for a byte the upstream will not send")
		}
		n, err := resp.Body.Read(make([]byte, 1))
		require.Zero(t, n)
		require.ErrorIs(t, err, io.EOF)
		require.NoError(t, resp.Body.Close())
	}
	calls := b.calls()
	require.Len(t, calls, 2)
	require.Equal(t, calls[0], calls[1], "the connection is used again")
}

// TestAnnouncedKeepAliveIsHonoured: a connection is used for a later call only
// while it is within what its upstream announced it keeps connections
// (Keep-Alive: timeout=N) less a second, or within IdleTimeout when it announced
// nothing readable; so no call is sent on a connection the upstream may be
// closing at that moment.
// TestAnExpiredConnectionPassedOverIsClosed: an idle connection past its
// time, found by a call before the sweep of expired connections, is closed
// (the upstream reads its end), and the call takes a new one.
func TestAnExpiredConnectionPassedOverIsClosed(t *testing.T) {
	t.Parallel()
	b := setup(t, http1.Config{IdleTimeout: time.Minute}, echo) // the sweep's first run is a minute away
	var elapsed atomic.Int64
	start := time.Now()
	http1.SetClock(b.client, func() time.Time { return start.Add(time.Duration(elapsed.Load())) })
	call(t, context.Background(), b.client, b.server.URL, "one")
	elapsed.Store(int64(2 * time.Minute))
	call(t, context.Background(), b.client, b.server.URL, "two")
	calls := b.calls()
	require.NotEqual(t, calls[0], calls[1])
	require.Eventually(t, func() bool { return b.closed.Load() == 1 }, 5*time.Second, time.Millisecond)
}

// TestTheSweepClosesEachIdleConnectionInItsTime: the sweep of expired idle
// connections closes each when its time is up (a sweep comes back for the
// soonest of those left, on any upstream, however they are ordered), and
// while any is idle.
func TestTheSweepClosesEachIdleConnectionInItsTime(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	closedAt := map[string]time.Time{} // by the client's address
	g := newGates("/first", "/long", "/short")
	server := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/long":
			w.Header().Set("Keep-Alive", "timeout=7") // kept 6 s
		case "/short":
			w.Header().Set("Keep-Alive", "timeout=3") // kept 2 s
		}
		g.pass(r.URL.Path)
		_, _ = io.WriteString(w, r.RemoteAddr)
	}))
	server.Config.ConnState = func(c net.Conn, state http.ConnState) {
		if state == http.StateClosed {
			mu.Lock()
			closedAt[c.RemoteAddr().String()] = time.Now()
			mu.Unlock()
		}
	}
	server.Start()
	t.Cleanup(server.Close)
	client := http1.New(http1.Config{IdleTimeout: time.Second})
	t.Cleanup(client.CloseIdleConnections)
	closed := func(addr string) bool {
		mu.Lock()
		defer mu.Unlock()
		_, ok := closedAt[addr]
		return ok
	}

	// Three connections at once. The first idle is kept a second: the
	// first sweep is then; of the two others, the one kept longer is idle
	// first.
	start := time.Now()
	from := g.callInOrder(client, server.URL)
	first, long, short := from[0], from[1], from[2]
	require.Len(t, map[string]bool{first: true, long: true, short: true}, 3)

	require.Eventually(t, func() bool { return closed(first) }, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return closed(short) }, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return closed(long) }, 10*time.Second, 10*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Less(t, closedAt[short].Sub(start), 4*time.Second, "kept 2 s, closed by the sweep after the first")
}

func TestAnnouncedKeepAliveIsHonoured(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		headers []string      // the Keep-Alive headers of each reply
		keep    time.Duration // how long the connection is kept idle; 0: never
	}{
		{name: "none announced: IdleTimeout", keep: 4 * time.Second},
		{name: "uvicorn-like", headers: []string{"timeout=5"}, keep: 4 * time.Second},
		{name: "with max", headers: []string{"timeout=60, max=100"}, keep: 59 * time.Second},
		{name: "max first", headers: []string{"max=100, timeout=2"}, keep: time.Second},
		{name: "spaces and case", headers: []string{" Timeout = 30 "}, keep: 29 * time.Second},
		{name: "quoted", headers: []string{`timeout="7"`}, keep: 6 * time.Second},
		{name: "the least of several", headers: []string{"timeout=30", "timeout=10"}, keep: 9 * time.Second},
		{name: "the least first", headers: []string{"timeout=10", "timeout=30"}, keep: 9 * time.Second},
		{name: "a second: never kept", headers: []string{"timeout=1"}},
		{name: "zero: never kept", headers: []string{"timeout=0"}},
		{name: "a day: bounded", headers: []string{"timeout=86400"}, keep: 10*time.Minute - time.Second},
		{name: "not a number", headers: []string{"timeout=soon"}, keep: 4 * time.Second},
		{name: "negative", headers: []string{"timeout=-5"}, keep: 4 * time.Second},
		{name: "past int64", headers: []string{"timeout=99999999999999999999"}, keep: 4 * time.Second},
		{name: "unreadable beside readable", headers: []string{"timeout=x, timeout=3"}, keep: 2 * time.Second},
		{name: "negative beside readable", headers: []string{"timeout=3, timeout=-5"}, keep: 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url := serveRaw(t, func(c net.Conn, _ *http.Request) bool {
				head := "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Conn: " + c.RemoteAddr().String() + "\r\n"
				for _, h := range tc.headers {
					head += "Keep-Alive: " + h + "\r\n"
				}
				_, err := io.WriteString(c, head+"\r\nok")
				return err == nil
			})
			// reusedAfter reports whether a call made idle later than the one
			// before came on the same connection.
			reusedAfter := func(idle time.Duration) bool {
				var elapsed atomic.Int64
				start := time.Now()
				c := http1.New(http1.Config{})
				http1.SetClock(c, func() time.Time { return start.Add(time.Duration(elapsed.Load())) })
				defer c.CloseIdleConnections()
				first, _ := call(t, context.Background(), c, url, "x")
				elapsed.Store(int64(idle))
				second, got := call(t, context.Background(), c, url, "x")
				require.Equal(t, "ok", got)
				return first.Header.Get("X-Conn") == second.Header.Get("X-Conn")
			}
			if tc.keep > 0 {
				require.True(t, reusedAfter(tc.keep-time.Millisecond), "idle for just under %v", tc.keep)
			}
			require.False(t, reusedAfter(tc.keep), "idle for %v", tc.keep)
		})
	}
}

// TestConnectionsFindALostUpstream checks how a call's connection is set up
// (see lostpeer).
func TestConnectionsFindALostUpstream(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	nc, err := http1.Dial(http1.New(http1.Config{}), context.Background(), l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = nc.Close() })
	err = lostpeer.Check(nc)
	if errors.Is(err, errors.ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, err)
}

// TestACallTheNetworkLostFails loses the network to an upstream (every
// packet sent to it dropped, probes included) while a call waits for the
// rest of its reply, and while one sends its request on a kept connection:
// each fails some 25 s later (lostpeer), not at its deadline (two minutes
// here; the keepalives before took 5 minutes, the kernel's retransmissions
// some 15).
func TestACallTheNetworkLostFails(t *testing.T) {
	t.Parallel()
	for _, stage := range []string{"reading", "sending"} {
		t.Run(stage, func(t *testing.T) {
			t.Parallel()
			hole := blackhole.New(t)
			held := make(chan struct{}, 1)
			server := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("X-Hold") == "" {
					return
				}
				w.WriteHeader(http.StatusOK)
				w.(http.Flusher).Flush()
				held <- struct{}{}
				<-r.Context().Done()
			}))
			l, err := net.Listen("tcp", hole.Addr()+":0")
			require.NoError(t, err)
			server.Listener = l
			server.Start()
			t.Cleanup(server.Close)
			client := http1.New(http1.Config{IdleTimeout: time.Hour})
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			t.Cleanup(cancel)
			do := func(hold bool) (*http.Response, error) {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, server.URL, strings.NewReader("x"))
				require.NoError(t, err)
				if hold {
					req.Header.Set("X-Hold", "1")
				}
				return client.Do(req, nil)
			}
			resp, err := do(stage == "reading")
			require.NoError(t, err)
			if stage == "reading" {
				<-held
				hole.Drop()
				_, err = io.ReadAll(resp.Body)
			} else {
				_, err = io.ReadAll(resp.Body) // the connection is kept for the next call
				require.NoError(t, err)
				require.NoError(t, resp.Body.Close())
				hole.Drop()
				_, err = do(false)
			}
			require.Error(t, err)
			require.NoError(t, ctx.Err(), "the call failed before its deadline: %v", err)
		})
	}
}
