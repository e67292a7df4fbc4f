package server

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/upstream"
)

// streamReply is the text/event-stream reply of the responses routes. The head
// goes out before inference starts; every failure after it is a response.error
// event (interface §6), with the code the JSON path would give.
type streamReply struct {
	s *Server
	// ctx is the call's context (see callContext); done releases it.
	ctx  context.Context
	done func()
	// call is the prepared request; err, when set, is why it cannot run.
	call *inference.Call
	err  error
}

// VisitCreateResponseResponse implements api.CreateResponseResponseObject.
func (r streamReply) VisitCreateResponseResponse(w http.ResponseWriter) error { return r.serve(w) }

// VisitCreateChatResponse implements api.CreateChatResponseObject.
func (r streamReply) VisitCreateChatResponse(w http.ResponseWriter) error { return r.serve(w) }

// serve streams the reply through w; a stream that runs long is detached
// from its connection's goroutine (HTTP/1.1) or from its handler's stack
// (HTTP/2; see serveDetachable).
func (r streamReply) serve(w http.ResponseWriter) error {
	var estimate int64
	if r.call != nil {
		estimate = r.call.Estimate.InputRungs
	}
	w.Header().Set("x-service-input-rungs", strconv.FormatInt(estimate, 10))
	x := exchangeFrom(r.ctx)
	if r.err == nil && x != nil && r.s.detachable(r.ctx, x.req) {
		return r.s.serveDetachable(r, w, x)
	}
	defer r.done()
	var stream context.Context
	if x != nil {
		stream = http2Stream(x.req)
	}
	r.run(r.ctx, startSSE(w, stream, r.s.keepalive, r.s.streamWriteTimeout))
	return nil
}

// detachable says whether a stream of req, whose context is ctx, can be
// detached: over HTTP/1.1 when the connection taken over can go back to the
// server through its listener (Listener), over HTTP/2 when ServeHTTP waits
// at the top. HTTP/1.0 has no chunks.
func (s *Server) detachable(ctx context.Context, req *http.Request) bool {
	switch {
	case s.detachAfter <= 0:
		return false
	case req.ProtoMajor == 1 && req.ProtoMinor == 1:
		return s.relisten.Load() != nil
	default:
		return topOf(ctx) != nil
	}
}

// run streams the call, whose context is ctx, as events on sse, and closes it.
// A write that fails ends it: its client left (see exchange.clientLeft).
func (r streamReply) run(ctx context.Context, sse *sseWriter) {
	defer sse.Close()
	r.s.metrics.StreamOpened()
	defer r.s.metrics.StreamClosed()
	// gone: the call ended as its client left.
	var gone bool
	if x := exchangeFrom(r.ctx); x != nil {
		// For the request's log line, written once run has returned.
		defer func() { x.clientLeft = gone || sse.failed() }()
	}
	if r.err != nil {
		_ = r.fail(sse, r.err)
		return
	}

	requestID := r.call.RequestID
	model := api.StreamChunkModel(r.call.Request.Model)
	index := 0
	chunk := func(content string, sources []gateway.Source) api.StreamChunk {
		c := api.StreamChunk{Index: index, Content: content, RequestId: &requestID, Model: &model}
		if len(sources) > 0 {
			s := apiSources(sources)
			c.Sources = &s
		}
		index++
		return c
	}
	res, err := r.s.inference.Stream(ctx, r.call, func(d upstream.Delta) error {
		return sse.Event(eventDelta, chunk(d.Content, d.Sources))
	})
	noteBilled(r.ctx, res)
	if errors.Is(err, inference.ErrCallerGone) {
		gone = true
		return // its output, if any, is billed; nobody is listening
	}
	if err != nil && res == nil {
		// Nothing was produced: the stream failed to start.
		_ = r.fail(sse, err)
		return
	}
	if err != nil && r.fail(sse, err) != nil {
		return
	}
	final := chunk("", nil)
	final.Done = true
	usage := rungUsage(res.Usage)
	final.Usage = &usage
	_ = sse.Event(eventCompleted, final)
}

// fail sends err as a response.error event, and returns the write's error.
// Its code is counted and named in the request's log line, and a failure of
// the gateway's own (serverFault) is logged, as handleError logs a reply's:
// the stream's head said 200 before it.
func (r streamReply) fail(sse *sseWriter, err error) error {
	e := r.s.domainError(err)
	r.s.metrics.StreamError(string(e.Code))
	x := exchangeFrom(r.ctx)
	if x != nil {
		x.errorCode = e.Code
	}
	if serverFault(e.Code) {
		attrs := []any{"error", err}
		if x != nil {
			attrs = append(attrs, "request_id", x.id, "route", x.route)
		}
		r.s.logger.Error("stream failed", attrs...)
	}
	return sse.Event(eventError, envelopeOf(e))
}
