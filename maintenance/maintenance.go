// Package maintenance runs the gateway's periodic housekeeping in every
// replica: releasing reservations whose replica died, and removing rate-limit
// windows and evidence that are past use. Every job is a single statement that
// is safe to run on several replicas at once (SKIP LOCKED or idempotent deletes),
// so no leader is needed.
package maintenance

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"
)

// Store is what the jobs need.
type Store interface {
	ReleaseExpiredReservations(ctx context.Context, maxRows int32) (int64, error)
	DeleteOldRateWindows(ctx context.Context, before time.Time) (int64, error)
	DeleteExpiredEvidence(ctx context.Context, maxRows int32) (int64, error)
}

// Defaults of the runner.
const (
	DefaultInterval = 30 * time.Second
	// batchRows bounds the rows one job touches per run.
	batchRows = 1000
	// rateWindowKeep is how long rate-limit windows are kept: the sliding window
	// reads the current and the previous minute.
	rateWindowKeep = 2 * time.Minute
)

// Runner runs the jobs every Interval (with jitter, so replicas spread out).
type Runner struct {
	Store    Store
	Interval time.Duration
	Logger   *slog.Logger
}

// Run runs the jobs until ctx ends.
func (r *Runner) Run(ctx context.Context) {
	interval := r.Interval
	if interval <= 0 {
		interval = DefaultInterval
	}
	for {
		r.RunOnce(ctx)
		jitter := time.Duration(rand.Int64N(int64(interval) / 5))
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval + jitter):
		}
	}
}

// RunOnce runs every job once, logging failures.
func (r *Runner) RunOnce(ctx context.Context) {
	jobs := []struct {
		name string
		run  func() (int64, error)
	}{
		{"release expired reservations", func() (int64, error) { return r.Store.ReleaseExpiredReservations(ctx, batchRows) }},
		{"delete old rate windows", func() (int64, error) { return r.Store.DeleteOldRateWindows(ctx, time.Now().Add(-rateWindowKeep)) }},
		{"delete expired evidence", func() (int64, error) { return r.Store.DeleteExpiredEvidence(ctx, batchRows) }},
	}
	for _, job := range jobs {
		n, err := job.run()
		switch {
		case err != nil && ctx.Err() == nil:
			r.Logger.Error("maintenance job failed", "job", job.name, "error", err)
		case n > 0:
			r.Logger.Info("maintenance job done", "job", job.name, "rows", n)
		}
	}
}
