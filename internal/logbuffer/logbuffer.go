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
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultDelay is how long a line waits at most for others to join its write.
const DefaultDelay = 10 * time.Millisecond

// maxBuffered is how many bytes may wait before they go out without waiting
// for the delay.
const maxBuffered = 64 << 10

// maxSpare is the largest buffer kept for the next lines once written: a
// flood's is, a stall's backlog is not.
const maxSpare = 1 << 20

// maxWaiting is how many bytes may wait while the output blocks; the lines
// that come beyond it are dropped (and counted): a stalled reader holds at
// most twice this much of the process's memory (the second half for the
// lines written through Kept), and the process serves on.
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

	mu    sync.Mutex
	buf   []byte
	timer *time.Timer
	// written is closed when the write last begun ends.
	written chan struct{}

	// writing says a write to out is under way: set under mu when one
	// begins, cleared by the write when it ends, which takes no lock (so
	// that the writers of lines, however many, never starve it).
	writing atomic.Bool
	// spare holds the buffer of the last write, emptied, for the next lines.
	spare   chan []byte
	dropped atomic.Uint64
}

// New returns a Writer to out that holds lines for delay at most.
func New(out io.Writer, delay time.Duration) *Writer {
	w := &Writer{out: out, delay: delay, limit: maxWaiting, spare: make(chan []byte, 1)}
	w.timer = time.AfterFunc(time.Hour, w.flushWaiting)
	w.timer.Stop()
	return w
}

// Write keeps p to be written with the others of its delay, or drops it when
// the lines waiting already fill the limit (the output blocked). It does not
// fail and does not wait for the output.
func (w *Writer) Write(p []byte) (int, error) {
	return w.add(p, w.limit)
}

// Kept returns a writer into w for the few lines that must outlast a stall
// (errors, such as those naming a request whose usage may be missing): its
// lines are dropped only once twice the limit waits, so that a stalled
// output drops the others first. They go out in their order among the
// others.
func (w *Writer) Kept() io.Writer {
	return kept{w}
}

type kept struct{ w *Writer }

func (k kept) Write(p []byte) (int, error) {
	return k.w.add(p, 2*k.w.limit)
}

// add keeps p, unless limit bytes would then wait.
func (w *Writer) add(p []byte, limit int) (int, error) {
	w.mu.Lock()
	if len(w.buf)+len(p) > limit {
		w.mu.Unlock()
		w.dropped.Add(uint64(bytes.Count(p, []byte{'\n'})))
		return len(p), nil
	}
	if len(w.buf) == 0 {
		w.timer.Reset(w.delay)
	}
	w.buf = append(w.buf, p...)
	if len(w.buf) < maxBuffered || w.writing.Load() {
		w.mu.Unlock()
		return len(p), nil
	}
	full, done := w.takeLocked()
	w.mu.Unlock()
	// The write goes now, on a goroutine of its own that this one lets run
	// first (writers of lines on every core would otherwise keep it waiting
	// for a turn while the buffer grows); a write that blocks blocks that
	// goroutine alone.
	go func() { _ = w.write(full, done) }()
	runtime.Gosched()
	return len(p), nil
}

// Dropped is how many lines were dropped so far, the output blocked with the
// limit waiting.
func (w *Writer) Dropped() uint64 {
	return w.dropped.Load()
}

// flushWaiting writes what waits, unless a write is under way: the timer,
// which that write sets again when it ends, comes back for the rest.
func (w *Writer) flushWaiting() {
	w.mu.Lock()
	if w.writing.Load() || len(w.buf) == 0 {
		w.mu.Unlock()
		return
	}
	p, done := w.takeLocked()
	w.mu.Unlock()
	_ = w.write(p, done)
}

// takeLocked takes what waits for a write, which the caller makes with write
// and done, when no write is under way.
func (w *Writer) takeLocked() (p []byte, done chan struct{}) {
	p = w.buf
	select {
	case spare := <-w.spare:
		w.buf = spare
	default:
		w.buf = nil
	}
	w.writing.Store(true)
	w.written = make(chan struct{})
	return p, w.written
}

// write writes p, taken by takeLocked, and ends the write: its buffer kept
// for the next lines, unless a stall's backlog made it large, and the timer
// set for the lines that came meanwhile.
func (w *Writer) write(p []byte, done chan struct{}) error {
	_, err := w.out.Write(p)
	if cap(p) <= maxSpare {
		select {
		case w.spare <- p[:0]:
		default:
		}
	}
	w.writing.Store(false)
	close(done)
	w.timer.Reset(w.delay)
	return err
}

// Flush writes what waits now, after the write under way if there is one,
// and returns the output's error.
func (w *Writer) Flush() error {
	for {
		w.mu.Lock()
		if w.writing.Load() {
			done := w.written
			w.mu.Unlock()
			<-done
			continue
		}
		if len(w.buf) == 0 {
			w.mu.Unlock()
			return nil
		}
		p, done := w.takeLocked()
		w.mu.Unlock()
		return w.write(p, done)
	}
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
