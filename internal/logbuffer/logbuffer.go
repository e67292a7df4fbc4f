// Package logbuffer writes a busy server's log lines in groups: the lines made
// within a few milliseconds of each other go out in one write, instead of a
// system call for each (one a request, for the access log). The writes happen
// off the callers' goroutines, so an output that blocks (a log reader that
// stalls) never holds up the requests that log.
package logbuffer

import (
	"bytes"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultDelay is how long a line waits at most for others to join its write.
const DefaultDelay = 10 * time.Millisecond

// maxBuffered is how many bytes may wait before they go out without waiting
// for the delay.
const maxBuffered = 64 << 10

// maxWaiting is how many bytes may wait while the output blocks; the lines
// that come beyond it are dropped (and counted): a stalled reader holds at
// most this much of the process's memory, and the process serves on.
const maxWaiting = 8 << 20

// Writer is an io.Writer that holds what it is given for at most its delay,
// then writes it to its output in one call, in the order it was given, on a
// goroutine of its own. Lines are whole as long as each Write is one (as
// log/slog's handlers do). Call Close before the process exits; a process
// killed loses what waited.
type Writer struct {
	out   io.Writer
	delay time.Duration
	limit int // maxWaiting; tests lower it

	mu      sync.Mutex
	buf     []byte
	spare   []byte // the buffer of the last write, kept for the next lines
	timer   *time.Timer
	writing bool       // a write to out is under way
	written *sync.Cond // signalled when a write ends
	err     error      // the last write's

	dropped atomic.Uint64
}

// New returns a Writer to out that holds lines for delay at most.
func New(out io.Writer, delay time.Duration) *Writer {
	w := &Writer{out: out, delay: delay, limit: maxWaiting}
	w.written = sync.NewCond(&w.mu)
	w.timer = time.AfterFunc(time.Hour, w.flushWaiting)
	w.timer.Stop()
	return w
}

// Write keeps p to be written with the others of its delay, or drops it when
// the lines waiting already fill the limit (the output blocked). It does not
// fail and does not wait for the output.
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf)+len(p) > w.limit {
		w.dropped.Add(uint64(bytes.Count(p, []byte{'\n'})))
		return len(p), nil
	}
	if len(w.buf) == 0 && !w.writing {
		w.timer.Reset(w.delay)
	}
	w.buf = append(w.buf, p...)
	if len(w.buf) >= maxBuffered && !w.writing {
		w.timer.Reset(0)
	}
	return len(p), nil
}

// Dropped is how many lines were dropped so far, the output blocked with the
// limit waiting.
func (w *Writer) Dropped() uint64 {
	return w.dropped.Load()
}

// flushWaiting writes what waits, unless a write is under way: that one
// writes the rest when it ends.
func (w *Writer) flushWaiting() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.writing {
		w.writeLocked()
	}
}

// writeLocked writes what waits, the lock released meanwhile, and schedules
// what came in during the write. Called with no write under way.
func (w *Writer) writeLocked() {
	if len(w.buf) == 0 {
		return
	}
	p := w.buf
	w.buf, w.spare = w.spare[:0], nil
	w.writing = true
	w.mu.Unlock()
	_, err := w.out.Write(p)
	w.mu.Lock()
	w.writing, w.err = false, err
	if cap(p) <= 2*maxBuffered { // a stall's backlog is not kept
		w.spare = p[:0]
	}
	w.written.Broadcast()
	if len(w.buf) > 0 {
		w.timer.Reset(w.delay)
	}
}

// Flush writes what waits now, after the write under way if there is one,
// and returns the output's error.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.writing {
		w.written.Wait()
	}
	w.err = nil
	w.writeLocked()
	return w.err
}

// Close flushes what waits, giving up after wait when the output blocks (its
// reader stalled): the process may then exit without the lines that waited.
func (w *Writer) Close(wait time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- w.Flush() }()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case err := <-done:
		return err
	case <-timer.C:
		return errStalled
	}
}

// errStalled is Close's error when its output did not take the lines in time.
var errStalled = errors.New("log output stalled: the lines waiting were not written")
