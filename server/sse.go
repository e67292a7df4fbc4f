package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
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
// writes a `:` comment line. It is safe for the keep-alive timer and the stream
// to write concurrently; after the first write error every write fails.
type sseWriter struct {
	mu sync.Mutex
	// out is where the bytes go: the response, then, once the stream is
	// detached, its connection (swapped under mu).
	out       sink
	keepalive time.Duration
	timer     *time.Timer
	err       error
	closed    bool
	buf       bytes.Buffer
	// size counts the bytes written, keep-alives included.
	size int64
}

// sink is where a stream's bytes go: written, then flushed to the client.
type sink interface {
	Write(p []byte) (int, error)
	Flush() error
}

// responseSink writes through net/http's response writer.
type responseSink struct {
	http.ResponseWriter
	rc *http.ResponseController
}

// Flush implements sink.
func (r responseSink) Flush() error { return r.rc.Flush() }

// startSSE writes the head of a stream through w (status 200 and the headers
// already set on w), flushes it, and starts the keep-alive timer.
func startSSE(w http.ResponseWriter, keepalive time.Duration) *sseWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // no buffering in nginx-like proxies
	w.WriteHeader(http.StatusOK)
	s := &sseWriter{out: responseSink{w, http.NewResponseController(w)}, keepalive: keepalive}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.err = s.out.Flush()
	if keepalive > 0 {
		// Under the lock: the first ping may fire before AfterFunc returns.
		s.timer = time.AfterFunc(keepalive, s.ping)
	}
	return s
}

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

func (s *sseWriter) ping() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.err != nil {
		return
	}
	_ = s.writeLocked([]byte(": keep-alive\n\n"))
}

func (s *sseWriter) writeLocked(b []byte) error {
	if s.err != nil {
		return s.err
	}
	n, err := s.out.Write(b)
	s.size += int64(n)
	if err != nil {
		s.err = err
		return err
	}
	if err := s.out.Flush(); err != nil {
		s.err = err
		return err
	}
	if s.timer != nil && !s.closed {
		s.timer.Reset(s.keepalive)
	}
	return nil
}

// Close stops the keep-alive timer; nothing is written afterwards.
func (s *sseWriter) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.timer != nil {
		s.timer.Stop()
	}
}
