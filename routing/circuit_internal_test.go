package routing

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// TestCircuitHoldsAtMostMaxHeldTenants: tenants failing alone, each between
// others' answers, are held one by one up to maxHeld; one more says the target
// is in trouble, and the circuit opens for everyone.
func TestCircuitHoldsAtMostMaxHeldTenants(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Hour, MaxCooldown: time.Hour}, nil, nil)
	now := time.Now()
	for range maxHeld {
		c.failed(now, 0, uuid.New(), true)
		c.succeededAt(now, uuid.New())
	}
	ok, _ := c.allow(now, uuid.New())
	require.True(t, ok, "%d tenants held, the others' calls go on", maxHeld)
	c.failed(now, 0, uuid.New(), true)
	ok, held := c.allow(now, uuid.New())
	require.False(t, ok, "one more held would pass maxHeld: the circuit is open")
	require.False(t, held)
}

// TestAHeldTenantNeverProbesTheCircuit: once the circuit is half-open, a
// tenant still held (its cool-down over) is refused as held rather than sent
// as the circuit's probe, so the probe slot is never taken by a call whose
// failure would count only for its own hold; another tenant's call probes.
func TestAHeldTenantNeverProbesTheCircuit(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: time.Second}, nil, nil)
	now := time.Now()
	poisoner := uuid.New()
	c.failed(now, 0, poisoner, true)
	ok, held := c.allow(now, poisoner)
	require.False(t, ok)
	require.True(t, held)
	c.failed(now, 0, uuid.Nil, false)
	ok, held = c.allow(now, uuid.New())
	require.False(t, ok, "a failure of no tenant's opened the circuit")
	require.False(t, held)

	later := now.Add(2 * time.Second)
	ok, held = c.allow(later, poisoner)
	require.False(t, ok, "the held tenant does not probe the circuit")
	require.True(t, held, "it stays held while the circuit is half-open")
	ok, _ = c.allow(later, uuid.New())
	require.True(t, ok, "another tenant's call is the probe")
	ok, _ = c.allow(later, uuid.New())
	require.False(t, ok, "one probe at a time")
	c.succeededAt(later, uuid.New())
	ok, _ = c.allow(later, poisoner)
	require.True(t, ok, "the circuit closed; the poisoner's hold, over, was dropped")
}

// TestAHeldTenantsProbeMeetingAnOutageProbesAgain: a held tenant's probe that
// meets the target's own trouble (a 503) counts against the circuit as
// anyone's failure would, and frees the tenant's probe slot: the hold is not
// left waiting for an outcome that never comes.
func TestAHeldTenantsProbeMeetingAnOutageProbesAgain(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 2, Cooldown: time.Second, MaxCooldown: time.Second}, nil, nil)
	now := time.Now()
	tenant := uuid.New()
	c.failed(now, 0, tenant, true)
	c.failed(now, 0, tenant, true)
	later := now.Add(2 * time.Second)
	ok, _ := c.allow(later, tenant)
	require.True(t, ok, "the hold's probe")
	ok, held := c.allow(later, tenant)
	require.False(t, ok)
	require.True(t, held, "one probe at a time")
	c.failed(later, 0, tenant, false)
	ok, held = c.allow(later, uuid.New())
	require.False(t, ok, "the run, now the target's, opened the circuit")
	require.False(t, held)

	// Another tenant's answer closes the circuit and drops the hold, over and
	// no longer probing: the tenant's calls go.
	c.succeededAt(later.Add(2*time.Second), uuid.New())
	ok, _ = c.allow(later.Add(2*time.Second), tenant)
	require.True(t, ok)
}
