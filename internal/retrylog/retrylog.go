// Package retrylog logs the failures of work a loop retries (a listener
// reconnecting, the drainer's claims, a maintenance job) by their runs rather
// than one line an attempt: while the database is away each loop fails every
// second or so, and a replica with no traffic at all wrote four lines a
// second for as long as the outage lasted. A Failure writes the first
// failure of a run (and the second, when its error differs: the first is
// often the loss of a connection, the second why it cannot be made again), a
// reminder with the latest error while it lasts, and a line when the work
// succeeds again. Being few, its lines are all written past a sampling
// handler (logsample.Each): the first failures of every loop that an outage
// meets come together, a dozen lines of one message that a window's burst
// would have cut.
package retrylog

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/rungworks/gateway/internal/logsample"
)

// Remind is how often a run of failures that goes on is logged again.
const Remind = time.Minute

// Failure follows the attempts of one piece of retried work. Its methods may
// be called from any goroutine.
type Failure struct {
	logger *slog.Logger
	level  slog.Level
	failed string
	ended  string
	now    func() time.Time

	mu       sync.Mutex
	since    time.Time // the run's first failure; zero while none
	logged   time.Time // when the run was last logged
	attempts int       // failed attempts in the run
	first    string    // the run's first error
}

// New returns a Failure that logs a run's failures at level with message
// failed, and its end at INFO with message ended.
func New(logger *slog.Logger, level slog.Level, failed, ended string) *Failure {
	return &Failure{logger: logger, level: level, failed: failed, ended: ended, now: time.Now}
}

// Failed records a failed attempt. The first of a run is logged, so is the
// second when its error reads otherwise, and then the latest at most once a
// Remind, with the run's attempts and how long it has lasted; attrs are
// added to the line.
func (f *Failure) Failed(err error, attrs ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.now()
	f.attempts++
	if f.since.IsZero() {
		f.since, f.logged, f.first = now, now, err.Error()
		f.logger.Log(logsample.Each(context.Background()), f.level, f.failed, append(attrs, "error", err)...)
		return
	}
	if now.Sub(f.logged) < Remind && (f.attempts > 2 || err.Error() == f.first) {
		return
	}
	f.logged = now
	f.logger.Log(logsample.Each(context.Background()), f.level, f.failed, append(attrs, "error", err,
		"failing_for", now.Sub(f.since).Round(time.Second).String(), "attempts", f.attempts)...)
}

// Succeeded records a successful attempt, which ends a run of failures: that
// is logged, with how long the run lasted and its attempts.
func (f *Failure) Succeeded(attrs ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.since.IsZero() {
		return
	}
	f.logger.Info(f.ended, append(attrs, "failed_for", f.now().Sub(f.since).Round(time.Millisecond).String(), "attempts", f.attempts)...)
	f.since, f.attempts = time.Time{}, 0
}
