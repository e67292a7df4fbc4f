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

// TestCircuitConfigDefaults: what is left zero takes its default, and the
// longest cool-down is never shorter than the first.
func TestCircuitConfigDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want CircuitConfig }{
		{CircuitConfig{}, CircuitConfig{Failures: DefaultFailures, Cooldown: DefaultCooldown, MaxCooldown: DefaultMaxCooldown}},
		{CircuitConfig{Failures: 5, Cooldown: 2 * time.Second, MaxCooldown: 4 * time.Second}, CircuitConfig{Failures: 5, Cooldown: 2 * time.Second, MaxCooldown: 4 * time.Second}},
		{CircuitConfig{Cooldown: 2 * time.Second, MaxCooldown: time.Second}, CircuitConfig{Failures: DefaultFailures, Cooldown: 2 * time.Second, MaxCooldown: DefaultMaxCooldown}},
		{CircuitConfig{Cooldown: time.Minute}, CircuitConfig{Failures: DefaultFailures, Cooldown: time.Minute, MaxCooldown: time.Minute}},
		// A cool-down that never grows: the longest set as long as the first.
		{CircuitConfig{Cooldown: 3 * time.Second, MaxCooldown: 3 * time.Second}, CircuitConfig{Failures: DefaultFailures, Cooldown: 3 * time.Second, MaxCooldown: 3 * time.Second}},
	} {
		require.Equal(t, tc.want, tc.in.withDefaults(), "%+v", tc.in)
	}
}

// TestACircuitReportsItsChangesOnce: each change of state is reported once;
// a failure while the circuit is open (a call sent before it opened) neither
// reports nor lengthens the cool-down.
func TestACircuitReportsItsChangesOnce(t *testing.T) {
	t.Parallel()
	var states []int
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: time.Second}, func(s int) { states = append(states, s) }, nil)
	now := time.Now()
	c.failed(now, 0, uuid.Nil, false)
	c.failed(now.Add(500*time.Millisecond), 0, uuid.Nil, false)
	require.Equal(t, now.Add(time.Second), c.reopensAt(uuid.Nil), "the cool-down runs from the failure that opened it")
	later := now.Add(time.Second)
	ok, _ := c.allow(later, uuid.New())
	require.True(t, ok, "the probe")
	c.succeededAt(later, uuid.New())
	c.succeededAt(later, uuid.New())
	require.Equal(t, []int{stateOpen, stateHalfOpen, stateClosed}, states)
}

// TestCoolDownsLastNoLongerThanTheLongest: a Retry-After past the longest
// cool-down, and a cool-down doubled past it, wait the longest; a held
// tenant's failed probe waits as long as the target asked when that is
// longer than its doubled hold.
func TestCoolDownsLastNoLongerThanTheLongest(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: 6 * time.Second, MaxCooldown: 10 * time.Second}, nil, nil)
	now := time.Now()
	c.failed(now, time.Hour, uuid.Nil, false)
	require.Equal(t, now.Add(10*time.Second), c.reopensAt(uuid.Nil), "an hour asked, the longest cool-down waited")
	later := now.Add(10 * time.Second)
	ok, _ := c.allow(later, uuid.New())
	require.True(t, ok, "the probe")
	c.failed(later, 0, uuid.Nil, false)
	require.Equal(t, later.Add(10*time.Second), c.reopensAt(uuid.Nil), "6 s doubled is 12, cut to the longest")

	c = newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: 10 * time.Second}, nil, nil)
	tenant := uuid.New()
	c.failed(now, 0, tenant, true)
	later = now.Add(time.Second)
	ok, _ = c.allow(later, tenant)
	require.True(t, ok, "the hold's probe")
	c.failed(later, 5*time.Second, tenant, true)
	require.Equal(t, later.Add(5*time.Second), c.reopensAt(tenant), "the 5 s asked, longer than the doubled hold's 2 s")
}

// TestAHeldTenantWaitsForTheOpenCircuit: a held tenant's calls go again when
// both its hold and the circuit's cool-down have ended, the later.
func TestAHeldTenantWaitsForTheOpenCircuit(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: 10 * time.Second}, nil, nil)
	now := time.Now()
	tenant := uuid.New()
	c.failed(now, 0, tenant, true)
	require.Equal(t, now.Add(time.Second), c.reopensAt(tenant))
	c.failed(now, 5*time.Second, uuid.Nil, false)
	require.Equal(t, now.Add(5*time.Second), c.reopensAt(tenant), "the circuit opened for everyone until later than the hold")
}

// TestAnAnswerStartsARunAfresh: the failures that open a circuit or hold a
// tenant are those since the last answer: one failure, an answer, one more
// with two needed open nothing; and the run after an answer is judged by its
// own failures alone, whosever were those before.
func TestAnAnswerStartsARunAfresh(t *testing.T) {
	t.Parallel()
	cfg := CircuitConfig{Failures: 2, Cooldown: time.Second, MaxCooldown: time.Second}
	now := time.Now()
	poisoner, bystander := uuid.New(), uuid.New()

	c := newCircuit(cfg, nil, nil)
	c.failed(now, 0, poisoner, true)
	c.succeededAt(now, bystander)
	c.failed(now, 0, poisoner, true)
	ok, _ := c.allow(now, poisoner)
	require.True(t, ok, "two failures with an answer between hold no one")

	for name, before := range map[string]func(c *circuit){
		"another tenant's": func(c *circuit) { c.failed(now, 0, bystander, true) },
		"the target's":     func(c *circuit) { c.failed(now, 0, uuid.Nil, false) },
	} {
		c := newCircuit(cfg, nil, nil)
		before(c)
		c.succeededAt(now, bystander)
		c.failed(now, 0, poisoner, true)
		c.failed(now, 0, poisoner, true)
		ok, held := c.allow(now, poisoner)
		require.False(t, ok, name)
		require.True(t, held, "%s failure before the answer: the poisoner's run is its own", name)
		ok, _ = c.allow(now, bystander)
		require.True(t, ok, "%s failure before the answer: the circuit stays closed", name)
	}
}

// TestAHeldTenantsLateFailuresChangeNothing: a failure of a call the held
// tenant sent before its hold began neither holds it anew nor lengthens the
// hold.
func TestAHeldTenantsLateFailuresChangeNothing(t *testing.T) {
	t.Parallel()
	holds := 0
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: time.Second}, nil, func(uuid.UUID) { holds++ })
	now := time.Now()
	tenant := uuid.New()
	c.failed(now, 0, tenant, true)
	c.failed(now.Add(500*time.Millisecond), 0, tenant, true)
	require.Equal(t, 1, holds)
	require.Equal(t, now.Add(time.Second), c.reopensAt(tenant))
}

// TestEndedHoldsAreDroppedOnceACoolDown: an answer drops the holds whose
// cool-down has ended (their tenants' calls then go freely, no longer one
// probe at a time), at most once a cool-down however many answers come, and
// never a hold whose probe is out: its failure doubles the hold.
func TestEndedHoldsAreDroppedOnceACoolDown(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: 10 * time.Second}, nil, nil)
	t0 := time.Now()
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	first, second := uuid.New(), uuid.New()
	// goFreely says whether two of tenant's calls may go at once.
	goFreely := func(now time.Time, tenant uuid.UUID) bool {
		ok1, _ := c.allow(now, tenant)
		ok2, _ := c.allow(now, tenant)
		if ok1 && !ok2 {
			c.released(tenant)
		}
		return ok1 && ok2
	}

	c.failed(t0, 0, first, true) // held until 1 s
	c.succeededAt(t0, uuid.New())
	c.failed(at(500*time.Millisecond), 0, second, true) // held until 1.5 s
	c.succeededAt(at(1200*time.Millisecond), uuid.New())
	require.True(t, goFreely(at(1200*time.Millisecond), first), "the first hold, ended, was dropped")

	c.succeededAt(at(1600*time.Millisecond), uuid.New())
	require.False(t, goFreely(at(1600*time.Millisecond), second), "the second, ended since, is kept until a cool-down after the last drop")

	ok, _ := c.allow(at(2300*time.Millisecond), second)
	require.True(t, ok, "the second hold's probe")
	c.succeededAt(at(2300*time.Millisecond), uuid.New())
	c.failed(at(2300*time.Millisecond), 0, second, true)
	require.Equal(t, at(4300*time.Millisecond), c.reopensAt(second), "the hold, probing, was kept: its probe's failure doubled it")
}

// TestAProbeLeftUnansweredIsFreed: a probe whose caller went away frees its
// slot, the circuit's and a held tenant's, for the next call.
func TestAProbeLeftUnansweredIsFreed(t *testing.T) {
	t.Parallel()
	c := newCircuit(CircuitConfig{Failures: 1, Cooldown: time.Second, MaxCooldown: time.Second}, nil, nil)
	now := time.Now()
	tenant := uuid.New()
	c.failed(now, 0, tenant, true)
	later := now.Add(time.Second)
	for _, probe := range []uuid.UUID{tenant, uuid.Nil} {
		if probe == uuid.Nil {
			c.failed(later, 0, uuid.Nil, false) // opens the circuit
			later = later.Add(time.Second)
			probe = uuid.New()
		}
		ok, _ := c.allow(later, probe)
		require.True(t, ok)
		ok, _ = c.allow(later, probe)
		require.False(t, ok, "one probe at a time")
		c.released(probe)
		ok, _ = c.allow(later, probe)
		require.True(t, ok, "the probe's caller went away: the next call probes")
	}
}
