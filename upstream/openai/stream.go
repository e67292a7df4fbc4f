package openai

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// streamChunk is one event of a stream; C is its deltas' content and A
// their annotations: plainText and []annotation, or parts and
// evidence[annotation] when the event is decoded again leniently
// (mistyped).
type streamChunk[C contents, A annotationList] struct {
	Choices []streamChoice[C, A] `json:"choices"`
	Usage   *usage               `json:"usage"`
	Error   *upstreamError       `json:"error"`
	searchResults
}

// streamChoice is a choice of a stream's event.
type streamChoice[C contents, A annotationList] struct {
	Delta struct {
		Content     *C `json:"content"`
		Annotations A  `json:"annotations"`
		thinking
	} `json:"delta"`
	FinishReason *finishReason `json:"finish_reason"`
}

// plain is the chunk with its contents as strings, the thinking they
// carried with the delta's other thinking, and its annotations as a plain
// list.
func (c *streamChunk[C, A]) plain() streamChunk[plainText, []annotation] {
	out := streamChunk[plainText, []annotation]{Choices: make([]streamChoice[plainText, []annotation], len(c.Choices)), Usage: c.Usage, Error: c.Error, searchResults: c.searchResults}
	for i, ch := range c.Choices {
		o := &out.Choices[i]
		o.Delta.Annotations, o.FinishReason, o.Delta.thinking = []annotation(ch.Delta.Annotations), ch.FinishReason, ch.Delta.thinking
		if ch.Delta.Content != nil {
			content := plainText((*ch.Delta.Content).content())
			o.Delta.Content = &content
			if r := (*ch.Delta.Content).reasoning(); r != "" {
				all := thought(r + ch.Delta.reasoning())
				o.Delta.thinking = thinking{ReasoningContent: &all}
			}
		}
	}
	return out
}

var doneMarker = []byte("[DONE]")

// byteOrderMark is UTF-8's, which some servers put before a body: SSE and
// JSON's RFC 8259 let a reader drop it.
var byteOrderMark = []byte("\uFEFF")

// Stream implements upstream.Provider. It asks for usage in the stream
// (stream_options.include_usage), reads data: lines as they arrive, skips
// role-only and empty deltas, and treats a stream that ends without [DONE]
// or a finish_reason (see readStream), an in-stream error, Timeout of
// silence, or a call longer than StreamLimit as broken (ErrStreamBroken, with
// what was received). A stream that ends whole but without usage succeeds
// with UsageReported false, for the caller to count; so does one left open
// past endingGrace after its finish_reason and usage.
//
// The reply is waited for in post, under this function's frame only: what
// follows it (reading, classifying) is in receive, so that the goroutine
// waiting, often long, for an upstream's first byte waits shallow and keeps a
// small stack.
func (c *Client) Stream(ctx context.Context, req *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w := c.watch(cancel, streamCall, c.cfg.StreamLimit)
	defer w.timer.Stop()
	resp, dispatched, err := c.post(ctx, req, true)
	if err != nil {
		return upstream.Result{}, c.postError(w, dispatched, err)
	}
	defer resp.Body.Close()
	return c.receive(ctx, w, resp.Body, replyBytes(req), upstream.MaxTextBytes(req), emit)
}

// call is a kind of call to an upstream, as its watchdog tells its failures:
// a stream's or a call asked for whole.
type call struct {
	name   string // in the watchdog's reasons
	broken error  // the class of its failures while its reply is read
}

// The kinds of calls.
var (
	streamCall = call{name: "stream", broken: upstream.ErrStreamBroken}
	wholeCall  = call{name: "call", broken: upstream.ErrFailed}
)

// watchdog cancels a call after Timeout of silence, or at its deadline, its
// limit after it began (StreamLimit for a stream, Timeout for a call asked
// for whole), however the upstream keeps talking
// (comment lines and empty deltas reset the silence, not the deadline); and,
// once a finish_reason and the usage are read, at the end of the stream's
// ending (endingGrace), for an upstream that finishes but does not end its
// stream. One timer serves all three: it is set to whichever comes first.
type watchdog struct {
	call
	timer    *time.Timer
	silence  time.Duration
	limit    time.Duration
	deadline time.Time
	ends     time.Time    // the end of its ending; the reader's alone
	output   bool         // output was emitted since the last heard; the reader's alone
	ending   atomic.Bool  // a finish_reason and the usage were read
	fired    atomic.Int32 // why it fired: 0 (it did not), firedSilence, firedLimit or firedEnding
}

const (
	firedSilence = 1 + iota
	firedLimit
	firedEnding
)

// endingGrace is how long a stream that has sent its finish_reason and its
// usage, all it holds but [DONE], is given to end, or its silence Timeout if
// that is shorter: an upstream that finishes but leaves its stream open,
// quiet or sending keep-alives, does not hold the reply back; its stream is
// whole. A finish_reason alone does not start it: some upstreams send one
// early (Open WebUI with its reasoning chunks), and their output goes on.
const endingGrace = 2 * time.Second

// watch starts the watchdog of a call of kind k, which calls cancel when it
// fires: after Timeout of silence, at limit from now, or at the end of its
// ending.
func (c *Client) watch(cancel context.CancelFunc, k call, limit time.Duration) *watchdog {
	w := &watchdog{call: k, silence: c.cfg.Timeout, limit: limit}
	w.deadline = time.Now().Add(w.limit)
	w.timer = time.AfterFunc(min(w.silence, w.limit), func() {
		why := int32(firedSilence)
		switch {
		case w.ending.Load():
			why = firedEnding
		case !time.Now().Before(w.deadline):
			why = firedLimit
		}
		w.fired.Store(why)
		cancel()
	})
	return w
}

// heard rearms the watchdog: the upstream said something, and ended says
// whether it has sent its finish_reason and its usage, from when the stream
// has endingGrace left at most, counted from its last output: an upstream
// that sends them early, in every event, goes on while its output does.
func (w *watchdog) heard(ended bool) {
	left := min(w.silence, time.Until(w.deadline))
	if ended {
		if !w.ending.Load() || w.output {
			w.ends = time.Now().Add(min(w.silence, endingGrace))
			w.ending.Store(true)
		}
		left = min(left, time.Until(w.ends))
	}
	w.output = false
	w.timer.Reset(left)
}

// pausedDuring returns emit with the watchdog paused while it runs: the time
// a client takes to accept a delta is not its upstream's silence. (readStream
// rearms it, heard, before it reads on; the deadline stays where it was.)
// Each delta is output, from which a stream's ending counts (heard).
func (w *watchdog) pausedDuring(emit func(upstream.Delta) error) func(upstream.Delta) error {
	return func(d upstream.Delta) error {
		w.timer.Stop()
		w.output = true
		return emit(d)
	}
}

// reason says why the watchdog fired, after what: "no reply" or "no data".
func (w *watchdog) reason(what string) string {
	if w.fired.Load() == firedLimit {
		return fmt.Sprintf("the %s took longer than its limit of %s", w.name, w.limit)
	}
	return fmt.Sprintf("%s for %s", what, w.silence)
}

// postError is the error of a stream whose request failed.
func (c *Client) postError(w *watchdog, dispatched bool, err error) error {
	if w.fired.Load() != 0 {
		class := upstream.ErrFailed
		if !dispatched {
			class = upstream.ErrUnavailable
		}
		return fmt.Errorf("%w: %s", class, w.reason("no reply"))
	}
	return err
}

// receive reads a call's reply from body, of at most limit bytes a line or
// a completion (replyBytes) and keeping at most maxThinking bytes of
// thinking (see readStream), and classifies how it ended: a failure is of
// the class of w's call. The reply is read by what it holds, not by its
// Content-Type (see readStream).
func (c *Client) receive(ctx context.Context, w *watchdog, body io.Reader, limit int64, maxThinking int, emit func(upstream.Delta) error) (upstream.Result, error) {
	res, err := readStream(body, limit, maxThinking, w.heard, w.pausedDuring(emit))
	switch {
	case err == nil, errors.Is(err, errEmit):
		return res, errors.Unwrap(err)
	case errors.Is(err, upstream.ErrTooLong):
		return res, fmt.Errorf("%w: %w", w.broken, err)
	case w.fired.Load() == firedEnding:
		return res, nil // finished, though not ended by its upstream
	case ctx.Err() != nil && w.fired.Load() == 0:
		return res, ctx.Err() // the caller went away
	case w.fired.Load() != 0:
		return res, fmt.Errorf("%w: %s", w.broken, w.reason("no data"))
	default:
		return res, fmt.Errorf("%w: %v", w.broken, err)
	}
}

// readCompletion reads the rest of a reply whose first line, first, opens a
// JSON object: one chat completion, of at most limit bytes in all, from an
// upstream that does not stream. Its text and sources are emitted as one
// delta: the call was answered, and its output is not dropped for coming in
// one piece.
func readCompletion(first []byte, rest *bufio.Reader, limit int64, emit func(upstream.Delta) error) (upstream.Result, error) {
	// first is the reader's buffer, which rest overwrites: it is copied
	// before rest is read.
	raw, err := readReply(first, rest, len(first)+rest.Buffered(), limit)
	if err != nil {
		return upstream.Result{}, err
	}
	res, err := parseCompletion(raw)
	if err != nil {
		return upstream.Result{}, err
	}
	if res.Content != "" || len(res.Sources) > 0 {
		if err := emit(upstream.Delta{Content: res.Content, Sources: res.Sources}); err != nil {
			return res, emitError{err}
		}
	}
	return res, nil
}

// errEmit wraps the error of the caller's emit, to tell it from a broken stream.
var errEmit = errors.New("emit failed")

type emitError struct{ err error }

func (e emitError) Error() string        { return e.err.Error() }
func (e emitError) Unwrap() error        { return e.err }
func (e emitError) Is(target error) bool { return target == errEmit }

// readWaiter is a body that can wait, without a buffer of the caller's,
// until it can be read without blocking (upstream/http1's bodies).
type readWaiter interface{ WaitReadable() error }

// lineReaders are the stream readers' buffers. Small: longer lines are
// gathered below.
var lineReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// errorInStream is the error an upstream sent in a stream, with its message.
func errorInStream(message string) error {
	return fmt.Errorf("upstream error in stream: %s", message)
}

// finishReason is what a choice's finish_reason says, whatever its type:
// one that is not a string, as SGLang's own API sends an object, fails
// nothing. It is read without being kept.
type finishReason uint8

// What a finish_reason says.
const (
	notFinished finishReason = iota // absent, null, or a value that says nothing
	finishedWhole
	finishedInError // "error": the generation failed (OpenRouter's, with an error beside it; some servers send it alone)
)

// ends reports whether the choice ended: the finish_reason is there (a
// stream's chunk holds it by address, so that a null, in every chunk but
// the last, costs no call) and says something (says), not an empty string,
// false or 0, which a server may send for none.
func (r *finishReason) ends() bool { return r != nil && *r != notFinished }

// erred reports whether the choice's generation failed, and its output so
// far is no whole reply.
func (r *finishReason) erred() bool { return r != nil && *r == finishedInError }

// UnmarshalJSON implements json.Unmarshaler.
func (r *finishReason) UnmarshalJSON(b []byte) error {
	switch {
	case string(b) == `"error"`:
		*r = finishedInError
	case says(b):
		*r = finishedWhole
	default:
		*r = notFinished
	}
	return nil
}

// finishedInErrorSays is the message of a choice finished in error without
// an error beside it.
const finishedInErrorSays = `the upstream finished its output with finish_reason "error"`

// errorEventSays is what an error event's data, or an error field, says
// (errorSays).
func errorEventSays(data []byte) string {
	message, _ := errorSays(data)
	return message
}

// forQuote keeps the start of b for an error to quote (gateway.Quote, which
// clips it further): enough of it to be clipped with an ellipsis, never a
// copy of a long line whole.
func forQuote(b []byte) string { return string(b[:min(len(b), 256)]) }

// maxLineBytes bounds one data: line, whatever the request asks for; a
// longer one breaks the stream. A line longer than a whole reply to its
// request could be (replyBytes) breaks it too.
const maxLineBytes = 8 << 20

// readStream reads a reply of at most limit bytes: server-sent chat
// completion chunks until [DONE] (an event's data spread over several lines
// joined, as SSE joins them), calling progress before each line and emit
// for each delta with content or evidence (progress is told whether a
// finish_reason and the usage were read); or, when its first line that is
// not blank opens a JSON object (after a byte order mark, which is dropped),
// one chat completion (readCompletion). The
// reply is read by what it holds: upstreams and the proxies before them label
// streams application/json, and completions text/event-stream. It returns
// what was received; the error is nil at [DONE], at the end of a body that
// sent a finish_reason (some upstreams send no [DONE]), or after a
// completion; an emitError when emit failed; otherwise why the stream is
// broken (an end before either, which quotes the first line of a body
// without a data: line, an in-stream error, a malformed chunk or
// completion, a line longer than maxLineBytes or limit, or a completion
// longer than limit: upstream.ErrTooLong). A body framed by its length
// (chunked, Content-Length, HTTP/2) whose connection is lost before its end
// fails with an error of its own, never io.EOF; one that ends as its
// connection closes is whole only with its finish_reason or [DONE].
// Thinking is kept up to maxThinking bytes, and no further: a stream's
// length is bounded by its time alone. Past upstream.MaxTextBytes it holds
// more tokens than the output ceiling, past which the metering counts none.
// Everything in body is untrusted.
func readStream(body io.Reader, limit int64, maxThinking int, progress func(ended bool), emit func(upstream.Delta) error) (upstream.Result, error) {
	s := &streamReader{body: body, maxLine: min(maxLineBytes, limit), maxThinking: maxThinking, emit: emit}
	s.waiter, _ = body.(readWaiter)
	defer s.release()
	for {
		progress(s.finished && s.res.UsageReported)
		if err := s.fill(); err != nil {
			return s.result(err)
		}
		line, err := s.reader.ReadSlice('\n')
		if !s.opened {
			line = bytes.TrimPrefix(line, byteOrderMark)
			if completionFirst(line) {
				return readCompletion(line, s.reader, limit, emit) // bounded by limit, not as a line
			}
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			if line, err = s.gather(line); int64(len(line)) > s.maxLine {
				return s.result(s.lineTooLong())
			}
		}
		if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
			if errors.Is(err, io.EOF) {
				return s.result(s.ended())
			}
			return s.result(err)
		}
		if end, err := s.line(line); end {
			return s.result(err)
		}
	}
}

// streamReader is readStream's state: what the stream sent so far, and the
// line reader it holds.
type streamReader struct {
	body        io.Reader
	waiter      readWaiter    // body, when it can wait without a buffer
	reader      *bufio.Reader // from lineReaders, held while there is something to read
	maxLine     int64         // the longest line taken
	maxThinking int           // the most thinking kept, in bytes
	emit        func(upstream.Delta) error

	res               upstream.Result
	content, thoughts bytes.Buffer
	opened            bool   // a line that is not blank was read
	evented           bool   // a data: line was read
	opening           string // the first line that is not blank, unless a data: line
	noChunk           string // the last data that was no chunk
	finished          bool   // a choice's finish_reason was read
	errorEvent        bool   // the event being read is named error
	searched          int    // the search results taken (searchResults)
	// spread gathers the data of an event spread over lines, which SSE joins
	// with "\n", from a first line that is not JSON whole to the event's end.
	spread []byte
}

// result is what was received, with err.
func (s *streamReader) result(err error) (upstream.Result, error) {
	s.res.Content, s.res.Reasoning = s.content.String(), s.thoughts.String()
	return s.res, err
}

// fill holds a line reader with something to read. Over upstream/http1 the
// buffer is held only while there is: a stream waiting for its next token
// holds none.
func (s *streamReader) fill() error {
	if s.waiter != nil && (s.reader == nil || s.reader.Buffered() == 0) {
		s.release()
		if err := s.waiter.WaitReadable(); err != nil {
			return err
		}
	}
	if s.reader == nil {
		s.reader = lineReaders.Get().(*bufio.Reader)
		s.reader.Reset(s.body)
	}
	return nil
}

// release returns the line reader, if one is held.
func (s *streamReader) release() {
	if s.reader != nil {
		s.reader.Reset(nil)
		lineReaders.Put(s.reader)
		s.reader = nil
	}
}

// gather reads the rest of a data line longer than the reader's buffer,
// whose start is line, until its end or past maxLine, and returns it whole
// with the error of its last read.
func (s *streamReader) gather(line []byte) ([]byte, error) {
	full := append([]byte(nil), line...)
	err := bufio.ErrBufferFull
	for errors.Is(err, bufio.ErrBufferFull) && int64(len(full)) <= s.maxLine {
		line, err = s.reader.ReadSlice('\n')
		full = append(full, line...)
	}
	return full, err
}

// lineTooLong is the error of a line longer than maxLine.
func (s *streamReader) lineTooLong() error {
	return fmt.Errorf("%w: a stream line is longer than %d bytes, the most one may take in a reply to this request", upstream.ErrTooLong, s.maxLine)
}

// ended says how a body that ended stands: whole (nil) or broken, and why.
func (s *streamReader) ended() error {
	if end, err := s.eventEnds(); end {
		return err
	}
	switch {
	case s.finished:
		return nil // ended whole, by an upstream that sends no [DONE]
	case !s.opened:
		return errors.New("the body is empty")
	case !s.evented:
		// A page from a proxy or a firewall, answered 200.
		return fmt.Errorf("the body holds no events (no data: line); it begins %s", gateway.Quote(s.opening))
	case s.noChunk != "":
		return fmt.Errorf("connection closed before [DONE] or a finish_reason (the last data that was no chunk: %s)", gateway.Quote(s.noChunk))
	}
	return errors.New("connection closed before [DONE] or a finish_reason")
}

// line takes a line of the stream. end says the stream ends with it, whole
// (err nil) or not.
func (s *streamReader) line(line []byte) (end bool, err error) {
	field := bytes.TrimRight(line, "\r\n")
	data, ok := bytes.CutPrefix(field, []byte("data:"))
	if !s.opened {
		if t := bytes.TrimSpace(line); len(t) > 0 {
			s.opened = true
			if !ok {
				s.opening = forQuote(t)
			}
		}
	}
	s.evented = s.evented || ok
	if !ok {
		return s.field(field)
	}
	data = bytes.TrimSpace(data)
	if s.spread != nil {
		if s.spread = append(append(s.spread, '\n'), data...); int64(len(s.spread)) > s.maxLine {
			return true, s.lineTooLong()
		}
		return false, nil
	}
	return s.event(data, false)
}

// field takes a line that is no data: a comment, an event's name, or a
// blank line, which ends an event. An event named error holds an error,
// whatever its data says: some servers name it so rather than put an error
// in a chunk; llama.cpp's server before 2025-09 sent it in a field of that
// name, which SSE would have ignored.
func (s *streamReader) field(field []byte) (end bool, err error) {
	if name, named := bytes.CutPrefix(field, []byte("event:")); named {
		s.errorEvent = string(bytes.TrimSpace(name)) == "error"
	} else if data, ok := bytes.CutPrefix(field, []byte("error:")); ok {
		return true, errorInStream(errorEventSays(data))
	} else if len(field) == 0 {
		if end, err := s.eventEnds(); end {
			return true, err
		}
		s.errorEvent = false
	}
	return false, nil
}

// eventEnds takes the data of a spread event at its end. An event whose
// data is empty is none, as in SSE.
func (s *streamReader) eventEnds() (end bool, err error) {
	data := bytes.TrimSpace(s.spread)
	s.spread = nil
	if len(data) == 0 {
		return false, nil
	}
	return s.event(data, true)
}

// event takes an event's data: spreads says whether it is the whole data of
// a spread event, or else its first line, which may begin one. end says the
// stream ends with it, whole (err nil) or not.
func (s *streamReader) event(data []byte, spreads bool) (end bool, err error) {
	if s.errorEvent {
		return true, errorInStream(errorEventSays(data))
	}
	if bytes.Equal(data, doneMarker) {
		return true, nil
	}
	if len(data) == 0 {
		return false, nil // no event, or a blank first line of one spread over lines
	}
	if data[0] != '{' {
		// No chunk, which is an object: a keep-alive sent as data, a
		// comment wrapped (Vertex AI's proxy for partner models sends
		// "data: : keepalive") or a word ("data: ping", as Express's
		// documentation sends one), or a line a proxy put in. It is
		// skipped as a keep-alive, not output; a stream that then
		// ends without its finish says what it was.
		s.noChunk = forQuote(data)
		return false, nil
	}
	var chunk streamChunk[plainText, []annotation]
	err = json.Unmarshal(data, &chunk)
	if mistyped(err) {
		var lenient streamChunk[parts, evidence[annotation]]
		if err = json.Unmarshal(data, &lenient); err == nil {
			chunk = lenient.plain()
		}
	}
	if err != nil {
		if syntax := (*json.SyntaxError)(nil); !spreads && errors.As(err, &syntax) {
			s.spread = append(make([]byte, 0, 2*len(data)), data...)
			return false, nil
		}
		return true, fmt.Errorf("malformed stream chunk: %w", err)
	}
	if chunk.Error.present() {
		return true, errorInStream(chunk.Error.what())
	}
	if chunk.Usage != nil {
		chunk.Usage.report(&s.res)
	}
	for _, choice := range chunk.Choices {
		s.finished = s.finished || choice.FinishReason.ends()
		var d upstream.Delta
		if choice.Delta.Content != nil {
			d.Content = string(*choice.Delta.Content)
		}
		d.Sources = sources("", choice.Delta.Annotations)
		if room := s.maxThinking - s.thoughts.Len(); room > 0 {
			s.thoughts.WriteString(upstream.Cut(choice.Delta.reasoning(), room))
		}
		if err := s.take(d); err != nil {
			return true, emitError{err}
		}
		if choice.FinishReason.erred() {
			return true, errorInStream(finishedInErrorSays) // an error beside it was read above
		}
	}
	if n := chunk.count(); n > s.searched {
		// Search results beside the choices, which an upstream may
		// repeat, grown, in every event: those not yet taken.
		d := upstream.Delta{Sources: chunk.from(s.searched)}
		s.searched = n
		if err := s.take(d); err != nil {
			return true, emitError{err}
		}
	}
	return false, nil
}

// take keeps and emits a delta with content or sources.
func (s *streamReader) take(d upstream.Delta) error {
	if d.Content == "" && len(d.Sources) == 0 {
		return nil // role-only or empty delta
	}
	s.content.WriteString(d.Content)
	if len(s.res.Sources) < upstream.MaxSources { // the guard keeps no more
		s.res.Sources = append(s.res.Sources, d.Sources...)
	}
	return s.emit(d)
}
