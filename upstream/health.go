package upstream

import (
	"context"
	"sync"
	"time"
)

// Default bounds of the pause between probes during an outage.
const (
	MinProbeInterval = 250 * time.Millisecond
	// DefaultMaxProbeInterval keeps draining at most this far behind an
	// upstream that answers again without interactive traffic to tell.
	DefaultMaxProbeInterval = 2 * time.Second
)

// Health is what the gateway has seen of its upstream lately, shared by
// interactive requests and the batch drainer. A failure that says the upstream
// is down starts a pause before the next probe, doubling while probes fail up
// to a maximum; any answer ends it at once. A nil *Health records nothing and
// is always up.
type Health struct {
	mu      sync.Mutex
	max     time.Duration
	backoff time.Duration
	until   time.Time
	// up is closed (and replaced) by Up: it wakes whoever waits out a pause.
	up chan struct{}
}

// NewHealth returns an upstream in good health whose probe pause grows to at
// most maxPause (DefaultMaxProbeInterval when zero).
func NewHealth(maxPause time.Duration) *Health {
	if maxPause <= 0 {
		maxPause = DefaultMaxProbeInterval
	}
	return &Health{max: maxPause, up: make(chan struct{})}
}

// Down records a failure that says the upstream is down. While a pause runs,
// further failures do not lengthen it.
func (h *Health) Down() {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if time.Now().Before(h.until) {
		return
	}
	h.backoff = min(max(2*h.backoff, MinProbeInterval), h.max)
	h.until = time.Now().Add(h.backoff)
}

// Up records an answer: the outage, if any, is over.
func (h *Health) Up() {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.backoff == 0 {
		return
	}
	h.backoff, h.until = 0, time.Time{}
	close(h.up)
	h.up = make(chan struct{})
}

// Wait waits out the current pause: until it ends, an answer ends the outage
// (Up), or ctx ends. It returns at once when there is no pause.
func (h *Health) Wait(ctx context.Context) {
	if h == nil {
		return
	}
	h.mu.Lock()
	wait, up := time.Until(h.until), h.up
	h.mu.Unlock()
	if wait <= 0 {
		return
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-ctx.Done():
	case <-up:
	case <-timer.C:
	}
}

// Pause is how long to wait before the next probe; zero or less when none.
func (h *Health) Pause() time.Duration {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return time.Until(h.until)
}

// Probing reports whether the upstream is suspected down: work should go out
// one call at a time until one succeeds.
func (h *Health) Probing() bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.backoff > 0
}
