package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Event names of a streamed response.
const (
	eventDelta     = "response.output_text.delta"
	eventCompleted = "response.completed"
	eventError     = "response.error"
)

// sseWriter writes server-sent events: `event: NAME`, one `data: JSON` line and
// a blank line, flushed per event. While nothing is written for keepalive, it
// writes a `:` comment line. A write the client has not taken after
// writeTimeout (at the keep-alive beat that finds it so) fails: a client that
// reads nothing, its connection alive (its receive window shut), is gone, not
// waited for. It is safe for the keep-alive timer and the stream to write
// concurrently; after the first write error every write fails.
type sseWriter struct {
	mu sync.Mutex
	// out is where the bytes go: the response, then, once the stream is
	// detached, its connection (set under mu, by setOutLocked).
	out *watchedSink
	// writing is out while a write waits on it, for the keep-alive timer to
	// watch (ping).
	writing      atomic.Pointer[watchedSink]
	keepalive    time.Duration
	writeTimeout time.Duration
	// stream is the request's HTTP/2 stream (http2Stream), nil over
	// HTTP/1.x (see Close).
	stream context.Context
	timer  *time.Timer
	err    error
	closed bool
	buf    bytes.Buffer
	// size counts the bytes written, keep-alives included.
	size int64
}

// sink is where a stream's bytes go: written, then flushed to the client,
// by a deadline when one is set.
type sink interface {
	Write(p []byte) (int, error)
	Flush() error
	SetWriteDeadline(t time.Time) error
}

// watchedSink is a stream's sink with when its write in progress began.
type watchedSink struct {
	sink
	since atomic.Int64 // Unix nanoseconds
}

// responseSink writes through net/http's response writer.
type responseSink struct {
	http.ResponseWriter
	rc *http.ResponseController
}

// Flush implements sink.
func (r responseSink) Flush() error { return r.rc.Flush() }

// SetWriteDeadline implements sink.
func (r responseSink) SetWriteDeadline(t time.Time) error { return r.rc.SetWriteDeadline(t) }

// startSSE writes the head of a stream through w (status 200 and the headers
// already set on w), flushes it, and starts the keep-alive timer, which also
// gives up on a write the client has not taken after writeTimeout (zero: no
// bound). stream is the request's HTTP/2 stream, if it has one
// (http2Stream).
func startSSE(w http.ResponseWriter, stream context.Context, keepalive, writeTimeout time.Duration) *sseWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	// no-transform (RFC 9111) asks proxies not to alter the body, so not to
	// compress it, holding events to fill a compressor's window;
	// X-Accel-Buffering asks nginx-like ones not to buffer it.
	h.Set("Cache-Control", "no-cache, no-transform")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &sseWriter{keepalive: keepalive, writeTimeout: writeTimeout, stream: stream}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.setOutLocked(responseSink{w, http.NewResponseController(w)})
	if keepalive > 0 {
		// Under the lock: the first ping may fire before AfterFunc returns.
		s.timer = time.AfterFunc(keepalive, s.ping)
	}
	s.err = s.sendLocked(nil)
	return s
}

// setOutLocked makes out where the bytes go from now on, watched anew (a beat
// that found the sink before still holds that one).
func (s *sseWriter) setOutLocked(out sink) { s.out = &watchedSink{sink: out} }

// Event writes one event and flushes it.
func (s *sseWriter) Event(name string, data any) error {
	payload, err := json.Marshal(data)
	if err != nil {
		return fmt.Errorf("error encoding %s event: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.buf.Reset()
	s.buf.WriteString("event: ")
	s.buf.WriteString(name)
	s.buf.WriteString("\ndata: ")
	s.buf.Write(payload)
	s.buf.WriteString("\n\n")
	return s.writeLocked(s.buf.Bytes())
}

// ping is the keep-alive beat: it writes a keep-alive line, or, while a
// write waits for the client, watches it.
func (s *sseWriter) ping() {
	if w := s.writing.Load(); w != nil && s.writeTimeout > 0 {
		s.watch(w)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.err != nil {
		return
	}
	_ = s.writeLocked([]byte(": keep-alive\n\n"))
}

// watch gives up on the write waiting on w once it has waited writeTimeout:
// a deadline of now fails it. Until then the beat comes back when it will
// have. (The write it finds may have ended meanwhile; at worst the deadline
// then fails the next write, of a client that took nothing for about as
// long.)
func (s *sseWriter) watch(w *watchedSink) {
	waited := time.Duration(time.Now().UnixNano() - w.since.Load())
	if waited >= s.writeTimeout {
		_ = w.SetWriteDeadline(time.Now())
		return
	}
	s.timer.Reset(s.writeTimeout - waited)
}

func (s *sseWriter) writeLocked(b []byte) error {
	if s.err != nil {
		return s.err
	}
	s.err = s.sendLocked(b)
	return s.err
}

// sendLocked writes b, if any, and flushes, watched: the keep-alive timer is
// set going first (as a beat of silence starts now), so that a write the
// client does not take is found waiting.
func (s *sseWriter) sendLocked(b []byte) error {
	if s.timer != nil {
		s.timer.Reset(s.keepalive)
	}
	out := s.out
	out.since.Store(time.Now().UnixNano())
	s.writing.Store(out)
	defer s.writing.Store(nil)
	if len(b) > 0 {
		n, err := out.Write(b)
		s.size += int64(n)
		if err != nil {
			return err
		}
	}
	return out.Flush()
}

// failed says whether a write failed: the client left, or took nothing for
// a write's timeout.
func (s *sseWriter) failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err != nil
}

// Close stops the keep-alive timer and bounds what is written after it, the
// response's end (a detached stream's last chunk, or net/http's), by a
// write's timeout; after a write that failed, the deadline that failed it
// stays; an HTTP/2 stream its client closed gets none (closedStream).
// Nothing is written through s afterwards.
func (s *sseWriter) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.timer != nil {
		s.timer.Stop()
	}
	if s.writeTimeout > 0 && s.err == nil && !closedStream(s.stream) {
		_ = s.out.SetWriteDeadline(time.Now().Add(s.writeTimeout))
	}
}
