package server

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"go.opentelemetry.io/otel/trace"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/tracing"
)

// RequestIDHeader carries a request's id: echoed when the client sends a
// usable one, generated otherwise; a generated one is also the request_id of
// the response made (body, sources, logs and header agree).
const RequestIDHeader = "x-request-id"

const maxRequestIDLen = 128

// observe gives every request an id, and once it is answered writes one JSON
// log line (id, method, route, status, duration, bytes, client address,
// account, the error's code if it failed, whether a stream's client left
// before its end, what a response was billed, the batch a batch route
// named; never a key or a prompt) and records it in the metrics. Errors
// are answered here, through the error handler, so the status is known. A
// stream detached from its connection's goroutine (see serveDetachable) is
// logged when it ends. A reply that is not a stream must be read within
// replyWriteTimeout of its first byte (see replyDeadline).
func (s *Server) observe(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		r := c.Request()
		x := &exchange{s: s, req: r, w: c.Response(), start: time.Now(), method: metrics.Method(r.Method),
			client: clientAddress(r.RemoteAddr, r.Header.Values("X-Forwarded-For"), s.trustedProxies)}
		c.Response().Before(x.replyDeadline)
		x.id = c.Request().Header.Get(RequestIDHeader)
		ctx := context.WithValue(c.Request().Context(), exchangeKey{}, x)
		if !usableRequestID(x.id) {
			generated := uuid.Must(uuid.NewV7())
			x.id = generated.String()
			// A response made for this request takes this id as its request_id.
			ctx = context.WithValue(ctx, generatedIDKey{}, generated)
		}
		c.Response().Header().Set(RequestIDHeader, x.id)
		x.route = c.Path()
		if !s.routes[x.route] {
			x.route = metrics.Other // only the document's routes are label values (D11)
		}
		ctx, x.span = tracing.Request(ctx, c.Request(), x.route, x.client)
		c.SetRequest(c.Request().WithContext(ctx))
		defer func() {
			// Only http.ErrAbortHandler passes the Recover middleware: a
			// reply cut short on purpose, logged before its connection ends.
			if p := recover(); p != nil {
				if !x.detached {
					x.finish(c.Request().Context(), c.Response().Status, c.Response().Size)
				}
				panic(p)
			}
		}()
		if err := next(c); err != nil {
			c.Error(err)
		}
		if !x.detached {
			x.finish(c.Request().Context(), c.Response().Status, c.Response().Size)
		}
		return nil
	}
}

// exchange is what observe knows of a request, kept in its context until its
// log line is written.
type exchange struct {
	s *Server
	// req is the request until a stream is detached; w is its response.
	req    *http.Request
	w      http.ResponseWriter
	start  time.Time
	id     string
	method string
	route  string
	client string
	span   trace.Span
	// detached says the response goes on after the handler returned: whoever
	// serves it calls finish.
	detached bool
	// errorCode is the code of the error replied or sent in the stream, if
	// any; clientLeft says a stream's client left before its end.
	errorCode  gateway.ErrorCode
	clientLeft bool
	// billed is what the request was billed, if anything (noteBilled): its
	// model is empty otherwise.
	billed billing
	// batch is the batch a batch route created or named (noteBatch).
	batch uuid.UUID
}

// noteBatch names batch in the log line of the request whose context is ctx.
func noteBatch(ctx context.Context, batch uuid.UUID) {
	if x := exchangeFrom(ctx); x != nil {
		x.batch = batch
	}
}

// billing is what a request's log line says of a committed response.
type billing struct {
	requestID uuid.UUID
	model     gateway.Model
	upstream  gateway.UpstreamRoute
	usage     gateway.Usage
}

// noteBilled records res, a committed response (or the committed part of a
// stream), for the log line of the request whose context is ctx.
func noteBilled(ctx context.Context, res *inference.Result) {
	if x := exchangeFrom(ctx); x != nil && res != nil {
		x.billed = billing{requestID: res.RequestID, model: res.Model, upstream: res.Route.Upstream, usage: res.Usage}
	}
}

// replyDeadline bounds the time the client may take to read the reply about
// to be written: a client that reads nothing, its connection alive, would
// otherwise hold the handler's goroutine for as long as it liked. Not a
// stream's: each of its writes is bounded (sseWriter). The deadline stays for
// the reply's last bytes, which net/http writes after the handler, and
// net/http lifts it then. Nor a reply to an HTTP/2 request whose client
// left (a reply that was done as it left; see closedStream).
func (x *exchange) replyDeadline() {
	if x.w.Header().Get("Content-Type") == "text/event-stream" || closedStream(http2Stream(x.req)) {
		return
	}
	_ = http.NewResponseController(x.w).SetWriteDeadline(time.Now().Add(x.s.replyWriteTimeout))
}

// http2Stream is the context of req's HTTP/2 stream, which net/http ends
// when it closes the stream (its client reset it, or the connection went
// away), or nil when req came over HTTP/1.x, whose context ends also when
// its client only shut its side of the connection.
func http2Stream(req *http.Request) context.Context {
	if req.ProtoMajor != 2 {
		return nil
	}
	return req.Context()
}

// closedStream says whether the HTTP/2 stream of context stream (nil: none)
// is closed. net/http writes nothing more on a closed stream, and a write
// deadline set on it would start a timer that keeps the stream until it
// fires, then resets it again.
func closedStream(stream context.Context) bool { return stream != nil && stream.Err() != nil }

type exchangeKey struct{}

// exchangeFrom is the exchange of the request whose context is ctx.
func exchangeFrom(ctx context.Context) *exchange {
	x, _ := ctx.Value(exchangeKey{}).(*exchange)
	return x
}

// finish records the answered request: span, metrics and log line. ctx is the
// request's context as the handler saw it (with its principal).
func (x *exchange) finish(ctx context.Context, status int, size int64) {
	elapsed := time.Since(x.start)
	tracing.EndRequest(x.span, status)
	x.s.metrics.Request(x.route, x.method, status, elapsed)
	attrs := append(make([]slog.Attr, 0, 18),
		slog.String("request_id", x.id),
		slog.String("method", x.method),
		slog.String("route", x.route),
		slog.Int("status", status),
		slog.Float64("duration_ms", float64(elapsed.Microseconds())/1000),
		slog.Int64("bytes", size),
		slog.String("client", x.client),
	)
	if p := gateway.PrincipalFrom(ctx); p != nil {
		attrs = append(attrs, slog.String("account", p.AccountName), slog.String("key_id", p.KeyID.String()))
	}
	if x.errorCode != "" {
		attrs = append(attrs, slog.String("error_code", string(x.errorCode)))
	}
	if x.clientLeft {
		attrs = append(attrs, slog.Bool("client_left", true))
	}
	if x.batch != uuid.Nil {
		attrs = append(attrs, slog.String("batch_id", x.batch.String()))
	}
	if b := x.billed; b.model != "" {
		attrs = append(attrs, slog.String("model", string(b.model)),
			slog.Int64("input_rungs", b.usage.InputRungs), slog.Int64("output_rungs", b.usage.OutputRungs))
		if b.upstream.Provider != "" {
			attrs = append(attrs, slog.String("provider", b.upstream.Provider), slog.String("upstream_model", b.upstream.UpstreamModel))
		}
		if id := b.requestID.String(); id != x.id {
			// The client named the request (x-request-id): the response's
			// own id, as its body and the sources endpoint give it.
			attrs = append(attrs, slog.String("response_request_id", id))
		}
	}
	x.s.logger.LogAttrs(ctx, slog.LevelInfo, "request", attrs...)
}

type generatedIDKey struct{}

// generatedRequestID is the request id observe generated for a request whose
// client sent none.
func generatedRequestID(ctx context.Context) (uuid.UUID, bool) {
	id, ok := ctx.Value(generatedIDKey{}).(uuid.UUID)
	return id, ok
}

// usableRequestID accepts short printable ASCII ids.
func usableRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDLen {
		return false
	}
	for _, r := range id {
		if r < 0x21 || r > 0x7e {
			return false
		}
	}
	return true
}
