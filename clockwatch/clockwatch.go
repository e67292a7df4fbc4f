// Package clockwatch watches this replica's clock against the database's.
// The bounds that hold money read the database's clock (quota and batch item
// leases), but rate-limit windows, the UTC day a request is charged to and a
// batch's window read the replica's: a replica whose clock is off counts
// into a neighbouring minute or day. The offset is exported as a metric and
// logged past a tolerance, for the operator to mend (NTP).
package clockwatch

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"github.com/rungworks/gateway/metrics"
)

// Defaults of a Config.
const (
	// DefaultInterval is how often the clocks are compared.
	DefaultInterval = time.Minute
	// DefaultTolerance is the offset past which a warning is logged.
	DefaultTolerance = time.Second
)

// Store reads the database's clock.
type Store interface {
	DatabaseTime(ctx context.Context) (time.Time, error)
}

// Config configures Run; zero fields take the defaults.
type Config struct {
	Interval  time.Duration
	Tolerance time.Duration
	// Local is this replica's clock; nil means time.Now.
	Local   func() time.Time
	Logger  *slog.Logger
	Metrics *metrics.Metrics
}

// readTimeout bounds one reading of the database's clock.
const readTimeout = 5 * time.Second

// Offset is how far the database's clock is ahead of local: the database's
// time less local's halfway through the round trip that read it, which it
// returns too (the offset is exact to half of it).
func Offset(ctx context.Context, st Store, local func() time.Time) (offset, roundTrip time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	before := local()
	db, err := st.DatabaseTime(ctx)
	after := local()
	if err != nil {
		return 0, 0, err
	}
	roundTrip = after.Sub(before)
	return db.Sub(before.Add(roundTrip / 2)), roundTrip, nil
}

// Run compares the clocks at once and then every Interval until ctx ends,
// records the offset, and logs a warning while it is past Tolerance. A
// comparison that fails (the database may be away), or whose round trip took
// longer than Tolerance (too inexact to tell), is skipped.
func Run(ctx context.Context, st Store, cfg Config) {
	cfg.Interval = cmp.Or(cfg.Interval, DefaultInterval)
	cfg.Tolerance = cmp.Or(cfg.Tolerance, DefaultTolerance)
	if cfg.Local == nil {
		cfg.Local = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	for {
		if offset, roundTrip, err := Offset(ctx, st, cfg.Local); err == nil && roundTrip <= cfg.Tolerance {
			cfg.Metrics.ClockOffset(offset)
			if offset > cfg.Tolerance || offset < -cfg.Tolerance {
				cfg.Logger.Warn("this replica's clock is off from the database's; rate-limit windows and the UTC day a request is charged to follow it (set the clock right, e.g. with NTP)",
					"offset_seconds", offset.Seconds(), "tolerance_seconds", cfg.Tolerance.Seconds())
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
