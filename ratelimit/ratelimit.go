// Package ratelimit counts requests against each key's per-minute limit in
// memory. A replica leases a slice of a key's minute from PostgreSQL (one
// statement), admits requests from it without a round trip, and returns what
// it did not use. The sum of every replica's slices never passes the limit, so
// however many replicas serve a key, it is never admitted more than its limit
// in the sliding minute the store counts.
package ratelimit

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/inflight"
	"github.com/rungworks/gateway/store"
)

// Store leases and returns slices of keys' minutes.
type Store interface {
	LeaseRate(ctx context.Context, keyID uuid.UUID, now time.Time, limit, share int) (store.RateGrant, error)
	ReturnRate(ctx context.Context, returns []store.RateReturn) error
}

// Defaults of a Config.
const (
	// DefaultShare sizes a slice as 1/16 of what the key's minute leaves.
	DefaultShare = 16
	// DefaultIdle is how long a key's unused slice is kept without a request:
	// a key used three times a minute keeps its slice until the minute turns.
	DefaultIdle = 20 * time.Second
	// DefaultRetryRefused is how long a refused key is answered from memory
	// before the store is asked again.
	DefaultRetryRefused = 250 * time.Millisecond
	// grantTimeout bounds one lease statement.
	grantTimeout = 5 * time.Second
)

// Config configures a Limiter; zero fields take the defaults.
type Config struct {
	Limits       gateway.RateLimits
	Share        int
	Idle         time.Duration
	RetryRefused time.Duration
	// Clock is the time windows are counted at; nil means time.Now.
	Clock  func() time.Time
	Logger *slog.Logger
}

// Limiter counts requests per key from leased slices.
type Limiter struct {
	cfg   Config
	store Store

	mu      sync.Mutex
	buckets map[uuid.UUID]*bucket
	returns []store.RateReturn
}

// bucket is one key's slice of the current minute.
type bucket struct {
	window       time.Time
	left         int
	used         float64 // the key's count after this replica's last grant
	previous     int     // the counts used weighs: the previous minute's,
	current      int     // and this one's after the grant
	touched      time.Time
	refusedUntil time.Time
	leasing      *inflight.Call // the lease in flight, if any
}

// New returns a limiter over st.
func New(cfg Config, st Store) *Limiter {
	if cfg.Limits == (gateway.RateLimits{}) {
		cfg.Limits = gateway.DefaultRateLimits
	}
	if cfg.Share <= 0 {
		cfg.Share = DefaultShare
	}
	if cfg.Idle <= 0 {
		cfg.Idle = DefaultIdle
	}
	if cfg.RetryRefused <= 0 {
		cfg.RetryRefused = DefaultRetryRefused
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Limiter{cfg: cfg, store: st, buckets: map[uuid.UUID]*bucket{}}
}

// Limit is the requests per minute of a key of tier t.
func (l *Limiter) Limit(t gateway.Tier) int {
	if t == gateway.TierFree {
		return l.cfg.Limits.Free
	}
	return l.cfg.Limits.Developer
}

// Take counts one request of key against its limit: admitted from the slice
// in memory, or after leasing a new one. A request past the limit is not
// counted and comes back with Admitted false.
func (l *Limiter) Take(ctx context.Context, keyID uuid.UUID, tier gateway.Tier) (gateway.RateStatus, error) {
	limit := l.Limit(tier)
	for {
		now := l.cfg.Clock()
		window := now.UTC().Truncate(time.Minute)
		l.mu.Lock()
		b := l.bucket(keyID, window)
		b.touched = now
		if b.left > 0 {
			b.left--
			status := b.status(limit, true, now)
			l.mu.Unlock()
			return status, nil
		}
		if now.Before(b.refusedUntil) {
			status := b.status(limit, false, now)
			l.mu.Unlock()
			return status, nil
		}
		if call := b.leasing; call != nil {
			// Its failure is this request's too: the store did not answer.
			l.mu.Unlock()
			if err := call.Wait(ctx); err != nil {
				return gateway.RateStatus{}, err
			}
			continue
		}
		call := inflight.Start()
		b.leasing = call
		l.mu.Unlock()

		grant, err := l.lease(ctx, keyID, now, limit)

		l.mu.Lock()
		b.leasing = nil
		call.End(err)
		if err != nil {
			l.mu.Unlock()
			return gateway.RateStatus{}, err
		}
		if b.window.Equal(window) {
			b.left += grant.Granted
			b.used, b.previous, b.current = grant.Used, grant.Previous, grant.Current
			if grant.Granted == 0 {
				b.refusedUntil = now.Add(l.cfg.RetryRefused)
			}
		} else if grant.Granted > 0 {
			// The minute turned while the lease was in flight.
			l.returns = append(l.returns, store.RateReturn{KeyID: keyID, Window: window, Count: grant.Granted})
		}
		l.mu.Unlock()
	}
}

func (l *Limiter) lease(ctx context.Context, keyID uuid.UUID, now time.Time, limit int) (store.RateGrant, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grantTimeout)
	defer cancel()
	g, err := l.store.LeaseRate(ctx, keyID, now, limit, l.cfg.Share)
	if err != nil {
		return g, fmt.Errorf("error counting the request against its rate limit: %w", err)
	}
	return g, nil
}

// bucket returns key's bucket for window, setting aside the unused slice of
// an earlier minute to be returned. Called with l.mu held.
func (l *Limiter) bucket(keyID uuid.UUID, window time.Time) *bucket {
	b := l.buckets[keyID]
	if b == nil {
		b = &bucket{window: window}
		l.buckets[keyID] = b
	}
	if !b.window.Equal(window) {
		if b.left > 0 {
			l.returns = append(l.returns, store.RateReturn{KeyID: keyID, Window: b.window, Count: b.left})
		}
		*b = bucket{window: window, leasing: b.leasing}
	}
	return b
}

// status is the rate outcome a request is told at now. Called with l.mu held.
func (b *bucket) status(limit int, admitted bool, now time.Time) gateway.RateStatus {
	if !admitted {
		return gateway.RateStatus{Limit: limit, RetryAfter: untilAdmitted(now, limit, b.previous, b.current)}
	}
	remaining := b.left + max(0, int(math.Floor(float64(limit)-b.used)))
	return gateway.RateStatus{Limit: limit, Remaining: remaining, Admitted: true}
}

// untilAdmitted is how long after now the sliding window admits one more
// request of a key with limit (at least 1), whose previous minute counted
// previous and whose current minute (that of now) counts current, when
// nothing else is counted meanwhile: the window admits one while
// previous × (the part of the previous minute still in the last 60 s) +
// current ≤ limit − 1. It is at least a second, the least a Retry-After
// header can say.
func untilAdmitted(now time.Time, limit, previous, current int) time.Duration {
	elapsed := now.Sub(now.UTC().Truncate(time.Minute))
	// fallen is when, into its minute, weight × (1 − t/minute) ≤ room: at
	// minute × (weight − room) / weight, rounded up to the nanosecond.
	fallen := func(room, weight int) time.Duration {
		if weight <= room {
			return 0
		}
		over := time.Minute * time.Duration(weight-room)
		return (over + time.Duration(weight) - 1) / time.Duration(weight)
	}
	var wait time.Duration
	if room := limit - 1 - current; room >= 0 {
		// Within this minute, as the previous one weighs less.
		wait = fallen(room, previous) - elapsed
	} else {
		// In the next minute, as this one weighs less.
		wait = time.Minute - elapsed + fallen(limit-1, current)
	}
	return max(wait, time.Second)
}

// Run returns, every second until ctx ends, the slices of keys idle for
// Config.Idle and of minutes past, in one statement; the last returns are
// made as ctx ends.
func (l *Limiter) Run(ctx context.Context) {
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			l.flush(context.WithoutCancel(ctx), true)
			return
		case <-ticker.C:
			l.flush(ctx, false)
		}
	}
}

// flush returns the unused slices of idle keys (every key when all).
func (l *Limiter) flush(ctx context.Context, all bool) {
	now := l.cfg.Clock()
	l.mu.Lock()
	for id, b := range l.buckets {
		if b.leasing != nil || (!all && now.Sub(b.touched) < l.cfg.Idle) {
			continue
		}
		if b.left > 0 {
			l.returns = append(l.returns, store.RateReturn{KeyID: id, Window: b.window, Count: b.left})
		}
		delete(l.buckets, id)
	}
	returns := l.returns
	l.returns = nil
	l.mu.Unlock()
	if len(returns) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, grantTimeout)
	defer cancel()
	// A return that fails is not retried: the slice stays counted in its
	// minute, which only makes the limit stricter for that minute.
	if err := l.store.ReturnRate(ctx, returns); err != nil {
		l.cfg.Logger.Warn("error returning unused rate-limit slices", "keys", len(returns), "error", err)
	}
}
