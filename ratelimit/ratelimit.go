// Package ratelimit counts requests against each key's per-minute limit in
// memory. A replica leases a slice of a key's minute from PostgreSQL (one
// statement), admits requests from it without a round trip, and returns what
// it did not use. The sum of every replica's slices never passes the limit, so
// however many replicas serve a key, it is never admitted more than its limit
// in the sliding minute the store counts.
//
// A key in steady use does not wait for its leases: a slice running low is
// refilled in the background, and in the last seconds of a minute the next
// minute's slice is leased ahead, so that the key's first request of the new
// minute finds it held.
package ratelimit

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/inflight"
	"github.com/rungworks/gateway/internal/stagger"
	"github.com/rungworks/gateway/store"
)

// Store leases and returns slices of keys' minutes.
type Store interface {
	LeaseRate(ctx context.Context, keyID uuid.UUID, now time.Time, limit, share int) (store.RateGrant, error)
	LeaseRateAhead(ctx context.Context, keyID uuid.UUID, window time.Time, limit, share int) (store.RateGrant, error)
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
	// before the store is asked again, and how long a lease in the background
	// that failed waits before the next.
	DefaultRetryRefused = 250 * time.Millisecond
	// DefaultAhead is how long before a minute ends a key in use may lease
	// its slice of the next (each key from an instant of its first half): a
	// key used every few seconds finds it held as the minute turns.
	DefaultAhead = 10 * time.Second
	// lowWater refills a slice once less than 1/lowWater of its last grant
	// is left of it.
	lowWater = 4
	// grantTimeout bounds one lease statement.
	grantTimeout = 5 * time.Second
)

// Config configures a Limiter; zero fields take the defaults.
type Config struct {
	Limits       gateway.RateLimits
	Share        int
	Idle         time.Duration
	RetryRefused time.Duration
	Ahead        time.Duration
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

// slice is what this replica holds of one minute of a key.
type slice struct {
	window       time.Time
	left         int
	granted      int     // the last grant, which tells when to refill
	used         float64 // the key's count after this replica's last grant
	previous     int     // the counts used weighs: the previous minute's,
	current      int     // and this one's after the grant
	refusedUntil time.Time
}

// bucket is one key's slice of the current minute and, once leased ahead,
// of the next.
type bucket struct {
	slice
	next    *slice
	touched time.Time
	// leasing is the lease in flight, if any: of this minute, or of the
	// next one ahead of it.
	leasing *inflight.Call
	// retryAt is when a lease in the background may follow one that failed.
	retryAt time.Time
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
	if cfg.Ahead <= 0 {
		cfg.Ahead = DefaultAhead
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
// in memory, or after leasing a new one, and starts the lease in the
// background that the slice will need next, if any. A request past the limit
// is not counted and comes back with Admitted false.
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
			l.refill(keyID, b, now, limit)
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

		grant, err := l.lease(ctx, keyID, window, now, limit)

		l.mu.Lock()
		l.landed(keyID, b, window, now, call, grant, err)
		l.mu.Unlock()
		if err != nil {
			return gateway.RateStatus{}, err
		}
	}
}

// refill starts, in the background, the lease b will need next: more of this
// minute once less than a quarter of the last grant is left, or the next
// minute's slice once this minute ends within the key's lead, an instant of
// Config.Ahead's first half set by its id (stagger.Lead): the keys in use do
// not all lease as the window opens, each replica's at once. A slice leased
// ahead is room the rest of this minute no longer has (the next minute weighs
// this one whole as it starts), so it is leased only while the key's slices
// hold a few requests (lowWater): far from its limit. Nothing is started
// while a lease is in flight, and for a while after one in the background
// failed. Called with l.mu held.
func (l *Limiter) refill(keyID uuid.UUID, b *bucket, now time.Time, limit int) {
	if b.leasing != nil || now.Before(b.retryAt) {
		return
	}
	window := b.window
	next := window.Add(time.Minute)
	switch {
	case b.left < b.granted/lowWater:
	case b.next == nil && next.Sub(now) <= stagger.Lead(keyID, l.cfg.Ahead) && b.granted >= lowWater:
		window = next
	default:
		return
	}
	call := inflight.Start()
	b.leasing = call
	go func() {
		grant, err := l.lease(context.Background(), keyID, window, now, limit)
		l.mu.Lock()
		defer l.mu.Unlock()
		if err != nil {
			b.retryAt = l.cfg.Clock().Add(l.cfg.RetryRefused)
			l.cfg.Logger.Debug("error refilling a rate-limit slice ahead of need", "error", err)
		}
		l.landed(keyID, b, window, now, call, grant, err)
	}()
}

// lease leases a slice of key's minute window, asked at now: as at now when
// now is in it, as at its start when it is ahead.
func (l *Limiter) lease(ctx context.Context, keyID uuid.UUID, window, now time.Time, limit int) (store.RateGrant, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grantTimeout)
	defer cancel()
	var g store.RateGrant
	var err error
	if window.After(now) {
		g, err = l.store.LeaseRateAhead(ctx, keyID, window, limit, l.cfg.Share)
	} else {
		g, err = l.store.LeaseRate(ctx, keyID, now, limit, l.cfg.Share)
	}
	if err != nil {
		return g, fmt.Errorf("error counting the request against its rate limit: %w", err)
	}
	return g, nil
}

// landed ends the lease call of key's minute window, asked at now, with its
// outcome: the grant goes to the slice of its minute, or back to the store
// when its minute is past. Called with l.mu held.
func (l *Limiter) landed(keyID uuid.UUID, b *bucket, window, now time.Time, call *inflight.Call, grant store.RateGrant, err error) {
	b.leasing = nil
	call.End(err)
	if err != nil {
		return
	}
	switch {
	case b.window.Equal(window):
		b.add(grant, now.Add(l.cfg.RetryRefused))
	case b.window.Add(time.Minute).Equal(window):
		if b.next == nil {
			b.next = &slice{window: window}
		}
		b.next.add(grant, now.Add(l.cfg.RetryRefused))
	case grant.Granted > 0:
		// The minute turned while the lease was in flight.
		l.returns = append(l.returns, store.RateReturn{KeyID: keyID, Window: window, Count: grant.Granted})
	}
}

// add adds a grant to s; a refusal is answered from memory until refusedUntil.
func (s *slice) add(g store.RateGrant, refusedUntil time.Time) {
	s.left += g.Granted
	s.granted = g.Granted
	s.used, s.previous, s.current = g.Used, g.Previous, g.Current
	if g.Granted == 0 {
		s.refusedUntil = refusedUntil
	}
}

// bucket returns key's bucket for window, its slice leased ahead of window
// made current, setting aside the unused slices of other minutes to be
// returned. Called with l.mu held.
func (l *Limiter) bucket(keyID uuid.UUID, window time.Time) *bucket {
	b := l.buckets[keyID]
	if b == nil {
		b = &bucket{slice: slice{window: window}}
		l.buckets[keyID] = b
	}
	if !b.window.Equal(window) {
		l.setAside(keyID, &b.slice)
		current := slice{window: window}
		if b.next != nil && b.next.window.Equal(window) {
			current = *b.next
		} else if b.next != nil {
			l.setAside(keyID, b.next)
		}
		*b = bucket{slice: current, leasing: b.leasing, retryAt: b.retryAt}
	}
	return b
}

// setAside adds what is left of s to the returns. Called with l.mu held.
func (l *Limiter) setAside(keyID uuid.UUID, s *slice) {
	if s.left > 0 {
		l.returns = append(l.returns, store.RateReturn{KeyID: keyID, Window: s.window, Count: s.left})
	}
}

// status is the rate outcome a request is told at now: what is left counts
// what this replica holds and what the window leaves to lease, less the next
// minute's slices leased ahead, which the rest of this one leaves room for.
// Called with l.mu held.
func (b *bucket) status(limit int, admitted bool, now time.Time) gateway.RateStatus {
	next := 0
	if b.next != nil {
		next = b.next.current
	}
	if !admitted {
		return gateway.RateStatus{Limit: limit, RetryAfter: untilAdmitted(now, limit, b.previous, b.current, next)}
	}
	room := min(int(math.Floor(float64(limit)-b.used)), limit-b.current-next)
	return gateway.RateStatus{Limit: limit, Remaining: b.left + max(0, room), Admitted: true}
}

// untilAdmitted is how long after now the sliding window admits one more
// request of a key with limit (at least 1), whose previous minute counted
// previous, whose current minute (that of now) counts current and whose next
// one next (its slices leased ahead, as far as this replica knows), when
// nothing else is counted meanwhile. A minute admits one while previous × (the
// part of the previous minute still in the last 60 s) + current ≤ limit − 1
// and current + next ≤ limit − 1, which leaves room for the slices of the
// minute after it already leased (see lease_rate_counts, migration 00053). It
// is at least a second, the least a Retry-After header can say.
func untilAdmitted(now time.Time, limit, previous, current, next int) time.Duration {
	elapsed := now.Sub(now.UTC().Truncate(time.Minute))
	// fallen is when, into its minute, weight × (1 − t/minute) ≤ room (room
	// ≥ 0 in each case below): at minute × (weight − room) / weight, rounded
	// up to the nanosecond.
	fallen := func(room, weight int) time.Duration {
		if weight <= room {
			return 0
		}
		over := time.Minute * time.Duration(weight-room)
		return (over + time.Duration(weight) - 1) / time.Duration(weight)
	}
	var wait time.Duration
	switch {
	case current+next <= limit-1:
		// Within this minute, as the previous one weighs less.
		wait = fallen(limit-1-current, previous) - elapsed
	case next <= limit-1:
		// In the next minute, as this one weighs less.
		wait = time.Minute - elapsed + fallen(limit-1-next, current)
	default:
		// The next minute is full already: in the one after, as it weighs
		// less.
		wait = 2*time.Minute - elapsed + fallen(limit-1, next)
	}
	return max(wait, time.Second)
}

// Run returns, every second until ctx ends, the slices of keys idle for
// Config.Idle and of minutes past, in one statement; the last returns are
// made as ctx ends, once the leases in flight have landed.
func (l *Limiter) Run(ctx context.Context) {
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			inflight.Await(context.WithoutCancel(ctx), &l.mu, maps.Values(l.buckets), func(b *bucket) *inflight.Call { return b.leasing })
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
		l.setAside(id, &b.slice)
		if b.next != nil {
			l.setAside(id, b.next)
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
