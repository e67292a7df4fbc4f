package ratelimit_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// countingStore counts the lease statements a limiter sends.
type countingStore struct {
	*store.Store
	leases atomic.Int64
}

func (c *countingStore) LeaseRate(ctx context.Context, keyID uuid.UUID, now time.Time, limit, share int) (store.RateGrant, error) {
	c.leases.Add(1)
	return c.Store.LeaseRate(ctx, keyID, now, limit, share)
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
// then counted without the database, until the slice runs out.
func TestSlicesAreServedFromMemory(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	c := &clock{at: time.Now().Truncate(time.Minute).Add(time.Second)}
	l := ratelimit.New(ratelimit.Config{Limits: gateway.RateLimits{Free: 1600, Developer: 1600}, Clock: c.now}, st)
	key := uuid.Must(uuid.NewV7())
	for i := range 100 {
		r, err := l.Take(context.Background(), key, gateway.TierDeveloper)
		require.NoError(t, err)
		require.True(t, r.Admitted)
		require.Equal(t, 1600-i-1, r.Remaining)
	}
	require.Equal(t, int64(1), st.leases.Load(), "a slice of 1/16 of 1,600 serves 100 requests")
	_, err := l.Take(context.Background(), key, gateway.TierDeveloper)
	require.NoError(t, err)
	require.Equal(t, int64(2), st.leases.Load())

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

	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); a.Run(ctx) }()
	c.set(c.now().Add(5 * time.Second)) // a's slice is idle
	require.Eventually(t, func() bool {
		c.set(c.now().Add(ratelimit.DefaultRetryRefused)) // b asks the database again
		r, err := b.Take(context.Background(), key, gateway.TierDeveloper)
		require.NoError(t, err)
		return r.Admitted
	}, 10*time.Second, 50*time.Millisecond)
	stop()
	<-done
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
