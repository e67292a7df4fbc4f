package routing

import (
	"sync"
	"sync/atomic"
	"time"
)

// Circuit states, as the gateway_upstream_circuit_state metric reports them.
const (
	stateClosed   = 0
	stateHalfOpen = 1
	stateOpen     = 2
)

// CircuitConfig configures every target's circuit.
type CircuitConfig struct {
	// Failures is how many consecutive failures open the circuit.
	Failures int
	// Cooldown is how long an opened circuit refuses calls before one probe;
	// each failed probe doubles it, up to MaxCooldown.
	Cooldown    time.Duration
	MaxCooldown time.Duration
}

// Defaults of CircuitConfig.
const (
	DefaultFailures    = 3
	DefaultCooldown    = time.Second
	DefaultMaxCooldown = 10 * time.Second
)

func (c CircuitConfig) withDefaults() CircuitConfig {
	if c.Failures <= 0 {
		c.Failures = DefaultFailures
	}
	if c.Cooldown <= 0 {
		c.Cooldown = DefaultCooldown
	}
	if c.MaxCooldown < c.Cooldown {
		c.MaxCooldown = max(DefaultMaxCooldown, c.Cooldown)
	}
	return c
}

// circuit is a target's passive health: closed, it takes every call; after
// Failures consecutive failures it opens and refuses calls for a cool-down;
// then it lets one probe through (half-open): an answer closes it, a failure
// opens it again for twice as long (up to MaxCooldown).
type circuit struct {
	cfg      CircuitConfig
	onChange func(state int)
	// healthy is true while the circuit is closed with no failure counted:
	// the common case, answered without the lock.
	healthy atomic.Bool

	mu       sync.Mutex
	state    int
	failures int
	cooldown time.Duration
	until    time.Time
	probing  bool
}

func newCircuit(cfg CircuitConfig, onChange func(state int)) *circuit {
	c := &circuit{cfg: cfg, onChange: onChange}
	c.healthy.Store(true)
	return c
}

// allow says whether a call may go to the target now; when it lets a probe
// through, the circuit holds its one probe slot until the outcome is reported.
func (c *circuit) allow(now time.Time) bool {
	if c.healthy.Load() {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ready, full := c.readyLocked(now)
	if ready && !full {
		c.setState(stateHalfOpen)
		c.probing = true
	}
	return ready
}

// ready says whether allow would let a call through now, without taking the
// probe slot; full says whether the circuit is closed.
func (c *circuit) ready(now time.Time) (ready, full bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.readyLocked(now)
}

// readyLocked is ready with c.mu held.
func (c *circuit) readyLocked(now time.Time) (ready, full bool) {
	switch c.state {
	case stateClosed:
		return true, true
	case stateOpen:
		return !now.Before(c.until), false
	}
	return !c.probing, false
}

// reopensAt is when an open circuit's cool-down ends; zero when not open.
func (c *circuit) reopensAt() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateOpen {
		return time.Time{}
	}
	return c.until
}

// succeeded records an answer (a rejection of the request included): the
// target is up.
func (c *circuit) succeeded() {
	if c.healthy.Load() {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failures, c.cooldown, c.probing = 0, 0, false
	c.setState(stateClosed)
	c.healthy.Store(true)
}

// failed records a failure that says the target is in trouble; wait is how
// long the target asked callers to wait (its Retry-After), zero when it did
// not. A cool-down the failure starts lasts at least that long, up to
// MaxCooldown. One answer asking to wait does not open the circuit alone:
// some providers give one request a 429 (a prompt larger than a per-minute
// limit), and one tenant's request must not stop every tenant's calls.
func (c *circuit) failed(now time.Time, wait time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.healthy.Store(false)
	c.failures++
	switch c.state {
	case stateOpen:
		return // a call from before it opened: the cool-down runs as it is
	case stateClosed:
		if c.failures < c.cfg.Failures {
			return
		}
		c.cooldown = c.cfg.Cooldown
	case stateHalfOpen:
		c.cooldown = min(2*c.cooldown, c.cfg.MaxCooldown)
	}
	c.until, c.probing = now.Add(max(c.cooldown, min(wait, c.cfg.MaxCooldown))), false
	c.setState(stateOpen)
}

// released records an attempt that says nothing of the target (the caller
// went away): a probe slot it held is free again.
func (c *circuit) released() {
	if c.healthy.Load() {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.probing = false
}

// setState moves to state, reporting a change; c.mu is held.
func (c *circuit) setState(state int) {
	if c.state == state {
		return
	}
	c.state = state
	if c.onChange != nil {
		c.onChange(state)
	}
}
