// Package logsample keeps a flood of like log lines to a few and a count.
// While the database is away every request refused logs an error, and each
// maintenance job logs its failure at each turn: at 1,000 requests a second
// that is 1,000 lines a second that all say the same. A Handler writes the
// first lines of each kind in a window, counts the rest, and writes the last
// of them with that count when the window ends.
package logsample

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Window is how long the lines of one kind are counted together.
const Window = 10 * time.Second

// Burst is how many lines of one kind a window writes before it counts them.
const Burst = 10

// SuppressedKey is the attribute of a window's last line left out: how many
// lines of its kind, it included, the window left out.
const SuppressedKey = "suppressed"

// Handler is a slog.Handler that samples the records at WARN and above by
// their level and message: in each Window, from the first record of a kind,
// the first Burst records are written and the rest left out; at the end of
// the window the last of those left out is written with SuppressedKey, the
// number left out. Records below WARN (the access log's one a request among
// them) and records logged with a context from Each are all written. Call
// Flush before the process exits to write the counts of windows still open.
type Handler struct {
	inner slog.Handler
	kinds *kinds
}

// New returns a Handler that writes what it keeps to inner.
func New(inner slog.Handler) *Handler {
	return &Handler{inner: inner, kinds: &kinds{tally: map[kind]*tally{}}}
}

type eachKey struct{}

// Each returns ctx marked so that every record logged with it is written, as
// each line naming a request whose usage may be missing must be.
func Each(ctx context.Context) context.Context {
	return context.WithValue(ctx, eachKey{}, true)
}

// Enabled is inner's.
func (h *Handler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

// WithAttrs returns a Handler over inner's with attrs that samples with h:
// a kind is its level and message, whatever the logger's attributes.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Handler{inner: h.inner.WithAttrs(attrs), kinds: h.kinds}
}

// WithGroup returns a Handler over inner's with the group that samples with
// h (a count left out is written in the group, as the record's attributes).
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{inner: h.inner.WithGroup(name), kinds: h.kinds}
}

// Handle writes r, or counts it as left out of its window.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn || ctx.Value(eachKey{}) != nil {
		return h.inner.Handle(ctx, r)
	}
	write, ended := h.kinds.admit(kind{r.Level, r.Message}, h, r)
	ended.write()
	if !write {
		return nil
	}
	return h.inner.Handle(ctx, r)
}

// Flush writes now the counts of the windows that have left records out.
func (h *Handler) Flush() {
	h.kinds.mu.Lock()
	var ended []summary
	for _, t := range h.kinds.tally {
		if s := t.take(); s.n > 0 {
			ended = append(ended, s)
		}
	}
	h.kinds.mu.Unlock()
	for _, s := range ended {
		s.write()
	}
}

// kind is what makes records alike.
type kind struct {
	level slog.Level
	msg   string
}

// kinds is the state a Handler and those derived from it share.
type kinds struct {
	mu    sync.Mutex
	tally map[kind]*tally
}

// tally is one kind's window.
type tally struct {
	end     time.Time // when the window ends
	written int
	left    summary // the last record left out, and how many were
	timer   *time.Timer
	gen     int // which window the timer is for
}

// summary is the last record a window left out and how many it left out.
type summary struct {
	h *Handler
	r slog.Record
	n int
}

// write writes the record with its count, if any was left out.
func (s summary) write() {
	if s.n == 0 {
		return
	}
	s.r.AddAttrs(slog.Int(SuppressedKey, s.n))
	_ = s.h.inner.Handle(context.Background(), s.r)
}

// take returns what t's window left out and forgets it.
func (t *tally) take() summary {
	s := t.left
	t.left = summary{}
	if t.timer != nil {
		t.timer.Stop()
		t.timer = nil
	}
	return s
}

// admit says whether r, of kind k logged through h, is written, and returns
// the summary of k's window that ended before it (written first).
func (ks *kinds) admit(k kind, h *Handler, r slog.Record) (write bool, ended summary) {
	now := time.Now()
	ks.mu.Lock()
	defer ks.mu.Unlock()
	t := ks.tally[k]
	if t == nil {
		t = &tally{}
		ks.tally[k] = t
	}
	if !now.Before(t.end) {
		ended = t.take()
		t.end, t.written = now.Add(Window), 0
		t.gen++
	}
	if t.written < Burst {
		t.written++
		return true, ended
	}
	t.left = summary{h: h, r: r.Clone(), n: t.left.n + 1}
	if t.timer == nil {
		gen := t.gen
		t.timer = time.AfterFunc(t.end.Sub(now), func() { ks.close(k, gen) })
	}
	return false, ended
}

// close writes what window gen of kind k left out, as it ends.
func (ks *kinds) close(k kind, gen int) {
	ks.mu.Lock()
	t := ks.tally[k]
	if t.gen != gen {
		ks.mu.Unlock()
		return
	}
	t.timer = nil // fired: nothing to stop
	s := t.take()
	ks.mu.Unlock()
	s.write()
}
