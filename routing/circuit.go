package routing

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
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

// maxHeld bounds the tenants a circuit holds off alone: that many failing
// alone says the target is in trouble, and the circuit opens for everyone.
const maxHeld = 1000

// circuit is a target's passive health: closed, it takes every call; after
// Failures consecutive failures it opens and refuses calls for a cool-down;
// then it lets one probe through (half-open): an answer closes it, a failure
// opens it again for twice as long (up to MaxCooldown).
//
// A failure a tenant's own prompts can cause (the call failed after dispatch:
// a 500, a timeout, an unreadable reply, a broken stream; or a 429, which one
// request larger than a per-minute token limit gets) is counted as that
// tenant's. While every failure since the last answer is one tenant's, the
// Failures-th holds off that tenant's calls alone, with a cool-down and a
// probe of its own, and every other tenant's calls go on: one tenant's
// prompts that make the upstream fail do not stop the others. A failure of a
// second tenant's in the same run, or one that says the target itself is in
// trouble (no connection, 503, a refusal of the gateway's key), opens the
// circuit for everyone, as does a tenant to hold past maxHeld.
type circuit struct {
	cfg      CircuitConfig
	onChange func(state int)
	onHold   func(tenant uuid.UUID)
	// healthy is true while the circuit is closed with no failure counted and
	// no tenant held: the common case, answered without the lock.
	healthy atomic.Bool

	mu       sync.Mutex
	state    int
	failures int
	// runTenant is the tenant of the failures counted, while they are all
	// one tenant's own; shared says the run holds a failure that is not.
	runTenant uuid.UUID
	shared    bool
	cooldown  time.Duration
	until     time.Time
	probing   bool
	held      map[uuid.UUID]*hold
	// pruneAt is when an answer next drops the holds whose cool-down ended
	// (at most once a cool-down, however many answers come).
	pruneAt time.Time
}

// hold is a tenant's calls held off by one circuit: refused until its
// cool-down ends, then one probe at a time; a failed probe doubles it.
type hold struct {
	until    time.Time
	cooldown time.Duration
	probing  bool
}

// newCircuit returns a closed circuit that reports its state changes to
// onChange and the holds it begins to onHold (either may be nil); both are
// called with the circuit's lock held.
func newCircuit(cfg CircuitConfig, onChange func(state int), onHold func(tenant uuid.UUID)) *circuit {
	c := &circuit{cfg: cfg, onChange: onChange, onHold: onHold, held: map[uuid.UUID]*hold{}}
	c.healthy.Store(true)
	return c
}

// allow says whether tenant's call may go to the target now, and, when not,
// whether only tenant's calls are held off; when it lets a probe through
// (the circuit's or the tenant's), it holds that probe slot until the
// outcome is reported.
func (c *circuit) allow(now time.Time, tenant uuid.UUID) (ok, held bool) {
	if c.healthy.Load() {
		return true, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	h := c.held[tenant]
	if h != nil && (h.probing || now.Before(h.until)) {
		return false, true
	}
	ready, full := c.readyLocked(now)
	switch {
	case !ready:
		return false, false
	case h != nil && !full:
		// A held tenant probes its own hold, never the circuit (its
		// failure would say nothing of the target): it stays held until
		// the circuit closes.
		return false, true
	case h != nil:
		h.probing = true
	case !full:
		c.setState(stateHalfOpen)
		c.probing = true
	}
	return true, false
}

// ready says whether allow would let a call through now, without taking the
// probe slot; full says whether the circuit is closed. Tenants held are not
// considered.
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

// reopensAt is when tenant's calls may go to the target again: the end of
// the open circuit's cool-down or of tenant's hold, the later; zero when
// neither holds them off.
func (c *circuit) reopensAt(tenant uuid.UUID) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var at time.Time
	if c.state == stateOpen {
		at = c.until
	}
	if h := c.held[tenant]; h != nil && h.until.After(at) {
		at = h.until
	}
	return at
}

// succeeded records an answer to tenant (a rejection of the request
// included): the target is up, and tenant's calls are no longer held. Holds
// whose cool-down has ended are dropped too, at most once a cool-down: their
// tenants' next failures count afresh.
func (c *circuit) succeeded(tenant uuid.UUID) {
	if c.healthy.Load() {
		return
	}
	c.succeededAt(time.Now(), tenant)
}

// succeededAt is succeeded at now, for a circuit not known healthy.
func (c *circuit) succeededAt(now time.Time, tenant uuid.UUID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failures, c.cooldown, c.probing, c.runTenant, c.shared = 0, 0, false, uuid.Nil, false
	c.setState(stateClosed)
	delete(c.held, tenant)
	if len(c.held) > 0 && !now.Before(c.pruneAt) {
		for t, h := range c.held {
			if !h.probing && !now.Before(h.until) {
				delete(c.held, t)
			}
		}
		c.pruneAt = now.Add(c.cfg.Cooldown)
	}
	c.healthy.Store(len(c.held) == 0)
}

// failed records a failure of tenant's call; own says the call's prompt may
// have caused it (it failed after dispatch, or was refused with a 429),
// otherwise it says the target is in trouble. wait is how long the target
// asked callers to wait (its Retry-After), zero when it did not. A cool-down
// or hold the failure starts lasts at least that long, up to MaxCooldown.
func (c *circuit) failed(now time.Time, wait time.Duration, tenant uuid.UUID, own bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.healthy.Store(false)
	own = own && tenant != uuid.Nil
	if h := c.held[tenant]; h != nil {
		switch {
		case h.probing && own:
			// The held tenant's probe failed: held twice as long (or as
			// long as the target asked, up to MaxCooldown).
			h.cooldown = min(2*h.cooldown, c.cfg.MaxCooldown)
			h.until, h.probing = now.Add(max(h.cooldown, min(wait, c.cfg.MaxCooldown))), false
			return
		case own:
			return // a call sent before the hold began
		}
		// The target's own trouble, counted below as anyone's: the
		// tenant may probe again.
		h.probing = false
	}
	c.failures++
	switch {
	case !own:
		c.shared = true
	case c.runTenant == uuid.Nil:
		c.runTenant = tenant
	case c.runTenant != tenant:
		c.shared = true
	}
	switch c.state {
	case stateOpen:
		return // a call from before it opened: the cool-down runs as it is
	case stateClosed:
		if c.failures < c.cfg.Failures {
			return
		}
		if !c.shared && len(c.held) < maxHeld {
			c.held[c.runTenant] = &hold{until: now.Add(max(c.cfg.Cooldown, min(wait, c.cfg.MaxCooldown))), cooldown: c.cfg.Cooldown}
			if c.onHold != nil {
				c.onHold(c.runTenant)
			}
			return
		}
		c.cooldown = c.cfg.Cooldown
	case stateHalfOpen:
		c.cooldown = min(2*c.cooldown, c.cfg.MaxCooldown)
	}
	c.until, c.probing = now.Add(max(c.cooldown, min(wait, c.cfg.MaxCooldown))), false
	c.setState(stateOpen)
}

// released records an attempt of tenant's that says nothing of the target
// (the caller went away): a probe slot it held is free again.
func (c *circuit) released(tenant uuid.UUID) {
	if c.healthy.Load() {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.probing = false
	if h := c.held[tenant]; h != nil {
		h.probing = false
	}
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
