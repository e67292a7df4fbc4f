// Package http1 is a small HTTP/1.1 client for plain-text (http://) upstreams
// that makes each call on its caller's goroutine.
//
// net/http's Transport gives every HTTP/1.1 connection a read loop and a write
// loop, two goroutines that hand each call's request and reply over channels.
// A call waiting minutes for a stream's first token holds both, with their
// stacks, besides the caller's. Here the caller writes the request and reads
// the reply itself, with net/http's own wire format (Request.Write,
// ReadResponse); a connection costs its socket and a read buffer, and the
// goroutines a call wakes are the caller's alone.
//
// It does what a gateway's upstream calls need and no more: no proxies, TLS,
// HTTP/2 or compression (the openai package uses net/http for those), and it
// never sends a request twice: a call that fails after its connection was
// obtained is the caller's to classify.
package http1

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rungworks/gateway/internal/lostpeer"
)

// Config configures a Client. Zero fields take the defaults named.
type Config struct {
	// DialTimeout bounds connecting (default 5 s).
	DialTimeout time.Duration
	// MaxIdlePerHost is how many idle connections are kept per host (default 512).
	MaxIdlePerHost int
	// IdleTimeout is how long a connection is kept for the next call after a
	// reply that does not say how long the upstream keeps it (default 4 s,
	// under the 5 s of uvicorn, Node.js and llama.cpp's server). A reply that
	// says (Keep-Alive: timeout=N) sets it instead; see keepFor.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a reply's head (default 1 MiB).
	MaxHeaderBytes int64
	// BufferSize is each connection's read buffer (default 1 KiB); longer
	// lines and larger reads go past it.
	BufferSize int
}

func (c *Config) defaults() {
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.MaxIdlePerHost <= 0 {
		c.MaxIdlePerHost = 512
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 4 * time.Second
	}
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = 1 << 20
	}
	if c.BufferSize <= 0 {
		c.BufferSize = 1 << 10
	}
}

// Client keeps idle connections per host and makes calls on them. It is safe
// for concurrent use.
type Client struct {
	cfg Config
	// dialer's connections find an upstream the network lost (lostpeer):
	// a call on one fails some 25 s after it went silent, not at its
	// timeout.
	dialer *net.Dialer

	// readers are the connections' read buffers, held only while a reply
	// is read.
	readers sync.Pool

	// now is the clock that ages idle connections.
	now func() time.Time

	mu      sync.Mutex
	idle    map[string][]*conn // per host:port, oldest first
	reaping bool               // a sweep of expired connections is scheduled
}

// New returns a Client.
func New(cfg Config) *Client {
	cfg.defaults()
	return &Client{
		cfg:     cfg,
		dialer:  lostpeer.Dialer(cfg.DialTimeout),
		readers: sync.Pool{New: func() any { return bufio.NewReaderSize(nil, cfg.BufferSize) }},
		idle:    map[string][]*conn{},
		now:     time.Now,
	}
}

// ErrHeaderTooLarge is returned when a reply's head passes MaxHeaderBytes.
var ErrHeaderTooLarge = errors.New("http1: reply header too large")

// maxInformational bounds the 1xx replies skipped before the final one.
const maxInformational = 8

// Do sends req, an http:// request, and returns the reply once its head has
// been read; the reply's Request is nil unless req is a HEAD. connected is
// called once a connection is obtained, before any of the request is written:
// from then on the upstream may see the call. The request's context bounds the
// whole call, the body's reads included. The caller must close the reply's
// body; a connection goes back to the pool only when its body was read to the
// end.
func (c *Client) Do(req *http.Request, connected func()) (*http.Response, error) {
	if req.URL.Scheme != "http" {
		return nil, fmt.Errorf("http1: unsupported scheme %q", req.URL.Scheme)
	}
	addr := req.URL.Host
	if req.URL.Port() == "" {
		addr = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	ctx := req.Context()
	cn, err := c.get(ctx, addr)
	if err != nil {
		return nil, err
	}
	if connected != nil {
		connected()
	}
	// Cancelling the call sets a deadline in the past, which wakes whatever
	// read or write is blocked on the connection; no goroutine waits for it.
	stop := context.AfterFunc(ctx, cn.interrupt)
	keepAlive := !req.Close
	resp, err := cn.roundTrip(req)
	if err != nil {
		stop()
		cn.close()
		return nil, contextError(ctx, err)
	}
	resp.Body = &body{
		src: resp.Body, ctx: ctx, client: c, addr: addr, conn: cn, stop: stop,
		reuse: keepAlive && !resp.Close, keep: c.keepFor(resp.Header),
		eof: resp.Body == http.NoBody, // a reply without a body (Content-Length: 0) is at its end
	}
	return resp, nil
}

// contextError returns the context's error in place of the one a cancelled
// call's connection reported (a deadline set to wake it).
func contextError(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("%w (%v)", ctxErr, err)
	}
	return err
}

// get returns a live idle connection to addr, the most recently used first, or
// a new one.
func (c *Client) get(ctx context.Context, addr string) (*conn, error) {
	for {
		c.mu.Lock()
		list := c.idle[addr]
		if len(list) == 0 {
			c.mu.Unlock()
			break
		}
		cn := list[len(list)-1]
		list[len(list)-1] = nil
		c.idle[addr] = list[:len(list)-1]
		c.mu.Unlock()
		if c.now().Before(cn.expires) && cn.alive() {
			return cn, nil
		}
		cn.close()
	}
	nc, err := c.dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	return &conn{nc: nc, readers: &c.readers, headLeft: -1, maxHead: c.cfg.MaxHeaderBytes}, nil
}

// dial connects to addr on a goroutine of its own, which ends with it: the
// dialer's frames are deep, and the caller's goroutine, which then waits for
// the reply (for a stream, often long), keeps the smaller stack it had.
func (c *Client) dial(ctx context.Context, addr string) (net.Conn, error) {
	type dialed struct {
		nc  net.Conn
		err error
	}
	ch := make(chan dialed, 1)
	go func() {
		nc, err := c.dialer.DialContext(ctx, "tcp", addr)
		ch <- dialed{nc, err}
	}()
	d := <-ch
	return d.nc, d.err
}

// put keeps cn for the next call to addr for keep, or closes it when keep is
// not positive or the pool is full.
func (c *Client) put(addr string, cn *conn, keep time.Duration) {
	if keep <= 0 {
		cn.close()
		return
	}
	cn.expires = c.now().Add(keep)
	c.mu.Lock()
	list := c.idle[addr]
	if len(list) >= c.cfg.MaxIdlePerHost {
		c.mu.Unlock()
		cn.close()
		return
	}
	c.idle[addr] = append(list, cn)
	if !c.reaping {
		c.reaping = true
		time.AfterFunc(keep, c.reap)
	}
	c.mu.Unlock()
}

// reap closes the idle connections past their time and schedules itself
// again, for the soonest of the others, while any connection is idle.
func (c *Client) reap() {
	var expired []*conn
	now := c.now()
	next := time.Duration(0)
	c.mu.Lock()
	for addr, list := range c.idle {
		kept := list[:0]
		for _, cn := range list {
			if left := cn.expires.Sub(now); left > 0 {
				kept = append(kept, cn)
				if next == 0 || left < next {
					next = left
				}
			} else {
				expired = append(expired, cn)
			}
		}
		clear(list[len(kept):])
		if len(kept) == 0 {
			delete(c.idle, addr)
		} else {
			c.idle[addr] = kept
		}
	}
	c.reaping = next > 0
	if c.reaping {
		// Not sooner than every 100 ms, however the times are spread.
		time.AfterFunc(max(next, 100*time.Millisecond), c.reap)
	}
	c.mu.Unlock()
	for _, cn := range expired {
		cn.close()
	}
}

// keepAliveMargin is how long before the end of the keep-alive an upstream
// announces a connection stops being used: a call sent on it later could
// cross the upstream's close on the wire, and fail after dispatch.
const keepAliveMargin = time.Second

// maxAnnouncedKeep bounds the keep-alive an upstream may announce.
const maxAnnouncedKeep = 10 * time.Minute

// keepFor returns how long a connection may wait for its next call after a
// reply with header h: what the upstream announces (Keep-Alive: timeout=N, the
// least of several) less keepAliveMargin, at most maxAnnouncedKeep; or, when
// it announces nothing readable, IdleTimeout.
func (c *Client) keepFor(h http.Header) time.Duration {
	announced := int64(-1)
	for _, v := range h.Values("Keep-Alive") {
		for param := range strings.SplitSeq(v, ",") {
			name, value, ok := strings.Cut(param, "=")
			if !ok || !strings.EqualFold(strings.TrimSpace(name), "timeout") {
				continue
			}
			n, err := strconv.ParseInt(strings.Trim(strings.TrimSpace(value), `"`), 10, 64)
			if err != nil || n < 0 {
				continue
			}
			if announced < 0 || n < announced {
				announced = n
			}
		}
	}
	if announced < 0 {
		return c.cfg.IdleTimeout
	}
	return time.Duration(min(announced, int64(maxAnnouncedKeep/time.Second)))*time.Second - keepAliveMargin
}

// CloseIdleConnections closes the connections waiting for a call.
func (c *Client) CloseIdleConnections() {
	c.mu.Lock()
	idle := c.idle
	c.idle = map[string][]*conn{}
	c.mu.Unlock()
	for _, list := range idle {
		for _, cn := range list {
			cn.close()
		}
	}
}

// writers are the request writers, held only while a request is written.
var writers sync.Pool

// conn is one connection; it reads through itself so that the head of a reply
// can be bounded.
type conn struct {
	nc       net.Conn
	br       *bufio.Reader // from a reply's first byte to its end; nil otherwise
	readers  *sync.Pool    // the client's read buffers
	maxHead  int64
	headLeft int64     // bytes the reply's head may still read; negative: no bound
	expires  time.Time // while idle, when it stops being used
}

// Read reads from the connection, within the head's bound while one is set.
func (cn *conn) Read(p []byte) (int, error) {
	if cn.headLeft == 0 {
		return 0, ErrHeaderTooLarge
	}
	if cn.headLeft > 0 && int64(len(p)) > cn.headLeft {
		p = p[:cn.headLeft]
	}
	n, err := cn.nc.Read(p)
	if cn.headLeft > 0 {
		cn.headLeft -= int64(n)
	}
	return n, err
}

// roundTrip writes req and reads the final reply's head.
func (cn *conn) roundTrip(req *http.Request) (*http.Response, error) {
	bw, _ := writers.Get().(*bufio.Writer)
	if bw == nil {
		bw = bufio.NewWriterSize(cn.nc, 1<<10)
	} else {
		bw.Reset(cn.nc)
	}
	werr := req.Write(bw)
	if werr == nil {
		werr = bw.Flush()
	}
	bw.Reset(nil)
	writers.Put(bw)
	// The reply is read without the request, which is not kept (nor is its
	// body, the prompt) while a stream waits for its first token: only a
	// reply to HEAD is read differently.
	var head *http.Request
	if req.Method == http.MethodHead {
		head = req
	}
	resp, rerr := cn.readReply(head)
	switch {
	case werr != nil && rerr == nil:
		// The upstream answered (a 413, say) and closed before it read the
		// whole request: its answer is the outcome.
		resp.Close = true
		return resp, nil
	case werr != nil:
		return nil, fmt.Errorf("error writing request: %w", werr)
	}
	return resp, rerr
}

// readReply reads the final reply's head, skipping 1xx replies.
func (cn *conn) readReply(head *http.Request) (*http.Response, error) {
	// A read buffer is taken only once the reply begins.
	if err := waitReadable(cn.nc); err != nil {
		return nil, fmt.Errorf("error reading reply: %w", err)
	}
	cn.br = cn.readers.Get().(*bufio.Reader)
	cn.br.Reset(cn)
	cn.headLeft = cn.maxHead
	defer func() { cn.headLeft = -1 }()
	for range maxInformational + 1 {
		resp, err := http.ReadResponse(cn.br, head)
		if err != nil {
			return nil, fmt.Errorf("error reading reply: %w", err)
		}
		if resp.StatusCode >= 200 || resp.StatusCode < 100 {
			return resp, nil
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return nil, errors.New("error reading reply: unexpected 101 Switching Protocols")
		}
	}
	return nil, fmt.Errorf("error reading reply: more than %d informational replies", maxInformational)
}

// alive reports whether an idle connection can carry a call: the upstream has
// not closed it and sent nothing unasked.
func (cn *conn) alive() bool { return peerSilent(cn.nc) }

// idle readies cn for the pool: it gives back its read buffer, and reports
// false when the upstream sent more than the reply.
func (cn *conn) idle() bool {
	if cn.br == nil {
		return true
	}
	extra := cn.br.Buffered()
	cn.releaseReader()
	return extra == 0
}

func (cn *conn) releaseReader() {
	if cn.br != nil {
		cn.br.Reset(nil)
		cn.readers.Put(cn.br)
		cn.br = nil
	}
}

func (cn *conn) interrupt() { _ = cn.nc.SetDeadline(time.Unix(1, 0)) }

func (cn *conn) close() {
	_ = cn.nc.Close()
	cn.releaseReader()
}

// body is a reply's body; it hands its connection back to the pool when it was
// read to the end, and closes it otherwise.
type body struct {
	src    io.ReadCloser
	ctx    context.Context
	client *Client
	addr   string
	conn   *conn
	stop   func() bool
	reuse  bool
	keep   time.Duration // how long the connection may then wait idle
	eof    bool
	closed bool
}

// Read implements io.Reader.
func (b *body) Read(p []byte) (int, error) {
	if b.closed {
		return 0, errors.New("http1: read on a closed body")
	}
	n, err := b.src.Read(p)
	switch {
	case errors.Is(err, io.EOF):
		b.eof = true
	case err != nil:
		err = contextError(b.ctx, err)
	}
	return n, err
}

// WaitReadable waits until the body can be read without blocking on the
// connection: its read buffer holds bytes, or the upstream sent more, closed
// the connection, or the call ended. It holds no buffer of its own while it
// waits, so neither need the caller: a stream waiting for its next token
// takes its line buffer once there is something to read.
func (b *body) WaitReadable() error {
	if b.closed || b.eof || b.conn.br == nil || b.conn.br.Buffered() > 0 {
		return nil
	}
	if err := waitReadable(b.conn.nc); err != nil {
		return contextError(b.ctx, err)
	}
	return nil
}

// Close implements io.Closer. It never reads what is left of the body.
func (b *body) Close() error {
	if b.closed {
		return nil
	}
	b.closed = true
	// stop reports false once the call's context was done: its deadline may
	// be set on the connection at any moment. Otherwise no deadline was set
	// on it: it goes back as it came.
	if b.stop() && b.eof && b.reuse && b.conn.idle() {
		b.client.put(b.addr, b.conn, b.keep)
		return nil
	}
	b.conn.close()
	return nil
}
