// Package fakeupstream is an OpenAI-compatible Chat Completions server that
// tests control: it answers, refuses, fails or stalls on demand, and records
// every prompt it was sent.
package fakeupstream

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"
)

// Mode is how the server answers.
type Mode int

// The modes.
const (
	// OK answers with a completion.
	OK Mode = iota
	// Down answers 503.
	Down
	// Reject answers 400 with an OpenAI error body.
	Reject
)

// Call is one chat completion request the server received.
type Call struct {
	Model               string
	System              string
	Prompt              string
	MaxCompletionTokens uint64
	// MaxTokens is the older field of the output limit, sent instead of
	// max_completion_tokens to servers that know only it.
	MaxTokens uint64
	// Query is the call's URL query, as sent.
	Query string
	// StreamOptions says the call carried stream_options.
	StreamOptions bool
	// Header is the call's header: its key (Authorization, or the header
	// named for it), hints (X-Gateway-Hints), trace context (Traceparent).
	Header http.Header
	// At is when the call arrived.
	At time.Time
	// Refused says the call was answered 503 or 429, which tells the
	// caller that it was not processed.
	Refused bool
}

// Server is the fake upstream.
type Server struct {
	*httptest.Server

	mu         sync.Mutex
	mode       Mode
	status     int
	delay      time.Duration
	streams    streamOptions // how streams are sent; withUsage is the call's
	whole      bool
	always     bool
	mislabel   bool
	hostile    map[string]Hostile
	slow       map[string]time.Duration
	headers    http.Header
	calls      []Call
	unrecorded bool
	http2Calls int
	inFlight   int
	peak       int
	conns      int
	open       int
}

// set stores v in field, one of the server's settings, under its lock.
func set[T any](s *Server, field *T, v T) {
	s.mu.Lock()
	defer s.mu.Unlock()
	*field = v
}

// SetSlow makes every call whose prompt contains marker wait d before it
// answers (on top of SetDelay).
func (s *Server) SetSlow(marker string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.slow == nil {
		s.slow = map[string]time.Duration{}
	}
	s.slow[marker] = d
}

// Hostile is a reply of the upstream's own to some prompts, most of it one
// an upstream should never send: text the gateway cannot store as is,
// counts no tokenizer would give.
type Hostile struct {
	// Content replaces the reply's text.
	Content string
	// Reasoning, when set, is thinking sent before the text, under both the
	// names servers use (reasoning_content and reasoning, as servers between
	// the two send it): a delta of its own in a stream.
	Reasoning string
	// SourceTitle replaces the citation's title.
	SourceTitle string
	// PromptTokens and CompletionTokens replace the reported usage.
	PromptTokens, CompletionTokens uint64
	// Repeat, when above 1, sends Content that many times: repeated in a
	// reply, a delta each in a stream.
	Repeat int
	// Citations, when set, replaces the one citation with that many, each
	// of another URL and, in a reply, citing the whole text.
	Citations int
	// Status, when set, answers the call with this error status instead
	// (a prompt the upstream chokes on).
	Status int
	// KeepAlive, when set, makes a stream send its pieces and then nothing
	// but keep-alive comment lines, one every KeepAlive, until its caller
	// leaves.
	KeepAlive time.Duration
	// UsageInParts makes a stream that asked for usage report it in parts,
	// as a translation of Anthropic's events does: the prompt's count with
	// the first delta, the completion's alone (its prompt count 0) after the
	// finish_reason, then an event of the cached tokens alone.
	UsageInParts bool
}

// pieces is the text h sends, a piece a stream delta.
func (h *Hostile) pieces() []string {
	out := []string{h.Content}
	for len(out) < h.Repeat {
		out = append(out, h.Content)
	}
	return out
}

// citations are the url_citation annotations of a reply whose text is
// content, or of a stream (content empty: they cite no span); h may be nil.
func citations(h *Hostile, content, title string) []any {
	cite := func(url string, end int) any {
		c := map[string]any{"url": url, "title": title}
		if content != "" {
			c["start_index"], c["end_index"] = 0, end
		}
		return map[string]any{"type": "url_citation", "url_citation": c}
	}
	if h == nil || h.Citations == 0 {
		return []any{cite("https://example.org/doc", 4)}
	}
	out := make([]any, h.Citations)
	for i := range out {
		out[i] = cite(fmt.Sprintf("https://example.org/doc/%d", i), len(content))
	}
	return out
}

// SetHostile makes every call whose prompt contains marker answer with h.
func (s *Server) SetHostile(marker string, h Hostile) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hostile == nil {
		s.hostile = map[string]Hostile{}
	}
	s.hostile[marker] = h
}

// SetStatus makes every answer an error reply with this HTTP status (0: none).
func (s *Server) SetStatus(status int) { set(s, &s.status, status) }

// SetReplyHeader sets a header on every reply from now on (an empty value
// removes it).
func (s *Server) SetReplyHeader(name, value string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.headers == nil {
		s.headers = http.Header{}
	}
	if value == "" {
		s.headers.Del(name)
		return
	}
	s.headers.Set(name, value)
}

// New starts a fake upstream; its base URL for GATEWAY_UPSTREAM is BaseURL().
// It speaks HTTP/1.1 and, with prior knowledge, HTTP/2 without TLS (h2c).
func New() *Server {
	s := newServer()
	s.Server.Config.Protocols.SetUnencryptedHTTP2(true)
	s.Server.Start()
	return s
}

// NewTLS starts a fake upstream over HTTPS, speaking HTTP/2 or HTTP/1.1 as
// the client chooses (ALPN), with httptest's certificate (Certificate()),
// which no client trusts unless told to.
func NewTLS() *Server {
	s := newServer()
	s.Server.Config.Protocols.SetHTTP2(true)
	s.Server.EnableHTTP2 = true
	s.Server.StartTLS()
	return s
}

// newServer is a fake upstream not yet started, speaking HTTP/1.1.
func newServer() *Server {
	s := &Server{}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(s.handle))
	s.Server.Config.Protocols = new(http.Protocols)
	s.Server.Config.Protocols.SetHTTP1(true)
	s.Server.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		s.mu.Lock()
		defer s.mu.Unlock()
		switch state {
		case http.StateNew:
			s.conns++
			s.open++
		case http.StateClosed, http.StateHijacked:
			s.open--
		}
	}
	return s
}

// HTTP2Calls is how many of the calls came over HTTP/2.
func (s *Server) HTTP2Calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.http2Calls
}

// Connections is how many connections the server has accepted.
func (s *Server) Connections() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conns
}

// InFlight is how many calls it is answering now.
func (s *Server) InFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inFlight
}

// OpenConnections is how many of its connections are open now.
func (s *Server) OpenConnections() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

// BaseURL is the API root (…/v1).
func (s *Server) BaseURL() string { return s.URL + "/v1" }

// SetMode changes how the server answers from now on.
func (s *Server) SetMode(m Mode) { set(s, &s.mode, m) }

// SetDelay makes every answer wait d first.
func (s *Server) SetDelay(d time.Duration) { set(s, &s.delay, d) }

// SetCitations says whether replies cite a source (an annotation, as a web
// search's reply has), as they do unless told otherwise.
func (s *Server) SetCitations(on bool) { set(s, &s.streams.uncited, !on) }

// SetNoStreaming makes the server answer calls that ask for a stream with
// one JSON completion, as an upstream that does not stream does.
func (s *Server) SetNoStreaming(on bool) { set(s, &s.whole, on) }

// SetAlwaysStreaming makes the server stream its answer to every call,
// asked for whole or not, as upstreams that ignore "stream": false do. A
// stream carries usage only when the call asked for it
// (stream_options.include_usage).
func (s *Server) SetAlwaysStreaming(on bool) { set(s, &s.always, on) }

// SetUnrecorded makes the server keep none of the calls it receives from
// then on (Calls returns those before): a load generator's hundreds of
// thousands of calls, some 800 bytes each with their headers, would grow its
// heap through the run, and the collections of that heap take the cores it
// shares with the processes it measures.
func (s *Server) SetUnrecorded(on bool) { set(s, &s.unrecorded, on) }

// SetMislabelled makes the server label its streams application/json and
// its completions text/event-stream, as some upstreams and proxies do.
func (s *Server) SetMislabelled(on bool) { set(s, &s.mislabel, on) }

// SetNoDone makes the server end its streams without [DONE], after their
// finish_reason (and usage), as some OpenAI-compatible servers do.
func (s *Server) SetNoDone(on bool) { set(s, &s.streams.noDone, on) }

// SetLeftOpen makes the server leave its streams open after their
// finish_reason and usage, without [DONE], sending keep-alive comments until
// the caller leaves, as some OpenAI-compatible servers and proxies do.
func (s *Server) SetLeftOpen(on bool) { set(s, &s.streams.leftOpen, on) }

// SetSpread makes the server spread each stream event's JSON over several
// data: lines, indented, as SSE allows and some servers do.
func (s *Server) SetSpread(on bool) { set(s, &s.streams.spread, on) }

// SetWrappedKeepAlives makes the server send keep-alives as data before each
// stream event: a comment wrapped ("data: : keepalive"), as proxies that
// re-send their upstream's keep-alives do, and a word ("data: ping").
func (s *Server) SetWrappedKeepAlives(on bool) { set(s, &s.streams.wrapped, on) }

// SetChunkDelay makes a stream wait d before each content chunk.
func (s *Server) SetChunkDelay(d time.Duration) { set(s, &s.streams.chunkDelay, d) }

// SetBreakAfter makes a stream drop its connection after n content chunks
// (0: never), without [DONE] or usage.
func (s *Server) SetBreakAfter(n int) { set(s, &s.streams.breakAfter, n) }

// StreamPieces is how a stream splits Reply(prompt) into content chunks.
func StreamPieces(prompt string) []string {
	return strings.SplitAfter(Reply(prompt), " ")
}

// Calls returns the requests received so far, but for those received while
// the server was unrecorded (SetUnrecorded).
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Call(nil), s.calls...)
}

// PeakInFlight returns the most chat completion calls the server has been
// answering at once.
func (s *Server) PeakInFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peak
}

// Reply is the deterministic completion text for a prompt.
func Reply(prompt string) string {
	return "echo: " + prompt
}

// Usage is the deterministic token usage the server reports for a prompt: one
// prompt token per word plus 10, and one completion token per word of the reply.
func Usage(prompt string) (promptTokens, completionTokens uint64) {
	return uint64(len(strings.Fields(prompt))) + 10, uint64(len(strings.Fields(Reply(prompt))))
}

type chatRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxCompletionTokens uint64 `json:"max_completion_tokens"`
	MaxTokens           uint64 `json:"max_tokens"`
	Messages            []struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	} `json:"messages"`
}

func (s *Server) handle(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/chat/completions" {
		http.NotFound(w, r)
		return
	}
	var req chatRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, `{"error":{"message":"bad json"}}`, http.StatusBadRequest)
		return
	}
	call := Call{Model: req.Model, MaxCompletionTokens: req.MaxCompletionTokens, MaxTokens: req.MaxTokens, Query: r.URL.RawQuery, StreamOptions: req.StreamOptions != nil, Header: r.Header.Clone(), At: time.Now()}
	for _, m := range req.Messages {
		switch m.Role {
		case "system":
			call.System = m.Content
		case "user":
			call.Prompt = m.Content
		}
	}
	s.mu.Lock()
	mode, status, delay, opts, whole := s.mode, s.status, s.delay, s.streams, s.whole
	streamed, labels := (req.Stream && !whole) || s.always, [2]string{"application/json", "text/event-stream"}
	if s.mislabel {
		labels[0], labels[1] = labels[1], labels[0]
	}
	for name, values := range s.headers {
		w.Header()[name] = values
	}
	var hostile *Hostile
	for marker, h := range s.hostile {
		if strings.Contains(call.Prompt, marker) {
			hostile = &h
		}
	}
	for marker, d := range s.slow {
		if strings.Contains(call.Prompt, marker) {
			delay += d
		}
	}
	if hostile != nil && hostile.Status != 0 {
		status = hostile.Status
	}
	call.Refused = status == http.StatusServiceUnavailable || status == http.StatusTooManyRequests || status == 0 && mode == Down
	if !s.unrecorded {
		s.calls = append(s.calls, call)
	}
	if r.ProtoMajor == 2 {
		s.http2Calls++
	}
	s.inFlight++
	s.peak = max(s.peak, s.inFlight)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inFlight--
		s.mu.Unlock()
	}()

	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	if status != 0 {
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"error":{"message":"status %d"}}`, status)
		return
	}
	switch mode {
	case Down:
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprint(w, `{"error":{"message":"overloaded"}}`)
		return
	case Reject:
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"error":{"message":"content policy violation"}}`)
		return
	}
	if streamed {
		w.Header().Set("Content-Type", labels[1])
		opts.withUsage = req.StreamOptions != nil && req.StreamOptions.IncludeUsage
		stream(w, r, call.Prompt, opts, hostile)
		return
	}
	w.Header().Set("Content-Type", labels[0])
	content, title := Reply(call.Prompt), "Example doc"
	pt, ct := Usage(call.Prompt)
	if hostile != nil {
		content, title, pt, ct = strings.Join(hostile.pieces(), ""), hostile.SourceTitle, hostile.PromptTokens, hostile.CompletionTokens
	}
	message := map[string]any{"role": "assistant", "content": content}
	if hostile != nil && hostile.Reasoning != "" {
		message["reasoning_content"], message["reasoning"] = hostile.Reasoning, hostile.Reasoning
	}
	if !opts.uncited {
		message["annotations"] = citations(hostile, content, title)
	}
	resp := map[string]any{
		"id":      "chatcmpl-fake",
		"object":  "chat.completion",
		"model":   req.Model,
		"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "message": message}},
		"usage":   map[string]any{"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
	}
	_ = json.NewEncoder(w).Encode(resp)
}

// streamOptions are how a stream is sent.
type streamOptions struct {
	chunkDelay time.Duration
	breakAfter int
	uncited    bool
	withUsage  bool
	noDone     bool
	leftOpen   bool
	spread     bool
	wrapped    bool
}

// stream answers as OpenAI does: a role-only delta, one delta per piece, an
// annotation delta (unless uncited), the finish_reason, a usage chunk
// (withUsage, as asked by stream_options.include_usage), then [DONE] (unless
// noDone or leftOpen; leftOpen then sends keep-alives until the caller
// leaves). Spread events take a data: line for each line of their indented
// JSON; wrapped ones follow a keep-alive wrapped as data.
func stream(w http.ResponseWriter, r *http.Request, prompt string, o streamOptions, hostile *Hostile) {
	flusher := w.(http.Flusher)
	send := func(v any) {
		var b []byte
		if o.spread {
			b, _ = json.MarshalIndent(v, "", "  ")
			b = bytes.ReplaceAll(b, []byte("\n"), []byte("\ndata: "))
		} else {
			b, _ = json.Marshal(v)
		}
		if o.wrapped {
			fmt.Fprint(w, "data: : keepalive\n\ndata: ping\n\n")
		}
		fmt.Fprintf(w, "data: %s\n\n", b)
		flusher.Flush()
	}
	delta := func(d map[string]any) map[string]any {
		return map[string]any{"object": "chat.completion.chunk", "choices": []any{map[string]any{"index": 0, "delta": d}}}
	}
	usageOnly := func(u map[string]any) map[string]any {
		return map[string]any{"object": "chat.completion.chunk", "choices": []any{}, "usage": u}
	}
	pieces, title := StreamPieces(prompt), "Example doc"
	pt, ct := Usage(prompt)
	if hostile != nil {
		pieces, title, pt, ct = hostile.pieces(), hostile.SourceTitle, hostile.PromptTokens, hostile.CompletionTokens
	}
	inParts := hostile != nil && hostile.UsageInParts && o.withUsage
	first := delta(map[string]any{"role": "assistant", "content": ""})
	if inParts {
		first["usage"] = map[string]any{"prompt_tokens": pt, "completion_tokens": 0}
	}
	send(first)
	if hostile != nil && hostile.Reasoning != "" {
		send(delta(map[string]any{"reasoning_content": hostile.Reasoning, "reasoning": hostile.Reasoning}))
	}
	for i, piece := range pieces {
		if o.breakAfter > 0 && i == o.breakAfter {
			panic(http.ErrAbortHandler) // drop the connection mid-stream
		}
		if o.chunkDelay > 0 {
			select {
			case <-time.After(o.chunkDelay):
			case <-r.Context().Done():
				return
			}
		}
		send(delta(map[string]any{"content": piece}))
	}
	if hostile != nil && hostile.KeepAlive > 0 {
		keepAlive(w, r, hostile.KeepAlive)
		return
	}
	if !o.uncited {
		for _, c := range citations(hostile, "", title) {
			send(delta(map[string]any{"annotations": []any{c}}))
		}
	}
	send(map[string]any{"object": "chat.completion.chunk", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "stop"}}})
	switch {
	case inParts:
		send(usageOnly(map[string]any{"prompt_tokens": 0, "completion_tokens": ct}))
		send(usageOnly(map[string]any{"prompt_tokens_details": map[string]any{"cached_tokens": pt / 2}}))
	case o.withUsage:
		send(usageOnly(map[string]any{"prompt_tokens": pt, "completion_tokens": ct}))
	}
	switch {
	case o.leftOpen:
		keepAlive(w, r, 50*time.Millisecond)
	case !o.noDone:
		fmt.Fprint(w, "data: [DONE]\n\n")
		flusher.Flush()
	}
}

// keepAlive sends a keep-alive comment line every beat until r's caller
// leaves.
func keepAlive(w http.ResponseWriter, r *http.Request, beat time.Duration) {
	for {
		select {
		case <-time.After(beat):
			fmt.Fprint(w, ": keep-alive\n\n")
			w.(http.Flusher).Flush()
		case <-r.Context().Done():
			return
		}
	}
}
