// Package openai is the upstream provider for OpenAI-compatible Chat Completions
// APIs (GATEWAY_UPSTREAM=http://host/v1).
package openai

import (
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/lostpeer"
	"github.com/rungworks/gateway/tracing"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/http1"
)

// HintsHeader carries the request's mode hints (web_search, code_mode,
// image_mode) upstream. A header, unlike an extra body field, is ignored by
// upstreams that do not know it instead of being refused.
const HintsHeader = "X-Gateway-Hints"

// Config configures a Client.
type Config struct {
	// BaseURL is the API root, e.g. http://127.0.0.1:9000/v1. Its query, if
	// any, is kept on every call (Azure OpenAI's deployments take their
	// api-version there).
	BaseURL string
	// APIKey is sent as a bearer token when set, or in APIKeyHeader.
	APIKey string
	// APIKeyHeader names the header that carries APIKey as it is (e.g.
	// api-key, as Azure OpenAI's deployments take it); empty sends it in
	// Authorization as a bearer token.
	APIKeyHeader string
	// Timeout bounds one non-streaming call, from dispatch to the whole reply,
	// and a stream's silence (default 120 s).
	Timeout time.Duration
	// StreamLimit bounds a stream's call from its start to its end, however
	// the upstream keeps it going: comment lines and empty deltas end its
	// silence, not this (default 30 min).
	StreamLimit time.Duration
	// H2C speaks HTTP/2 without TLS (prior knowledge) to an http:// upstream
	// that supports it, so concurrent calls share connections. HTTPS upstreams
	// negotiate HTTP/2 on their own.
	H2C bool
	// Headers are sent with every call (e.g. an organisation or project id).
	Headers map[string]string
	// IdleTimeout is how long an idle connection is kept for the next call.
	// Over plain-text HTTP/1.1 it applies when the upstream does not announce
	// its own keep-alive (default 4 s, see http1.Config); otherwise it is the
	// transport's (default 90 s: HTTP/2 upstreams close idle connections with
	// GOAWAY, which says which calls they did not process).
	IdleTimeout time.Duration
	// PingAfter is how long an HTTP/2 connection may go without a frame from
	// the upstream before it is sent a ping, and how long the ping's answer
	// may take: a connection that does not answer (one the network lost) is
	// closed, and the calls on it fail after dispatch, instead of each
	// waiting for its Timeout while new calls join them (default 10 s). An
	// upstream answers pings however long its model takes.
	PingAfter time.Duration
	// MaxTokensField names the field that carries a call's output limit:
	// MaxCompletionTokens (OpenAI's, the default; its reasoning models refuse
	// the other) or MaxTokens, for servers that know only the older name
	// (some ignore the newer one, and would generate past the limit the
	// caller is billed for; some refuse it).
	MaxTokensField string
	// NoStreamOptions leaves stream_options out of a stream's call, for
	// servers that refuse it (some Azure OpenAI API versions, Databricks):
	// the stream's usage is then what the server sends unasked, if anything
	// (else the caller counts the text).
	NoStreamOptions bool
}

// The names of an output limit's field (Config.MaxTokensField).
const (
	MaxCompletionTokens = "max_completion_tokens"
	MaxTokens           = "max_tokens"
)

// defaultPingAfter is Config.PingAfter's default.
const defaultPingAfter = 10 * time.Second

// defaultStreamLimit is Config.StreamLimit's default: longer than any
// generation of a model's whole output limit at a slow model's pace.
const defaultStreamLimit = 30 * time.Minute

// Client calls POST {BaseURL}/chat/completions.
type Client struct {
	cfg Config
	// endpoint is the URL calls are posted to (chatURL).
	endpoint string
	// Calls to a plain-text HTTP/1.1 upstream reached without a proxy go
	// through h1, on the caller's goroutine; all others through transport,
	// called directly: net/http's Client would follow redirects, and ask
	// for the body again to build each before its CheckRedirect is asked.
	h1        *http1.Client
	transport *http.Transport
}

var _ upstream.Provider = (*Client)(nil)

// maxReplyHeadBytes bounds the head of an upstream's reply, over either
// transport.
const maxReplyHeadBytes = 1 << 20

// maxReceiveBufferPerCall is how much of a call's reply an HTTP/2 upstream
// may send ahead of the gateway's reads (the stream's flow-control window).
const maxReceiveBufferPerCall = 256 << 10

// New returns a client with a connection pool sized for a busy gateway.
func New(cfg Config) *Client {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 120 * time.Second
	}
	if cfg.StreamLimit <= 0 {
		cfg.StreamLimit = defaultStreamLimit
	}
	if cfg.PingAfter <= 0 {
		cfg.PingAfter = defaultPingAfter
	}
	endpoint := chatURL(cfg.BaseURL)
	if plainHTTP1(cfg) {
		// http1's defaults are the transport's below: 5 s to connect, 512
		// idle connections, 1 KiB buffers; but idle connections are kept only
		// as long as the upstream keeps them.
		return &Client{cfg: cfg, endpoint: endpoint, h1: http1.New(http1.Config{IdleTimeout: cfg.IdleTimeout, MaxHeaderBytes: maxReplyHeadBytes})}
	}
	transport := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         lostpeer.Dialer(5 * time.Second).DialContext,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 512,
		IdleConnTimeout:     cmp.Or(cfg.IdleTimeout, 90*time.Second),
		TLSHandshakeTimeout: 5 * time.Second,
		// No ResponseHeaderTimeout: Complete's deadline and Stream's watchdog
		// already bound the wait for the reply, and it would cost every call a
		// timer of its own for as long as it waits.
		// An HTTP/1.1 connection keeps its buffers while its call waits, up to
		// minutes for a stream's first token: 4 KiB each way by default. The
		// request's head and an event of a stream fit in 1 KiB; a larger body
		// or reply is read and written past the buffer, straight from and to
		// the caller's slice.
		ReadBufferSize:  1 << 10,
		WriteBufferSize: 1 << 10,
		// A reply's head is bounded as package http1 bounds it, not by
		// net/http's default of 10 MB, which a hostile upstream could make
		// each call hold (HTTP/2 included: the limit it announces).
		MaxResponseHeaderBytes: maxReplyHeadBytes,
		// Calls ask for replies uncompressed, as package http1's do:
		// net/http would ask for gzip, and a compressing layer in front of
		// an upstream (a proxy, a web framework's middleware) may hold a
		// stream's events until its compressor's buffer fills.
		DisableCompression: true,
		// An HTTP/2 upstream may send a call as much as its flow-control
		// window allows before the gateway reads it, and the transport holds
		// what is not yet read: 4 MiB a call by default, which a stream to a
		// slow client of a hostile upstream would hold. A token stream needs a
		// fraction of maxReceiveBufferPerCall a round trip.
		// A connection silent for PingAfter is asked for a ping: without,
		// one the network lost takes every call net/http puts on it (up to
		// the upstream's limit of concurrent streams) until each one's
		// timeout, and net/http keeps it for the kernel's retransmissions
		// (15 minutes).
		HTTP2: &http.HTTP2Config{
			MaxReceiveBufferPerStream: maxReceiveBufferPerCall,
			SendPingTimeout:           cfg.PingAfter,
			PingTimeout:               cfg.PingAfter,
		},
		// A custom DialContext turns HTTP/2 off unless asked for: HTTPS upstreams
		// multiplex calls over few connections instead of one per call.
		ForceAttemptHTTP2: true,
	}
	if cfg.H2C {
		transport.Protocols = new(http.Protocols)
		transport.Protocols.SetUnencryptedHTTP2(true)
	}
	return &Client{cfg: cfg, endpoint: endpoint, transport: transport}
}

// CloseIdleConnections closes the connections kept for the next call; those
// in use are kept until their call ends, then for the idle time.
func (c *Client) CloseIdleConnections() {
	if c.h1 != nil {
		c.h1.CloseIdleConnections()
		return
	}
	c.transport.CloseIdleConnections()
}

// plainHTTP1 reports whether calls go to an http:// upstream over HTTP/1.1
// without a proxy: package http1 makes those, without the two goroutines
// net/http's Transport keeps per connection, which a call waiting for a
// stream's first token holds for as long as it waits.
func plainHTTP1(cfg Config) bool {
	u, err := url.Parse(cfg.BaseURL)
	if err != nil || u.Scheme != "http" || cfg.H2C {
		return false
	}
	proxy, err := http.ProxyFromEnvironment(&http.Request{URL: u})
	return err == nil && proxy == nil
}

// chatURL is where calls to base are posted: its path with
// /chat/completions appended, its query kept. A base that does not parse
// (the configuration refuses those) is taken as it is.
func chatURL(base string) string {
	u, err := url.Parse(base)
	if err != nil {
		return strings.TrimRight(base, "/") + "/chat/completions"
	}
	return u.JoinPath("chat", "completions").String()
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatRequest struct {
	Model               string         `json:"model"`
	Messages            []message      `json:"messages"`
	MaxCompletionTokens uint64         `json:"max_completion_tokens,omitempty"`
	MaxTokens           uint64         `json:"max_tokens,omitempty"`
	Stream              bool           `json:"stream,omitempty"`
	StreamOptions       *streamOptions `json:"stream_options,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// insufficientQuota is the code of OpenAI's 429 that says the account
// calling it has run out of credit, which no wait cures.
const insufficientQuota = "insufficient_quota"

// Complete implements upstream.Provider. Its reply is read by what it
// holds, as a stream's is (receive): a chat completion, or the events of an
// upstream that streams whatever it is asked, taken whole at their [DONE]
// (their usage counted by the caller when they reported none), at the end
// of a body that sent a finish_reason, or at the end of their ending
// (endingGrace) when the finish_reason and the usage came and the upstream
// keeps its connection open. The call, from its start to the whole reply,
// takes Timeout at most, and its reply replyBytes; anything it cannot use is
// a failure after dispatch.
func (c *Client) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w := c.watch(cancel, wholeCall, c.cfg.Timeout)
	defer w.timer.Stop()
	resp, dispatched, err := c.post(ctx, req, false)
	if err != nil {
		return upstream.Result{}, c.postError(w, dispatched, err)
	}
	defer resp.Body.Close()
	limit := replyBytes(req)
	if resp.ContentLength > limit {
		return upstream.Result{}, fmt.Errorf("%w: %w: %d bytes, where a reply to this request takes at most %d", upstream.ErrFailed, upstream.ErrTooLong, resp.ContentLength, limit)
	}
	res, err := c.receiveWhole(ctx, w, resp.Body, limit)
	if err != nil {
		return upstream.Result{}, err
	}
	return res, nil
}

// receiveWhole reads a reply asked for whole from body, no further than
// limit bytes (capped), as a stream's call reads one (receive).
func (c *Client) receiveWhole(ctx context.Context, w *watchdog, body io.Reader, limit int64) (upstream.Result, error) {
	return c.receive(ctx, w, &capped{body: body, left: limit + 1, limit: limit}, limit, int(limit), func(upstream.Delta) error { return nil })
}

// capped is a reply read whole, read no further than limit bytes: a read
// past them fails (upstream.ErrTooLong), whatever the reply holds (an event
// stream of blank lines included).
type capped struct {
	body        io.Reader
	left, limit int64 // left counts down from limit+1
}

// Read implements io.Reader.
func (c *capped) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, fmt.Errorf("%w: a reply to this request takes at most %d bytes", upstream.ErrTooLong, c.limit)
	}
	n, err := c.body.Read(p[:min(int64(len(p)), c.left)])
	c.left -= int64(n)
	return n, err
}

// completionFirst reports whether b, past white space, opens a JSON object:
// a reply that is one chat completion, not an event stream.
func completionFirst(b []byte) bool {
	b = bytes.TrimLeft(b, " \t\r\n")
	return len(b) > 0 && b[0] == '{'
}

// maxReplyBytes bounds a non-streaming reply read into memory, whatever the
// request asks for.
const maxReplyBytes = 64 << 20

// sourcesRoom is the room a reply is given for its sources: upstream.MaxSources
// of them, each with a URL and a title at their bounds, every byte escaped at
// worst, and their indices and field names.
const sourcesRoom = upstream.MaxSources * (6*(upstream.MaxURLBytes+upstream.MaxTitleBytes) + 256)

// replyBytes is the most of a non-streaming reply to req that is read (D11):
// room for its text at upstream.MaxTextBytes with every byte escaped at worst
// (a control character takes six, \u0001), for sourcesRoom and for the
// envelope; at most maxReplyBytes. A longer reply holds more text than the
// guard lets through, or more of sources than it keeps, and is not read.
func replyBytes(req *upstream.Request) int64 {
	return min(maxReplyBytes, 6*int64(upstream.MaxTextBytes(req))+sourcesRoom+64<<10)
}

// readReply reads a completion's body whole, first and then the rest of it,
// or fails (upstream.ErrTooLong) without reading on when it is longer than
// limit. size is how much of it may be read at once, the room it starts
// with.
func readReply(first []byte, rest io.Reader, size int, limit int64) ([]byte, error) {
	buf := append(make([]byte, 0, max(size, len(first))+bytes.MinRead), first...)
	in := io.LimitReader(rest, limit+1-int64(len(first)))
	for {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, cap(buf))
		}
		n, err := in.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > limit {
			return nil, fmt.Errorf("%w: a reply to this request takes at most %d bytes", upstream.ErrTooLong, limit)
		}
		switch {
		case errors.Is(err, io.EOF):
			return buf, nil
		case err != nil:
			return nil, err
		}
	}
}

// parseCompletion reads a chat completion body. Anything that is not one is a
// failure after dispatch: the upstream may have done the work. One without
// usage, from an upstream that reports none, has UsageReported false, for
// the caller to count, as a stream without usage.
func parseCompletion(raw []byte) (upstream.Result, error) {
	raw = withoutDone(raw)
	var cr chatResponse[plainText, []annotation]
	err := json.Unmarshal(raw, &cr)
	if mistyped(err) {
		var lenient chatResponse[parts, evidence[annotation]]
		if err = json.Unmarshal(raw, &lenient); err == nil {
			return completionResult(&lenient)
		}
	}
	if err != nil {
		return upstream.Result{}, fmt.Errorf("%w: the chat completion could not be decoded: %v", upstream.ErrFailed, err)
	}
	return completionResult(&cr)
}

// completionResult is what a decoded chat completion says.
func completionResult[C contents, A annotationList](cr *chatResponse[C, A]) (upstream.Result, error) {
	if len(cr.Choices) == 0 || cr.Choices[0].Message == nil {
		if cr.Error.present() {
			return upstream.Result{}, fmt.Errorf("%w: the upstream answered 200 with an error: %s", upstream.ErrFailed, cr.Error.what())
		}
		return upstream.Result{}, fmt.Errorf("%w: the chat completion has no message", upstream.ErrFailed)
	}
	if cr.Choices[0].FinishReason.erred() {
		why := finishedInErrorSays
		if cr.Error.present() {
			why = cr.Error.what()
		}
		return upstream.Result{}, fmt.Errorf("%w: %s", upstream.ErrFailed, why)
	}
	msg := cr.Choices[0].Message
	content := msg.Content.content()
	res := upstream.Result{Content: content, Reasoning: msg.Content.reasoning() + msg.reasoning(), Sources: append(sources(content, []annotation(msg.Annotations)), cr.from(0)...)}
	if cr.Usage != nil {
		cr.Usage.report(&res)
	}
	return res, nil
}

// withoutDone is raw without an event stream's end (data: [DONE]) after it,
// which some proxies append to a completion; raw itself when it has none.
// What stays must still be one completion.
func withoutDone(raw []byte) []byte {
	body, ok := bytes.CutSuffix(bytes.TrimRight(raw, " \t\r\n"), doneMarker)
	if !ok {
		return raw
	}
	if body, ok = bytes.CutSuffix(bytes.TrimRight(body, " \t"), []byte("data:")); !ok {
		return raw
	}
	return body
}

// post sends the chat request and returns a 2xx reply, or the classified
// error, and whether the request was dispatched: a connection was obtained to
// write it on (req.Dispatched is called then).
func (c *Client) post(ctx context.Context, req *upstream.Request, stream bool) (*http.Response, bool, error) {
	body, err := json.Marshal(c.chatBody(req, stream))
	if err != nil {
		return nil, false, fmt.Errorf("error encoding chat request: %w", err)
	}
	var dispatched atomic.Bool
	connected := func() {
		if dispatched.CompareAndSwap(false, true) {
			req.Dispatched()
		}
	}
	callCtx := ctx
	var once *sendOnce // net/http's transport only
	if c.h1 == nil {
		once = &sendOnce{h2c: c.cfg.H2C}
		callCtx = httptrace.WithClientTrace(ctx, once.trace(connected))
	}
	httpReq, err := http.NewRequestWithContext(callCtx, http.MethodPost, c.endpoint, bytes.NewReader(body))
	if err != nil {
		return nil, false, fmt.Errorf("error building chat request: %w", err)
	}
	if once != nil {
		httpReq.GetBody = once.body(body)
	}
	c.setHeaders(ctx, httpReq.Header, req, stream)
	var resp *http.Response
	if c.h1 != nil {
		resp, err = c.h1.Do(httpReq, connected)
	} else {
		// No redirect is followed, as in package http1: a call goes once,
		// where the operator sent it, and its headers (the key, the
		// configured ones) to no other host (D11, D12). A 3xx reply is
		// classified by statusError.
		resp, err = c.transport.RoundTrip(httpReq)
	}
	if err != nil {
		return nil, dispatched.Load(), transportError(ctx, err, dispatched.Load())
	}
	coding := inflate(resp)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer resp.Body.Close()
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, true, statusError(resp.StatusCode, resp.Header, raw)
	}
	if coding != "" {
		resp.Body.Close()
		return nil, true, fmt.Errorf("%w: the reply is compressed (Content-Encoding %s) though the call asked for it uncompressed", upstream.ErrFailed, gateway.Quote(coding))
	}
	return resp, true, nil
}

// chatBody is the body of a call for req, asked for streamed or whole.
func (c *Client) chatBody(req *upstream.Request, stream bool) chatRequest {
	cr := chatRequest{Model: req.UpstreamModel, Messages: messages(req), Stream: stream}
	if c.cfg.MaxTokensField == MaxTokens {
		cr.MaxTokens = req.MaxOutputTokens
	} else {
		cr.MaxCompletionTokens = req.MaxOutputTokens
	}
	if stream && !c.cfg.NoStreamOptions {
		cr.StreamOptions = &streamOptions{IncludeUsage: true}
	}
	return cr
}

// setHeaders sets the headers of a call for req, of the context ctx, asked
// for streamed or whole: the configured ones, the trace's, what it sends and
// accepts, the key and the request's hints.
func (c *Client) setHeaders(ctx context.Context, h http.Header, req *upstream.Request, stream bool) {
	for k, v := range c.cfg.Headers {
		h.Set(k, v)
	}
	tracing.Inject(ctx, h)
	h.Set("Content-Type", "application/json")
	if stream {
		h.Set("Accept", "text/event-stream")
	} else {
		h.Set("Accept", "application/json")
	}
	// Without Accept-Encoding any coding is acceptable (RFC 9110, 12.5.3):
	// ask for none, for the reason DisableCompression gives.
	h.Set("Accept-Encoding", "identity")
	switch {
	case c.cfg.APIKey == "":
	case c.cfg.APIKeyHeader != "":
		h.Set(c.cfg.APIKeyHeader, c.cfg.APIKey)
	default:
		h.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	if hint := hints(req.Hints); hint != "" {
		h.Set(HintsHeader, hint)
	}
}

// inflate makes resp's body read inflated when it is compressed with gzip
// though the call asked for it uncompressed (a CDN or a proxy in front of
// the upstream may ignore identity), its bounds then on what it inflates
// to, and returns the coding of a body it cannot inflate ("" when none).
// A reply's status is read whatever its coding.
func inflate(resp *http.Response) string {
	switch coding := strings.TrimSpace(resp.Header.Get("Content-Encoding")); {
	case coding == "", strings.EqualFold(coding, "identity"):
		return ""
	case strings.EqualFold(coding, "gzip"), strings.EqualFold(coding, "x-gzip"):
		resp.Body, resp.ContentLength = &gunzipped{body: resp.Body}, -1
		resp.Header.Del("Content-Encoding")
		return ""
	default:
		return coding
	}
}

// gunzipped is a reply body compressed with gzip, read inflated. Its gzip
// header is read with its first bytes, not before the reply is handed on:
// a stream's may come with its first event. An empty body is empty.
type gunzipped struct {
	body   io.ReadCloser
	reader *gzip.Reader
}

// Read implements io.Reader.
func (g *gunzipped) Read(p []byte) (int, error) {
	if g.reader == nil {
		r, err := gzip.NewReader(g.body)
		if errors.Is(err, io.EOF) {
			return 0, io.EOF
		}
		if err != nil {
			return 0, fmt.Errorf("the reply is not the gzip its Content-Encoding says: %w", err)
		}
		g.reader = r
	}
	return g.reader.Read(p)
}

// Close implements io.Closer.
func (g *gunzipped) Close() error { return g.body.Close() }

// sendOnce lets net/http's transport send a call again only while no
// attempt of it can have been processed. Over HTTP/2 the transport sends a
// call again after failures it takes for ones the upstream did not process,
// among them a stream reset with PROTOCOL_ERROR, which an upstream may send
// after it processed the call: one that reset every stream so, over h2c, had
// a call sent some 14,000 times in 5 s, for as long as its deadline lasted.
// So once an HTTP/2 attempt is written whole, or any attempt is answered in
// part, the call is never sent again (D12); it fails after dispatch. A call
// refused (REFUSED_STREAM) or cut by a GOAWAY after it was written whole
// fails alike, since the transport does not say why it sends again. Over
// HTTP/1.1 the transport sends a POST again only when not a byte of it
// reached the connection, which stays allowed. Package http1 never sends a
// call again.
type sendOnce struct {
	h2c   bool        // every connection speaks HTTP/2 (h2c)
	http2 atomic.Bool // the latest attempt's connection speaks HTTP/2
	sent  atomic.Bool // an HTTP/2 attempt was written whole, or one was answered
}

// trace reports a connection obtained to connected, and marks the call sent
// once an HTTP/2 attempt is written whole or a reply starts.
func (o *sendOnce) trace(connected func()) *httptrace.ClientTrace {
	return &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			o.http2.Store(o.h2c || negotiatedHTTP2(info.Conn))
			connected()
		},
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			if info.Err == nil && o.http2.Load() {
				o.sent.Store(true)
			}
		},
		GotFirstResponseByte: func() { o.sent.Store(true) },
	}
}

// negotiatedHTTP2 reports whether c is a TLS connection that chose HTTP/2.
func negotiatedHTTP2(c net.Conn) bool {
	tc, ok := c.(*tls.Conn)
	return ok && tc.ConnectionState().NegotiatedProtocol == "h2"
}

// errSentOnce refuses the transport a call's body for another attempt.
var errSentOnce = errors.New("the call was written to the upstream, so it is not sent again")

// body is the request's GetBody: body again, until the call was sent.
func (o *sendOnce) body(body []byte) func() (io.ReadCloser, error) {
	return func() (io.ReadCloser, error) {
		if o.sent.Load() {
			return nil, errSentOnce
		}
		return io.NopCloser(bytes.NewReader(body)), nil
	}
}

func messages(req *upstream.Request) []message {
	msgs := make([]message, 0, 2)
	if req.System != "" {
		msgs = append(msgs, message{Role: "system", Content: req.System})
	}
	return append(msgs, message{Role: "user", Content: req.Prompt})
}

func hints(h gateway.Hints) string {
	var parts []string
	if h.WebSearch {
		parts = append(parts, "web_search")
	}
	if h.CodeMode {
		parts = append(parts, "code_mode")
	}
	if h.ImageMode {
		parts = append(parts, "image_mode")
	}
	return strings.Join(parts, ",")
}

// transportError classifies a failure to reach the upstream or read its reply
// (D12). The caller's own cancellation is returned as is; a failure before a
// connection was obtained (refused, DNS, TLS handshake, dial timeout) means the
// upstream never saw the call; anything after (reset, timeout) means it may
// have processed it.
func transportError(ctx context.Context, err error, dispatched bool) error {
	if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return ctx.Err()
	}
	if !dispatched {
		return fmt.Errorf("%w: %v", upstream.ErrUnavailable, err)
	}
	return fmt.Errorf("%w: %v", upstream.ErrFailed, err)
}

// maxMessageBytes bounds the upstream's error message kept for callers.
const maxMessageBytes = 500

// errorMessage is an upstream's error message as kept for callers: cleaned,
// then cut to maxMessageBytes (cut first, cleaning could have made it up to
// three times as long: a replacement character for each invalid byte).
func errorMessage(msg string) string { return upstream.Cut(upstream.Clean(msg), maxMessageBytes) }

// statusError classifies a non-2xx reply (D12): 429 and 503 say the call was
// not processed, and so do 401, 407 and 404, which refuse the gateway's own
// credentials, address or model (upstream.ErrDenied), as does a 429 that
// says the gateway's account is out of credit (insufficientQuota), and 301,
// 307 and 308, which say the API is at another address (ErrDenied too:
// redirects are not followed); 408, every other 5xx and every other 3xx
// that it may have been (302 and 303 may answer a POST that was
// processed); other 4xx are a rejection of this request. A 429 or 503 carries the wait its header asks
// for (upstream.RetryAfter).
func statusError(status int, header http.Header, body []byte) error {
	msg, code := errorSays(body)
	switch {
	case status == http.StatusUnauthorized || status == http.StatusProxyAuthRequired || status == http.StatusNotFound:
		return fmt.Errorf("%w: %w: status %d: %s", upstream.ErrUnavailable, upstream.ErrDenied, status, msg)
	case status == http.StatusMovedPermanently || status == http.StatusTemporaryRedirect || status == http.StatusPermanentRedirect:
		return fmt.Errorf("%w: %w: status %d: redirected to %q, which the gateway does not follow: set the base URL to where it points",
			upstream.ErrUnavailable, upstream.ErrDenied, status, errorMessage(header.Get("Location")))
	case status == http.StatusTooManyRequests && code == insufficientQuota:
		// The gateway's own account is out of credit: a refusal of the
		// gateway, as a bad key is, for the operator to mend.
		return fmt.Errorf("%w: %w: status %d (%s): %s", upstream.ErrUnavailable, upstream.ErrDenied, status, insufficientQuota, msg)
	case status == http.StatusTooManyRequests:
		return upstream.WithRetryAfter(fmt.Errorf("%w: %w: status %d: %s", upstream.ErrUnavailable, upstream.ErrRateLimited, status, msg), retryAfter(header, time.Now()))
	case status == http.StatusServiceUnavailable:
		return upstream.WithRetryAfter(fmt.Errorf("%w: status %d: %s", upstream.ErrUnavailable, status, msg), retryAfter(header, time.Now()))
	case status == http.StatusRequestTimeout || status >= 500 || status < 400:
		return fmt.Errorf("%w: status %d: %s", upstream.ErrFailed, status, msg)
	}
	return &upstream.RejectedError{Status: status, Message: msg}
}

// retryAfter is the wait a busy upstream's reply asks for: its
// retry-after-ms header (OpenAI's), else Retry-After in seconds or as an HTTP
// date; zero when there is none or it cannot be read. Numbers are bounded
// before they become durations, so none overflows.
func retryAfter(header http.Header, now time.Time) time.Duration {
	if ms, err := strconv.ParseFloat(header.Get("Retry-After-Ms"), 64); err == nil && ms > 0 {
		return time.Duration(min(ms, float64(upstream.MaxRetryAfter/time.Millisecond))) * time.Millisecond
	}
	v := strings.TrimSpace(header.Get("Retry-After"))
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil && secs > 0 {
		return time.Duration(min(secs, int64(upstream.MaxRetryAfter/time.Second))) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil {
		return at.Sub(now)
	}
	return 0
}

// sources maps url_citation annotations to evidence; the cited span of the
// content, when its indexes are valid, is the snippet (it shares the
// content's memory: the guard bounds what is kept).
func sources(content string, annotations []annotation) []gateway.Source {
	var out []gateway.Source
	var at func(int) int // a character index's byte offset in content
	for _, a := range annotations {
		if a.Type != "url_citation" || a.URLCitation == nil || a.URLCitation.URL == "" {
			continue
		}
		c := a.URLCitation
		s := gateway.Source{Title: c.Title, URL: c.URL}
		if c.spans(content) {
			if at == nil {
				at = charOffsets(content, annotations)
			}
			if start, end := at(c.StartIndex), at(c.EndIndex); start >= 0 && end >= 0 {
				s.Snippet = content[start:end]
			}
		}
		out = append(out, s)
	}
	return out
}

// charOffsets returns the byte offset in content of a character (code
// point) index that annotations name, as OpenAI's API counts a citation's
// start and end; -1 for an index past content's end. Content in ASCII is
// indexed as it is; other content is read once, whatever the number of
// annotations.
func charOffsets(content string, annotations []annotation) func(int) int {
	ascii := true
	for i := 0; i < len(content) && ascii; i++ {
		ascii = content[i] < utf8.RuneSelf
	}
	if ascii {
		return func(i int) int { return i }
	}
	var idx []int
	for _, a := range annotations {
		if c := a.URLCitation; c != nil && c.spans(content) {
			idx = append(idx, c.StartIndex, c.EndIndex)
		}
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	offsets := make([]int, len(idx))
	j, n := 0, 0
	for off := range content {
		for ; j < len(idx) && idx[j] == n; j++ {
			offsets[j] = off
		}
		n++
	}
	for ; j < len(idx); j++ {
		offsets[j] = -1
		if idx[j] == n {
			offsets[j] = len(content)
		}
	}
	return func(i int) int {
		if k, ok := slices.BinarySearch(idx, i); ok {
			return offsets[k]
		}
		return -1
	}
}
