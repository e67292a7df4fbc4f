// Package logsplit sends a logger's records to one of two handlers by their
// level, so that the records that matter most can take a path of their own
// (errors kept where other lines would be dropped, say).
package logsplit

import (
	"context"
	"log/slog"
)

// Handler sends the records at or above its level to high, the others to
// low.
type Handler struct {
	level     slog.Level
	low, high slog.Handler
}

// New returns a Handler sending records at level or above to high, and the
// records below it to low.
func New(level slog.Level, low, high slog.Handler) *Handler {
	return &Handler{level: level, low: low, high: high}
}

// Enabled reports whether the handler that would take a record at level
// wants it.
func (h *Handler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.pick(level).Enabled(ctx, level)
}

// Handle passes r to the handler of its level.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	return h.pick(r.Level).Handle(ctx, r)
}

// WithAttrs returns a Handler whose two handlers both have attrs.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Handler{level: h.level, low: h.low.WithAttrs(attrs), high: h.high.WithAttrs(attrs)}
}

// WithGroup returns a Handler whose two handlers both open the group name.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{level: h.level, low: h.low.WithGroup(name), high: h.high.WithGroup(name)}
}

func (h *Handler) pick(level slog.Level) slog.Handler {
	if level >= h.level {
		return h.high
	}
	return h.low
}
