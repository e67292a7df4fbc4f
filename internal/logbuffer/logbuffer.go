// Package logbuffer writes a busy server's log lines in groups: the lines made
// within a few milliseconds of each other go out in one write, instead of a
// system call for each (one a request, for the access log).
package logbuffer

import (
	"io"
	"sync"
	"time"
)

// DefaultDelay is how long a line waits at most for others to join its write.
const DefaultDelay = 10 * time.Millisecond

// maxBuffered is how many bytes may wait: a write that reaches it goes out at
// once, on the writer's goroutine.
const maxBuffered = 64 << 10

// Writer is an io.Writer that holds what it is given for at most its delay,
// then writes it to its output in one call, in the order it was given. Lines
// are whole as long as each Write is one (as log/slog's handlers do). Call
// Flush before the process exits; a process killed loses what waited.
type Writer struct {
	out   io.Writer
	delay time.Duration

	mu    sync.Mutex
	buf   []byte
	timer *time.Timer
}

// New returns a Writer to out that holds lines for delay at most.
func New(out io.Writer, delay time.Duration) *Writer {
	w := &Writer{out: out, delay: delay}
	w.timer = time.AfterFunc(time.Hour, func() { _ = w.Flush() })
	w.timer.Stop()
	return w
}

// Write keeps p to be written with the others of its delay. It does not fail:
// an error of the output is Flush's.
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) == 0 {
		w.timer.Reset(w.delay)
	}
	w.buf = append(w.buf, p...)
	if len(w.buf) >= maxBuffered {
		_ = w.flushLocked()
	}
	return len(p), nil
}

// Flush writes what waits now.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.flushLocked()
}

func (w *Writer) flushLocked() error {
	if len(w.buf) == 0 {
		return nil
	}
	_, err := w.out.Write(w.buf)
	w.buf = w.buf[:0]
	return err
}
