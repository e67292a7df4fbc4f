package ratelimit_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/stagger"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// countingStore counts the lease statements a limiter sends and those
// answered; while holding is set, it holds each at gate until gate is closed
// (or, so that a limiter that waited for one fails its test rather than hang
// it, for ten seconds).
type countingStore struct {
	*store.Store
	leases, ahead, answered atomic.Int64
	holding                 atomic.Bool
	gate                    chan struct{}
	// failing fails the leases of this minute, as a database away does.
	failing atomic.Bool
}

func (c *countingStore) hold() {
	if c.holding.Load() {
		select {
		case <-c.gate:
		case <-time.After(10 * time.Second):
		}
	}
}

func (c *countingStore) LeaseRate(ctx context.Context, keyID uuid.UUID, now time.Time, limit, share int) (store.RateGrant, error) {
	c.leases.Add(1)
	defer c.answered.Add(1)
	c.hold()
	if c.failing.Load() {
		return store.RateGrant{}, errors.New("the database is away")
	}
	return c.Store.LeaseRate(ctx, keyID, now, limit, share)
}

func (c *countingStore) LeaseRateAhead(ctx context.Context, keyID uuid.UUID, window time.Time, limit, share int) (store.RateGrant, error) {
	c.leases.Add(1)
	c.ahead.Add(1)
	defer c.answered.Add(1)
	c.hold()
	return c.Store.LeaseRateAhead(ctx, keyID, window, limit, share)
}

// settled waits until every lease sent is answered.
func (c *countingStore) settled(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return c.answered.Load() == c.leases.Load() }, 10*time.Second, time.Millisecond)
}

// clock is a settable time.
type clock struct {
	mu sync.Mutex
	at time.Time
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.at
}

func (c *clock) set(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.at = at
}

// running runs l until the test ends.
func running(t *testing.T, l *ratelimit.Limiter) {
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
}

// leaves is what the minute of at leaves key of limit, asked at at: all of
// it leased by probe and given back at once.
func leaves(t *testing.T, probe *store.Store, key uuid.UUID, at time.Time, limit int) int {
	t.Helper()
	g, err := probe.LeaseRate(context.Background(), key, at, limit, 1)
	require.NoError(t, err)
	require.NoError(t, probe.ReturnRate(context.Background(), []store.RateReturn{{KeyID: key, Window: at.UTC().Truncate(time.Minute), Count: g.Granted}}))
	return g.Granted
}

// TestLimitAcrossReplicas: three replicas serving one key, every one of them
// asked until it refuses, admit the limit together, never more.
func TestLimitAcrossReplicas(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	c := &clock{at: time.Now().Truncate(time.Minute).Add(30 * time.Second)}
	limits := gateway.RateLimits{Free: 3, Developer: 50}
	replicas := make([]*ratelimit.Limiter, 3)
	for i := range replicas {
		replicas[i] = ratelimit.New(ratelimit.Config{Limits: limits, Clock: c.now}, store.New(testdb.Connect(t, url)))
	}
	key := uuid.Must(uuid.NewV7())
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := range 300 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := replicas[i%3].Take(context.Background(), key, gateway.TierDeveloper)
			require.NoError(t, err)
			require.Equal(t, 50, r.Limit)
			if r.Admitted {
				admitted.Add(1)
				return
			}
			require.Zero(t, r.Remaining)
			require.Positive(t, r.RetryAfter)
		}()
	}
	wg.Wait()
	require.Equal(t, int64(50), admitted.Load(), "three replicas together admit the limit, not three times it")

	r, err := replicas[0].Take(context.Background(), uuid.Must(uuid.NewV7()), gateway.TierFree)
	require.NoError(t, err)
	require.Equal(t, 3, r.Limit)
	require.Equal(t, 2, r.Remaining)
}

// TestSlicesAreServedFromMemory: a key's requests lease a slice once and are
// then counted without the database; the slice is refilled in the background
// once a quarter of it is left, and the requests go on from what is left
// meanwhile.
func TestSlicesAreServedFromMemory(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t)), gate: make(chan struct{})}
	c := &clock{at: time.Now().Truncate(time.Minute).Add(time.Second)}
	l := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 1600, Developer: 1600}, Clock: c.now}, st)
	key := uuid.Must(uuid.NewV7())
	take := func() gateway.RateStatus {
		r, err := l.Take(context.Background(), key, gateway.TierDeveloper)
		require.NoError(t, err)
		require.True(t, r.Admitted)
		return r
	}
	take()
	require.Equal(t, int64(1), st.leases.Load(), "a slice of 1/16 of 1,600: 100 requests")
	st.holding.Store(true)
	for i := 1; i < 100; i++ {
		require.Equal(t, 1600-i-1, take().Remaining)
		if i < 75 {
			require.Equal(t, int64(1), st.leases.Load(), "served from memory")
		}
	}
	require.Eventually(t, func() bool { return st.leases.Load() == 2 }, 10*time.Second, time.Millisecond, "the refill started at 24 left")
	require.Equal(t, int64(1), st.answered.Load(), "the requests after it went on while it was held")
	st.holding.Store(false)
	close(st.gate)
	st.settled(t)
	for range 50 {
		take()
	}
	require.Equal(t, int64(2), st.leases.Load(), "the refill of 1/16 of 1,500 serves the next 93")

	// Refused keys are answered from memory for a while too.
	tiny := uuid.Must(uuid.NewV7())
	free := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 1, Developer: 1}, Clock: c.now}, st)
	before := st.leases.Load()
	for range 10 {
		_, err := free.Take(context.Background(), tiny, gateway.TierFree)
		require.NoError(t, err)
	}
	require.Equal(t, int64(2), st.leases.Load()-before, "one grant, one refusal, then memory")
}

// TestAFailedRefillWaitsBeforeTheNext: a refill that fails (the database
// away) is not started again by the next request, nor by each after it, only
// once RetryRefused has passed: the requests go on from what is left without
// a lease statement each.
func TestAFailedRefillWaitsBeforeTheNext(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 1600, 0)
	for range 75 { // of a slice of 100
		require.True(t, k.take(t, 45*time.Second).Admitted)
	}
	k.st.failing.Store(true)
	require.True(t, k.take(t, 45*time.Second).Admitted) // the refill starts at 24 left
	require.Eventually(t, func() bool { return k.st.leases.Load() == 2 && !k.l.Leasing(k.key) }, 10*time.Second, time.Millisecond, "the refill failed")
	for range 10 {
		require.True(t, k.take(t, 45*time.Second).Admitted, "from what is left")
		require.False(t, k.l.Leasing(k.key), "no refill again within RetryRefused")
	}
	require.True(t, k.take(t, 45*time.Second+ratelimit.DefaultRetryRefused).Admitted)
	require.Eventually(t, func() bool { return k.st.leases.Load() == 3 }, 10*time.Second, time.Millisecond, "then one")
}

// TestALeaseThatFailsFailsForAllWhoWaitOnIt: while the database does not
// answer, the requests of a key that wait for the lease in flight fail with
// it, instead of each sending one more lease in turn after it (each waiting
// for all the failures before its own).
func TestALeaseThatFailsFailsForAllWhoWaitOnIt(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.Connect(t, testdb.Unanswering(t)))}
	l := ratelimit.New(ratelimit.Config{}, st)
	key := uuid.Must(uuid.NewV7())
	const requests = 8
	errs := make(chan error, requests)
	take := func() {
		_, err := l.Take(context.Background(), key, gateway.TierDeveloper)
		errs <- err
	}
	go take()
	require.Eventually(t, func() bool { return st.leases.Load() == 1 }, 10*time.Second, time.Millisecond)
	for range requests - 1 {
		go take()
	}
	for range requests {
		require.ErrorIs(t, <-errs, context.DeadlineExceeded)
	}
	require.Equal(t, int64(1), st.leases.Load(), "one lease for all")
}

// TestUnusedSlicesAreReturned: a replica that stops seeing a key gives its
// unused slice back, and another replica can use it.
func TestUnusedSlicesAreReturned(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	c := &clock{at: time.Now().Truncate(time.Minute).Add(time.Second)}
	cfg := ratelimit.Config{Limits: gateway.RateLimits{Free: 32, Developer: 32}, Clock: c.now, Idle: time.Millisecond, Share: 1}
	a := ratelimit.New(cfg, store.New(testdb.Connect(t, url)))
	b := ratelimit.New(cfg, store.New(testdb.Connect(t, url)))
	key := uuid.Must(uuid.NewV7())
	r, err := a.Take(context.Background(), key, gateway.TierDeveloper)
	require.NoError(t, err)
	require.True(t, r.Admitted, "a takes the whole minute as its slice")
	r, err = b.Take(context.Background(), key, gateway.TierDeveloper)
	require.NoError(t, err)
	require.False(t, r.Admitted, "b finds nothing left")

	running(t, a)
	c.set(c.now().Add(5 * time.Second)) // a's slice is idle
	require.Eventually(t, func() bool {
		c.set(c.now().Add(ratelimit.DefaultRetryRefused)) // b asks the database again
		r, err := b.Take(context.Background(), key, gateway.TierDeveloper)
		require.NoError(t, err)
		return r.Admitted
	}, 10*time.Second, 50*time.Millisecond)
}

// TestSlidingWindow: the previous minute counts by how much of it still
// overlaps the last 60 s.
func TestSlidingWindow(t *testing.T) {
	t.Parallel()
	minute := time.Now().Truncate(time.Minute)
	c := &clock{}
	l := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 10, Developer: 10}, Clock: c.now}, store.New(testdb.New(t)))
	key := uuid.Must(uuid.NewV7())
	count := func(at time.Time, n int) (admitted int) {
		c.set(at)
		for range n {
			r, err := l.Take(context.Background(), key, gateway.TierDeveloper)
			require.NoError(t, err)
			if r.Admitted {
				admitted++
			}
		}
		return admitted
	}
	require.Equal(t, 10, count(minute.Add(50*time.Second), 12), "the limit within a minute")
	// 15 s into the next minute, 3/4 of the previous minute still counts: 7.5 used.
	require.Equal(t, 2, count(minute.Add(75*time.Second), 5))
	// Two minutes later only the new window's own requests count.
	require.Equal(t, 8, count(minute.Add(180*time.Second), 8))
}

// TestRetryAfterIsWhenTheWindowAdmits: a refused request is told how long
// until the sliding window admits one more. Asked again that many whole
// seconds later (as a Retry-After header says it), the key is admitted; a
// second sooner, it is refused. The end of the minute, which it was told
// before, is too soon after a burst early in a minute (the minute weighs all
// of it then) and most of a minute too late when the minute before weighs.
func TestRetryAfterIsWhenTheWindowAdmits(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.New(t))
	minute := time.Now().Truncate(time.Minute)
	for _, tt := range []struct {
		name string
		// bursts are the instants, after minute, at which the key takes
		// until it is refused; the last refusal is the one checked.
		bursts []time.Duration
		want   int // Retry-After, in seconds
	}{
		{"a burst early in a minute", []time.Duration{2500 * time.Millisecond}, 68},
		{"a burst late in a minute", []time.Duration{59700 * time.Millisecond}, 11},
		{"the minute before weighs", []time.Duration{50 * time.Second, 70500 * time.Millisecond}, 10},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := &clock{}
			l := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 6, Developer: 6}, Clock: c.now}, st)
			key := uuid.Must(uuid.NewV7())
			take := func() gateway.RateStatus {
				r, err := l.Take(context.Background(), key, gateway.TierDeveloper)
				require.NoError(t, err)
				return r
			}
			var refused gateway.RateStatus
			for _, at := range tt.bursts {
				c.set(minute.Add(at))
				for refused = take(); refused.Admitted; refused = take() {
				}
			}
			retry := gateway.RateLimitedError(refused).RetryAfterSeconds() // as the header says it
			require.Equal(t, tt.want, retry)
			last := minute.Add(tt.bursts[len(tt.bursts)-1])
			c.set(last.Add(time.Duration(retry-1) * time.Second))
			require.False(t, take().Admitted, "a second sooner")
			c.set(last.Add(time.Duration(retry) * time.Second))
			require.True(t, take().Admitted, "at the second it was told")
		})
	}
}

// oneKey is a limiter over a database of its own, on a clock set 45 s into a
// minute, and the key its test takes for.
type oneKey struct {
	url    string // the database's
	st     *countingStore
	minute time.Time
	c      *clock
	l      *ratelimit.Limiter
	key    uuid.UUID
}

// setupOneKey starts a oneKey whose limiter has limit and share (0: the
// default).
func setupOneKey(t *testing.T, limit, share int) *oneKey {
	t.Helper()
	k := &oneKey{url: testdb.URL(t), minute: time.Now().Truncate(time.Minute), key: uuid.Must(uuid.NewV7())}
	k.st = &countingStore{Store: store.New(testdb.Connect(t, k.url))}
	k.c = &clock{at: k.minute.Add(45 * time.Second)}
	k.l = ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: limit, Developer: limit}, Clock: k.c.now, Share: share}, k.st)
	return k
}

// take counts a request of the key at the time into its minute given.
func (k *oneKey) take(t *testing.T, at time.Duration) gateway.RateStatus {
	t.Helper()
	k.c.set(k.minute.Add(at))
	r, err := k.l.Take(context.Background(), k.key, gateway.TierDeveloper)
	require.NoError(t, err)
	return r
}

// TestASliceLeasedAheadOfAMinuteSkippedIsReturned: a key leases its next
// minute's slice, then is not used until a minute later than that one; the
// slice, of a minute now past, is returned with the rest as the key's bucket
// turns, not dropped (its minute would go on counting it).
func TestASliceLeasedAheadOfAMinuteSkippedIsReturned(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 32, 2)
	k.leaseAhead(t)
	k.take(t, 2*time.Minute+30*time.Second) // 14 of the minute after the next (the 8 not yet back weigh 4)
	// Only now: had the returns run meanwhile, the key idle would have
	// returned everything anyway.
	running(t, k.l)
	probe := store.New(testdb.Connect(t, k.url))
	require.Eventually(t, func() bool {
		// The skipped minute at its middle: the 2 requests of the minute
		// before weigh 1, and the 14 held of the minute after leave 18 (10
		// were its 8 still counted).
		return leaves(t, probe, k.key, k.minute.Add(90*time.Second), 32) == 18
	}, 10*time.Second, 50*time.Millisecond)
}

// TestAnIdleKeysLeaseInFlightIsReturnedWithTheRest: a key gone idle while
// a refill of its slice is in flight keeps its bucket until the refill has
// landed, so that what it grants is returned with the rest rather than held
// by a bucket no longer kept.
func TestAnIdleKeysLeaseInFlightIsReturnedWithTheRest(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 32, 2)
	k.st.gate = make(chan struct{})
	k.take(t, 10*time.Second) // 16 of the minute
	k.st.holding.Store(true)
	for range 12 { // the refill starts at 3 left, and is held
		k.take(t, 10*time.Second)
	}
	require.Eventually(t, func() bool { return k.st.leases.Load() == 2 }, 10*time.Second, time.Millisecond)
	k.c.set(k.minute.Add(40 * time.Second)) // the key idle
	k.l.Flush(context.Background())
	k.st.holding.Store(false)
	close(k.st.gate)
	k.st.settled(t)
	require.Eventually(t, func() bool { return !k.l.Leasing(k.key) }, 10*time.Second, time.Millisecond)
	k.l.Flush(context.Background())
	probe := store.New(testdb.Connect(t, k.url))
	require.Equal(t, 32-13, leaves(t, probe, k.key, k.minute.Add(50*time.Second), 32), "the minute counts its 13 requests, nothing held")
}

// TestAGrantThatLandsAfterItsMinuteIsReturned: a lease in flight as its
// minute ends lands in a bucket that has turned to the next; what it granted
// is returned to its minute, not held or lost there.
func TestAGrantThatLandsAfterItsMinuteIsReturned(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 32, 1)
	k.st.gate = make(chan struct{})
	running(t, k.l)
	var takes sync.WaitGroup
	take := func() {
		defer takes.Done()
		_, err := k.l.Take(context.Background(), k.key, gateway.TierDeveloper)
		require.NoError(t, err)
	}
	k.st.holding.Store(true)
	k.c.set(k.minute.Add(59900 * time.Millisecond))
	takes.Add(1)
	go take() // its lease, of the whole minute, held
	require.Eventually(t, func() bool { return k.st.leases.Load() == 1 }, 10*time.Second, time.Millisecond)
	k.c.set(k.minute.Add(time.Minute + 500*time.Millisecond))
	takes.Add(1)
	go take() // the bucket turns to the next minute
	require.Eventually(t, func() bool { return k.l.Window(k.key).Equal(k.minute.Add(time.Minute)) }, 10*time.Second, time.Millisecond)
	k.st.holding.Store(false)
	close(k.st.gate)
	takes.Wait()

	probe := store.New(testdb.Connect(t, k.url))
	require.Eventually(t, func() bool {
		return leaves(t, probe, k.key, k.minute.Add(59950*time.Millisecond), 32) == 32
	}, 10*time.Second, 50*time.Millisecond, "the grant that landed late went back to its minute")
}

// leaseAhead takes a request of the key 45 s into its minute and one at 55
// s, and waits until the second's lease of the next minute has landed: under
// a limit of 32 in slices of half what is left, 16 of this minute and 8 of
// the next.
func (k *oneKey) leaseAhead(t *testing.T) {
	t.Helper()
	k.take(t, 45*time.Second)
	k.take(t, 55*time.Second)
	require.Eventually(t, func() bool { return k.st.ahead.Load() == 1 }, 10*time.Second, time.Millisecond)
	k.st.settled(t)
}

// TestTheNextMinuteIsLeasedAhead: a key in use in the last seconds of a
// minute leases its slice of the next one ahead, so that its first request
// of the new minute is admitted from memory.
func TestTheNextMinuteIsLeasedAhead(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 1600, 0)
	require.Equal(t, 1599, k.take(t, 45*time.Second).Remaining, "a slice of 100")
	require.False(t, k.l.Leasing(k.key), "15 s before the minute ends: not yet")
	require.True(t, k.take(t, 55*time.Second).Admitted)
	require.True(t, k.l.Leasing(k.key), "within 5 s of its end, every key's lead")
	require.Eventually(t, func() bool { return k.st.ahead.Load() == 1 }, 10*time.Second, time.Millisecond)
	k.st.settled(t)
	require.Equal(t, 97+1600-100-93, k.take(t, 55*time.Second).Remaining, "the next minute's 93 are room this one no longer has")
	require.Equal(t, int64(2), k.st.leases.Load(), "once a minute")

	require.True(t, k.take(t, time.Minute).Admitted)
	require.Equal(t, int64(2), k.st.leases.Load(), "the new minute's first request is admitted from the slice leased ahead")
}

// TestEachKeyLeasesAheadFromAnInstantOfItsOwn: a key leases its next minute
// ahead from the instant of DefaultAhead's first half that its id sets
// (stagger.Lead), not before: the keys in use do not all lease as the last
// seconds of a minute start.
func TestEachKeyLeasesAheadFromAnInstantOfItsOwn(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 1600, 0)
	lead := stagger.Lead(k.key, ratelimit.DefaultAhead)
	require.True(t, k.take(t, 45*time.Second).Admitted)
	require.True(t, k.take(t, time.Minute-lead-time.Millisecond).Admitted)
	require.False(t, k.l.Leasing(k.key), "a millisecond before its instant")
	require.True(t, k.take(t, time.Minute-lead).Admitted)
	require.True(t, k.l.Leasing(k.key), "from its instant")
	require.Eventually(t, func() bool { return k.st.ahead.Load() == 1 }, 10*time.Second, time.Millisecond)
	k.st.settled(t)
}

// TestARefusalWaitsForTheNextMinuteLeasedAhead: a key refused after its
// next minute's slice was leased ahead is told to retry once that minute
// leaves it room, not as this one's count would: its minute leaves room for
// the next minute's slices, so none of it comes back before the turn.
func TestARefusalWaitsForTheNextMinuteLeasedAhead(t *testing.T) {
	t.Parallel()
	k := setupOneKey(t, 32, 2)
	k.leaseAhead(t)
	admitted := 2
	for r := k.take(t, 55*time.Second); r.Admitted; r = k.take(t, 55*time.Second) {
		admitted++
		require.Less(t, admitted, 32)
	}
	require.Equal(t, 24, admitted, "this minute leaves the next one's 8")
	// The next minute admits one once this one's 24 weigh 23: 2.5 s into it.
	require.Equal(t, 7500*time.Millisecond, k.take(t, 55*time.Second).RetryAfter)
}

// TestASliceLeasedAheadIsReturnedUnused: a key that stops being used after its
// next minute's slice was leased gives it back with the rest.
func TestASliceLeasedAheadIsReturnedUnused(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	minute := time.Now().Truncate(time.Minute)
	c := &clock{at: minute.Add(55 * time.Second)}
	st := &countingStore{Store: store.New(testdb.Connect(t, url))}
	limits := gateway.RateLimits{Free: 32, Developer: 32}
	a := ratelimit.New(ratelimit.Config{Limits: limits, Clock: c.now, Idle: time.Millisecond, Share: 2}, st)
	key := uuid.Must(uuid.NewV7())
	_, err := a.Take(context.Background(), key, gateway.TierDeveloper)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return st.ahead.Load() == 1 }, 10*time.Second, time.Millisecond, "16 of this minute, then 8 of the next")
	st.settled(t)

	running(t, a)
	c.set(minute.Add(90 * time.Second)) // a's slices are idle
	probe := store.New(testdb.Connect(t, url))
	require.Eventually(t, func() bool {
		// Half of the minute before (its one request) and nothing of this one.
		return leaves(t, probe, key, c.now(), 32) == 31
	}, 10*time.Second, 50*time.Millisecond)
}

// TestALeaseInFlightAtShutdownIsReturned: a limiter that stops while a lease
// ahead is in flight waits for it, then returns its slice with the rest.
func TestALeaseInFlightAtShutdownIsReturned(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	minute := time.Now().Truncate(time.Minute)
	c := &clock{at: minute.Add(45 * time.Second)}
	st := &countingStore{Store: store.New(testdb.Connect(t, url)), gate: make(chan struct{})}
	l := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 32, Developer: 32}, Clock: c.now, Share: 2}, st)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx) }()
	key := uuid.Must(uuid.NewV7())
	take := func() {
		_, err := l.Take(context.Background(), key, gateway.TierDeveloper)
		require.NoError(t, err)
	}
	take() // 16 of this minute
	st.holding.Store(true)
	c.set(minute.Add(55 * time.Second))
	take() // and 8 of the next, held
	require.Eventually(t, func() bool { return st.ahead.Load() == 1 }, 10*time.Second, time.Millisecond)
	stop()
	close(st.gate)
	<-done
	require.Equal(t, int64(2), st.answered.Load())
	g, err := st.LeaseRateAhead(context.Background(), key, minute.Add(time.Minute), 32, 1)
	require.NoError(t, err)
	require.Equal(t, store.RateGrant{Granted: 30, Used: 32, Previous: 2, Current: 30}, g,
		"the minute's two requests left, nothing of the next minute held")
}

// TestLimitAcrossTheTurnOfAMinute: three replicas serving one key lease
// slices of the next minute ahead, then are asked until they refuse in the
// last seconds of a minute and again as the next one starts (when the sliding
// window weighs the first whole): over both they admit the limit, no more.
func TestLimitAcrossTheTurnOfAMinute(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	minute := time.Now().Truncate(time.Minute)
	c := &clock{at: minute.Add(55 * time.Second)}
	limits := gateway.RateLimits{Free: 3, Developer: 500}
	stores := make([]*countingStore, 3)
	replicas := make([]*ratelimit.Limiter, 3)
	for i := range replicas {
		stores[i] = &countingStore{Store: store.New(testdb.Connect(t, url))}
		replicas[i] = ratelimit.New(ratelimit.Config{Limits: limits, Clock: c.now}, stores[i])
	}
	key := uuid.Must(uuid.NewV7())
	var admitted atomic.Int64
	burst := func(n int) {
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, err := replicas[i%3].Take(context.Background(), key, gateway.TierDeveloper)
				require.NoError(t, err)
				if r.Admitted {
					admitted.Add(1)
				}
			}()
		}
		wg.Wait()
	}
	burst(30)
	require.Eventually(t, func() bool {
		var ahead int64
		for _, st := range stores {
			ahead += st.ahead.Load()
		}
		return ahead == 3
	}, 10*time.Second, time.Millisecond, "each replica leases its slice of the next minute")
	for _, st := range stores {
		st.settled(t)
	}
	c.set(minute.Add(56 * time.Second))
	burst(600)
	// Then until one admits nothing: a refill granted as a burst ends lands
	// after its last request, and is not returned here (nothing runs the
	// returns), so that the minute, which weighs whole as the next starts,
	// would leave the next less than the slices leased ahead.
	for {
		for _, st := range stores {
			st.settled(t)
		}
		before := admitted.Load()
		burst(30)
		if admitted.Load() == before {
			break
		}
	}
	c.set(minute.Add(time.Minute))
	burst(600)
	require.Equal(t, int64(500), admitted.Load(), "at the start of a minute the one before weighs whole: the limit over both, not more")
}
