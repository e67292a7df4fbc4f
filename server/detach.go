package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rungworks/gateway/internal/connwatch"
)

// IdleTimeout is how long a client connection may wait for its next request:
// the HTTP server's idle timeout, which a connection handed back after a
// detached stream keeps too (see handedConn).
const IdleTimeout = 2 * time.Minute

// DefaultDetachAfter is how long an HTTP/1.1 stream runs before it is
// detached, unless Config.DetachAfter says otherwise.
const DefaultDetachAfter = 100 * time.Millisecond

// A stream waits for its upstream for seconds to minutes. Served by net/http,
// a waiting stream holds its connection's goroutine with the deep stack of the
// server, the middleware and the handler, the connection's read and write
// buffers, and the request; a replica holding tens of thousands of streams
// spends most of its memory on them. So an HTTP/1.1 stream runs on a
// goroutine of its own, which starts with a small stack, writing through the
// handler's response; once it has run for DetachAfter, it is detached: its
// connection is taken over (http.Hijacker), the handler returns, and the
// stream goes on writing chunks on the connection itself, whose client is
// watched for going away (connwatch: on Linux one epoll instance watches
// every detached stream's client, with no goroutine each). When a
// detached stream ends, its connection goes back at once to the HTTP server,
// through the listener, which waits on it for the client's next request
// (keep-alive), unless the client asked to close it or the server is
// draining. A stream that ends sooner is answered by net/http as any reply.
//
// An HTTP/2 stream shares its connection, which cannot be taken over, and
// net/http ends the stream when its handler returns. What can go is the deep
// stack of echo, the middleware and the handler: net/http's goroutine waits
// in Server.ServeHTTP, with a small stack, while the request is served on a
// goroutine of its own, which ends once the stream has run for DetachAfter
// (the handler returns through echo); the stream goes on on its own
// goroutine, writing through net/http's response writer, and net/http's
// goroutine waits for it.

// serveDetachable serves the stream r through w, and detaches it if it runs
// for DetachAfter.
func (s *Server) serveDetachable(r streamReply, w http.ResponseWriter, x *exchange) error {
	sse := startSSE(w, http2Stream(x.req), s.keepalive, s.streamWriteTimeout)
	// The stream's context keeps the call's values and ends with Abort, and
	// with the request's (the client went away) until its connection is
	// taken over; over HTTP/2 for good (net/http's request context tells
	// until ServeHTTP returns).
	ctx, done := s.callContext(context.WithoutCancel(r.ctx))
	client := x.req.Context()
	unwatch := context.AfterFunc(client, done)
	d := &detached{s: s, sse: sse, x: x, done: done, closeAsked: x.req.Close, finished: make(chan struct{})}
	go d.run(ctx, r)
	timer := time.NewTimer(s.detachAfter)
	defer timer.Stop()
	select {
	case <-d.finished:
	case <-timer.C:
		if t := topOf(r.ctx); t != nil {
			if d.rise(t) {
				x.detached, x.req = true, nil
				r.done()
				return nil
			}
		} else if unwatch() {
			if d.take(w) {
				// The request holds the connection's read buffer (through
				// its body) and net/http's state of it: none is needed now.
				x.detached, x.req = true, nil
				r.done()
				return nil
			}
			context.AfterFunc(client, done)
		}
		<-d.finished
	}
	r.done()
	if d.panicked != nil {
		panic(d.panicked) // for the recover middleware, as on any handler
	}
	return nil
}

// detached is a stream that may be served off its connection's goroutine.
type detached struct {
	s   *Server
	sse *sseWriter
	x   *exchange
	// done ends the stream's call; closeAsked: the client asked to close the
	// connection after the reply.
	done       func()
	closeAsked bool
	// finished is closed when the stream ends; panicked is what it panicked
	// with, if it did before it was detached.
	finished chan struct{}
	panicked any

	// Set by take or rise, under sse.mu: taken says the stream is
	// detached; conn is its connection, taken over (HTTP/1.1), nil when it
	// waits for ServeHTTP to end it (HTTP/2).
	taken bool
	conn  net.Conn

	mu sync.Mutex
	// ended: the response is written (a read that fails then is not the
	// client going away).
	ended bool
	// next is what the client sent of its next request: read ahead.
	next []byte
	// unwatch stops the watch on the client, if there is one.
	unwatch func()
}

// run runs the stream, and ends the connection's part in it if it was
// detached.
func (d *detached) run(ctx context.Context, r streamReply) {
	defer close(d.finished)
	defer d.done()
	defer func() {
		p := recover()
		d.sse.mu.Lock()
		taken := d.taken
		d.sse.mu.Unlock()
		if !taken {
			d.panicked = p
			return
		}
		if p != nil {
			d.s.logger.Error("panic serving a stream", "request_id", d.x.id, "error", fmt.Sprint(p), "stack", string(debug.Stack()))
		}
		// Logged before the response ends: the client that has its end
		// finds the line.
		d.x.finish(r.ctx, http.StatusOK, d.sse.size)
		if d.conn == nil {
			d.panicked = p // ServeHTTP ends the response, or resets it
			return
		}
		defer d.s.streams.remove(d)
		keep := !d.closeAsked && p == nil
		// The last chunk is written by the deadline sse.Close set (end
		// lifts it).
		if out := d.sse.out.sink.(*chunkedSink); p != nil || out.finish() != nil {
			keep = false
		}
		d.end(keep && !d.s.draining.Load())
	}()
	r.run(ctx, d.sse)
}

// take detaches the stream, unless it has ended: the connection is taken
// over and the stream's events go on as chunks written on it.
func (d *detached) take(w http.ResponseWriter) bool {
	d.sse.mu.Lock()
	defer d.sse.mu.Unlock()
	if d.sse.closed {
		return false
	}
	// net/http has written the head and every event, flushed, as chunks.
	// Hijack lifts the connection's deadlines.
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return false
	}
	if n := brw.Reader.Buffered(); n > 0 {
		// The client's next request, sent ahead (pipelined).
		ahead, _ := brw.Reader.Peek(n)
		d.next = append([]byte(nil), ahead...)
	}
	d.taken, d.conn = true, conn
	d.sse.setOutLocked(&chunkedSink{conn: conn})
	d.s.streams.add(d)
	if len(d.next) == 0 {
		d.unwatch = connwatch.Watch(conn, d.heard)
	}
	return true
}

// top is where net/http's goroutine of an HTTP/2 request waits, in
// Server.ServeHTTP, while the request is served on a goroutine of its own
// (whose stack grows deep, and goes when it returns), then for the stream it
// left running, if any (see rise).
type top struct {
	s *Server
	w http.ResponseWriter
	// served is closed when the request's goroutine returns; panicked: it
	// panicked (logged there).
	served   chan struct{}
	panicked bool
	// d is the stream left running, set by rise.
	d *detached
}

type topKey struct{}

// topOf is the top the request whose context is ctx can rise to, if any.
func topOf(ctx context.Context) *top {
	t, _ := ctx.Value(topKey{}).(*top)
	return t
}

// serve serves r through echo.
func (t *top) serve(r *http.Request) {
	defer close(t.served)
	defer func() {
		if p := recover(); p != nil {
			t.panicked = true
			if p != http.ErrAbortHandler {
				t.s.logger.Error("panic serving request", "method", r.Method, "path", r.URL.Path, "error", fmt.Sprint(p), "stack", string(debug.Stack()))
			}
		}
	}()
	t.s.echo.ServeHTTP(t.w, r)
}

// wait waits for the request to be served, and for the stream it left
// running, if any. After a panic the response is reset, not ended as if
// whole.
func (t *top) wait() {
	<-t.served
	if t.d != nil {
		<-t.d.finished
		t.panicked = t.d.panicked != nil
	}
	if t.panicked {
		panic(http.ErrAbortHandler)
	}
}

// rise detaches the stream from the request's goroutine, unless it has
// ended: the goroutine returns through echo and ends, and t waits for the
// stream. The stream writes through net/http's response writer from now on,
// not echo's (which echo hands to its next request).
func (d *detached) rise(t *top) bool {
	d.sse.mu.Lock()
	defer d.sse.mu.Unlock()
	if d.sse.closed {
		return false
	}
	d.taken = true
	d.sse.setOutLocked(responseSink{t.w, http.NewResponseController(t.w)})
	t.d = d
	return true
}

// heard is what the watch on the client read: nothing, it went away (the
// call ends), or a byte, the start of its next request.
func (d *detached) heard(n int, b byte, _ error) {
	d.mu.Lock()
	if n > 0 {
		d.next = append(d.next, b)
	}
	ended := d.ended
	d.mu.Unlock()
	if n == 0 && !ended {
		d.done()
	}
}

// end is called once the response is written: the connection closes, or goes
// back at once to the HTTP server, which waits for the client's next request
// on it as on any connection (see handedConn).
func (d *detached) end(keep bool) {
	d.mu.Lock()
	d.ended = true
	d.mu.Unlock()
	if d.unwatch != nil {
		// As net/http stops its background read before it hands a
		// connection on; a byte it took goes back with the connection.
		d.unwatch()
	}
	if !keep {
		closeConn(d.conn)
		return
	}
	_ = d.conn.SetWriteDeadline(time.Time{})
	d.s.relisten.Load().give(handBack(d.conn, d.next))
}

// closeConn closes c after its pending writes, without discarding them for
// unread input (a TCP reset would).
func closeConn(c net.Conn) {
	_ = closeWrite(c)
	_ = c.Close()
}

// closeWrite shuts down c's writing side, where it has one to shut.
func closeWrite(c net.Conn) error {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// chunkedSink writes an HTTP/1.1 chunked body on a connection: each write as
// a chunk, gathered until Flush sends them in one write.
type chunkedSink struct {
	conn net.Conn
	buf  []byte
}

// Write implements sink.
func (c *chunkedSink) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.buf = strconv.AppendInt(c.buf, int64(len(p)), 16)
	c.buf = append(c.buf, "\r\n"...)
	c.buf = append(c.buf, p...)
	c.buf = append(c.buf, "\r\n"...)
	return len(p), nil
}

// Flush implements sink.
func (c *chunkedSink) Flush() error {
	if len(c.buf) == 0 {
		return nil
	}
	_, err := c.conn.Write(c.buf)
	if cap(c.buf) > 4<<10 {
		c.buf = nil // a waiting stream keeps no large buffer
	} else {
		c.buf = c.buf[:0]
	}
	return err
}

// SetWriteDeadline implements sink.
func (c *chunkedSink) SetWriteDeadline(t time.Time) error { return c.conn.SetWriteDeadline(t) }

// finish writes the last chunk.
func (c *chunkedSink) finish() error {
	c.buf = append(c.buf, "0\r\n\r\n"...)
	return c.Flush()
}

// handedConn is a connection handed back to the HTTP server after a stream:
// its first reads return the bytes read ahead. Until the client's next
// request begins, the server's header timeout (which net/http counts from a
// connection's start) waits instead as long as an idle connection may, and
// counts from the request's first byte.
type handedConn struct {
	net.Conn
	prefix []byte
	// idle: no byte of the next request has arrived; until one does, read
	// deadlines are idleUntil, and the one asked for (header after now)
	// applies from the first byte.
	idle      bool
	idleUntil time.Time
	header    time.Duration
}

// handBack readies c, with the next request's bytes read ahead, for the
// HTTP server (reusing the wrapper of a connection handed back before).
func handBack(c net.Conn, next []byte) *handedConn {
	h, ok := c.(*handedConn)
	if !ok {
		h = &handedConn{Conn: c}
	}
	h.prefix = append(h.prefix, next...)
	h.idle = len(h.prefix) == 0
	h.idleUntil, h.header = time.Now().Add(IdleTimeout), 0
	return h
}

// Read implements net.Conn.
func (c *handedConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	n, err := c.Conn.Read(p)
	if c.idle && n > 0 {
		c.idle = false
		if c.header > 0 {
			_ = c.Conn.SetReadDeadline(time.Now().Add(c.header))
		}
	}
	return n, err
}

// SetReadDeadline implements net.Conn.
func (c *handedConn) SetReadDeadline(t time.Time) error {
	if !c.idle {
		return c.Conn.SetReadDeadline(t)
	}
	c.header = 0
	if !t.IsZero() {
		c.header = time.Until(t)
	}
	return c.Conn.SetReadDeadline(c.idleUntil)
}

// SetDeadline implements net.Conn.
func (c *handedConn) SetDeadline(t time.Time) error {
	if err := c.Conn.SetWriteDeadline(t); err != nil {
		return err
	}
	return c.SetReadDeadline(t)
}

// CloseWrite shuts down the writing side, as net/http does before closing.
func (c *handedConn) CloseWrite() error { return closeWrite(c.Conn) }

// errReadAhead: the bytes read ahead are what a reader gets first, not the
// descriptor's.
var errReadAhead = errors.New("bytes read ahead are not consumed yet")

// SyscallConn implements syscall.Conn, for the watch on a detached stream's
// client (connwatch), once the bytes read ahead are consumed.
func (c *handedConn) SyscallConn() (syscall.RawConn, error) {
	if len(c.prefix) > 0 {
		return nil, errReadAhead
	}
	sc, ok := connwatch.Descriptor(c.Conn)
	if !ok {
		return nil, errors.ErrUnsupported
	}
	return sc.SyscallConn()
}

// streamSet tracks the detached streams, for shutdown to wait for them and,
// past its grace, to cut them.
type streamSet struct {
	mu   sync.Mutex
	open map[*detached]struct{}
	idle chan struct{} // closed while none is open; nil: none open yet
}

func (s *streamSet) add(d *detached) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.open == nil {
		s.open = map[*detached]struct{}{}
	}
	if len(s.open) == 0 {
		s.idle = make(chan struct{})
	}
	s.open[d] = struct{}{}
}

func (s *streamSet) remove(d *detached) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.open, d)
	if len(s.open) == 0 {
		close(s.idle)
	}
}

// WaitStreams waits until no detached stream is open, or ctx ends.
func (s *Server) WaitStreams(ctx context.Context) error {
	s.streams.mu.Lock()
	idle := s.streams.idle
	n := len(s.streams.open)
	s.streams.mu.Unlock()
	if n == 0 {
		return nil
	}
	select {
	case <-idle:
		// Streams started since may be open; wait for them too.
		return s.WaitStreams(ctx)
	case <-ctx.Done():
		return fmt.Errorf("%d streams still open: %w", n, ctx.Err())
	}
}

// CloseStreams ends the streams still open, and closes their connections.
func (s *Server) CloseStreams() {
	s.streams.mu.Lock()
	defer s.streams.mu.Unlock()
	for d := range s.streams.open {
		// The watch on a closed connection hears nothing: the call is
		// ended here.
		d.done()
		_ = d.conn.Close()
	}
}

// Listener wraps ln for the HTTP server to accept, besides new connections,
// those whose detached streams ended, for their clients' next requests. A
// server whose listener is not wrapped keeps every stream on its
// connection's goroutine.
func (s *Server) Listener(ln net.Listener) net.Listener {
	l := &relistener{Listener: ln, back: make(chan net.Conn), accepted: make(chan accepted), closed: make(chan struct{})}
	s.relisten.Store(l)
	return l
}

// relistener is a listener that also accepts connections given back.
type relistener struct {
	net.Listener
	back      chan net.Conn
	accepted  chan accepted
	closed    chan struct{}
	closeOnce sync.Once
	startOnce sync.Once
}

type accepted struct {
	conn net.Conn
	err  error
}

// Accept implements net.Listener.
func (l *relistener) Accept() (net.Conn, error) {
	l.startOnce.Do(func() { go l.acceptNew() })
	select {
	case c := <-l.back:
		return c, nil
	case a := <-l.accepted:
		return a.conn, a.err
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

// acceptNew accepts new connections until the listener closes.
func (l *relistener) acceptNew() {
	for {
		c, err := l.Listener.Accept()
		select {
		case l.accepted <- accepted{c, err}:
		case <-l.closed:
			if c != nil {
				_ = c.Close()
			}
			return
		}
		if errors.Is(err, net.ErrClosed) {
			return
		}
	}
}

// give hands c to the server, or closes it once the listener is closed.
func (l *relistener) give(c net.Conn) {
	select {
	case l.back <- c:
	case <-l.closed:
		_ = c.Close()
	}
}

// Close implements net.Listener.
func (l *relistener) Close() error {
	err := net.ErrClosed
	l.closeOnce.Do(func() {
		close(l.closed)
		err = l.Listener.Close()
	})
	return err
}
