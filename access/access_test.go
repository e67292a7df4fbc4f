package access_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/access"
	"github.com/rungworks/gateway/apikey"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// countingStore counts key lookups that reach the database.
type countingStore struct {
	*store.Store
	lookups atomic.Int64
}

func (c *countingStore) LookupKey(ctx context.Context, token string) (*gateway.Principal, error) {
	c.lookups.Add(1)
	return c.Store.LookupKey(ctx, token)
}

// replica is one replica's key cache, listening until the test ends; changes
// it hears of are sent on the returned channel.
func replica(t *testing.T, st access.KeyStore) (*access.Keys, <-chan string) {
	t.Helper()
	return replicaWith(t, st, access.Config{})
}

// replicaWith is replica with a configuration of its own; its OnChange, if
// any, is called too.
func replicaWith(t *testing.T, st access.KeyStore, cfg access.Config) (*access.Keys, <-chan string) {
	t.Helper()
	changes := make(chan string, 100)
	onChange := cfg.OnChange
	cfg.OnChange = func(table string, account uuid.UUID) {
		if onChange != nil {
			onChange(table, account)
		}
		if table != "" {
			changes <- table
		}
	}
	keys := access.NewKeys(cfg, st)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); keys.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
	require.Eventually(t, keys.Listening, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, keys.Ready(context.Background()))
	return keys, changes
}

// awaitChange waits until a replica hears of a change to table (api_keys
// for a revocation), the next change it hears of.
func awaitChange(t *testing.T, changes <-chan string, table string) {
	t.Helper()
	select {
	case heard := <-changes:
		require.Equal(t, table, heard)
	case <-time.After(10 * time.Second):
		t.Fatalf("the change to %s was never announced", table)
	}
}

// refused requires token to be refused by keys.
func refused(t *testing.T, keys *access.Keys, token, msg string) {
	t.Helper()
	_, err := keys.Lookup(context.Background(), token)
	require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err), msg)
}

func newKey(t *testing.T, st *store.Store, account string, tier gateway.Tier) string {
	t.Helper()
	token, err := st.CreateKey(context.Background(), store.CreateKeyParams{Account: account, Project: "default", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	return token
}

// gatedStore holds each key lookup, once armed, until released, and counts
// the lookups in flight and their most at once.
type gatedStore struct {
	*store.Store
	armed             atomic.Bool
	release           chan struct{}
	inFlight, mostNow atomic.Int64
}

func (g *gatedStore) LookupKey(ctx context.Context, token string) (*gateway.Principal, error) {
	if g.armed.Load() {
		n := g.inFlight.Add(1)
		defer g.inFlight.Add(-1)
		for most := g.mostNow.Load(); n > most && !g.mostNow.CompareAndSwap(most, n); most = g.mostNow.Load() {
		}
		<-g.release
	}
	return g.Store.LookupKey(ctx, token)
}

// TestLookupsInFlightAreBounded: a flood of keys the cache does not know
// holds at most MaxLookups lookups (and database connections) at once, the
// others waiting their turn; a cached key is served meanwhile, and a lookup
// waiting for its turn ends with its context. A cache not in use bounds
// nothing.
func TestLookupsInFlightAreBounded(t *testing.T) {
	t.Parallel()
	st := &gatedStore{Store: store.New(testdb.New(t)), release: make(chan struct{})}
	keys, _ := replicaWith(t, st, access.Config{MaxLookups: 2})
	known := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	_, err := keys.Lookup(context.Background(), known)
	require.NoError(t, err)

	st.armed.Store(true)
	errs := lookUpMadeUp(t, keys, 6)
	require.Eventually(t, func() bool { return st.inFlight.Load() == 2 }, 5*time.Second, time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p, err := keys.Lookup(ctx, known)
	require.NoError(t, err, "a cached key waits for no lookup")
	require.Equal(t, "acme", p.AccountName)
	waiting, stop := context.WithCancel(context.Background())
	stop()
	another, err := apikey.Generate()
	require.NoError(t, err)
	_, err = keys.Lookup(waiting, another.Token)
	require.ErrorIs(t, err, context.Canceled)

	close(st.release)
	refusedAll(t, errs)
	require.Equal(t, int64(2), st.mostNow.Load())

	// A cache not in use (its replica not listening) looks every request up,
	// unbounded: a bound would bound the replica's requests.
	st.release = make(chan struct{})
	errs = lookUpMadeUp(t, access.NewKeys(access.Config{MaxLookups: 2}, st), 4)
	require.Eventually(t, func() bool { return st.inFlight.Load() == 4 }, 5*time.Second, time.Millisecond)
	close(st.release)
	refusedAll(t, errs)
}

// TestALookupTheDatabaseDoesNotAnswerFails: a key looked up on a database
// that does not answer fails at the lookup's bound, transient (503), instead
// of holding the request for as long as the database does not answer.
func TestALookupTheDatabaseDoesNotAnswerFails(t *testing.T) {
	t.Parallel()
	keys := access.NewKeys(access.Config{}, store.New(testdb.Connect(t, testdb.Unanswering(t))))
	key, err := apikey.Generate()
	require.NoError(t, err)
	_, err = keys.Lookup(context.Background(), key.Token)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, store.Transient(err))
}

// lookUpMadeUp starts n lookups of made-up keys, whose outcomes arrive on
// the returned channel.
func lookUpMadeUp(t *testing.T, keys *access.Keys, n int) <-chan error {
	t.Helper()
	errs := make(chan error, n)
	for range n {
		madeUp, err := apikey.Generate()
		require.NoError(t, err)
		go func() {
			_, err := keys.Lookup(context.Background(), madeUp.Token)
			errs <- err
		}()
	}
	return errs
}

// refusedAll waits for every lookup of errs, each refused.
func refusedAll(t *testing.T, errs <-chan error) {
	t.Helper()
	for range cap(errs) {
		require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(<-errs))
	}
}

// TestKeysAreServedFromMemory: a key is looked up once, then served from the
// cache.
func TestKeysAreServedFromMemory(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	keys, _ := replica(t, st)
	token := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	for range 50 {
		p, err := keys.Lookup(context.Background(), token)
		require.NoError(t, err)
		require.Equal(t, "acme", p.AccountName)
	}
	require.Equal(t, int64(1), st.lookups.Load())
}

// TestRefusedKeysAreRefusedFromMemory: a key the database does not know, or
// no longer accepts (revoked), is looked up once and then refused from the
// cache, so a client that repeats it costs no lookup; a malformed one is
// never looked up. A valid key is served all the while.
func TestRefusedKeysAreRefusedFromMemory(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	// Made before the replica listens: it hears of the revocation alone.
	token := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	revoked := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	keys, changes := replica(t, st)
	refuse := func(key string) {
		t.Helper()
		for range 3 {
			refused(t, keys, key, "refused at each try")
		}
	}

	refuse("igw_unknown") // malformed: no lookup
	require.Zero(t, st.lookups.Load())
	unknown := token[:20] + map[bool]string{true: "a", false: "b"}[token[20] != 'a'] + token[21:] // its prefix, not its secret
	refuse(unknown)
	require.Equal(t, int64(1), st.lookups.Load(), "an unknown key is looked up once")

	_, err := keys.Lookup(context.Background(), revoked)
	require.NoError(t, err)
	require.NoError(t, st.RevokeKey(context.Background(), revoked[:12]))
	awaitChange(t, changes, "api_keys")
	refuse(revoked)
	require.Equal(t, int64(3), st.lookups.Load(), "a revoked key is looked up once after its revocation")

	_, err = keys.Lookup(context.Background(), token)
	require.NoError(t, err)
	require.Equal(t, int64(4), st.lookups.Load())
}

// TestNothingIsCachedWithoutListening: a replica that cannot hear of changes
// asks the database every time, and is not ready until it has listened.
func TestNothingIsCachedWithoutListening(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	keys := access.NewKeys(access.Config{}, st)
	require.ErrorIs(t, keys.Ready(context.Background()), access.ErrNotListening)
	token := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	for range 5 {
		_, err := keys.Lookup(context.Background(), token)
		require.NoError(t, err)
	}
	require.Equal(t, int64(5), st.lookups.Load())
}

// TestRevokedKeyIsRefusedByEveryReplica: two replicas have the key cached;
// once the revocation is announced, both refuse it.
func TestRevokedKeyIsRefusedByEveryReplica(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	admin := store.New(testdb.Connect(t, url))
	a, aChanges := replica(t, store.New(testdb.Connect(t, url)))
	b, bChanges := replica(t, store.New(testdb.Connect(t, url)))
	token := newKey(t, admin, "acme", gateway.TierDeveloper)
	for _, keys := range []*access.Keys{a, b} {
		_, err := keys.Lookup(context.Background(), token)
		require.NoError(t, err)
	}
	require.NoError(t, admin.RevokeKey(context.Background(), token[:12]))
	for _, changes := range []<-chan string{aChanges, bChanges} {
		awaitChange(t, changes, "api_keys")
	}
	for _, keys := range []*access.Keys{a, b} {
		refused(t, keys, token, "revoked")
	}
}

// TestAChangeDropsItsAccountsKeysOnly: a key revoked drops the cached keys
// of its account, and the others' are served from memory still.
func TestAChangeDropsItsAccountsKeysOnly(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	admin := store.New(testdb.Connect(t, url))
	st := &countingStore{Store: store.New(testdb.Connect(t, url))}
	keys, changes := replica(t, st)
	kept := newKey(t, admin, "acme", gateway.TierDeveloper)
	dropped := newKey(t, admin, "globex", gateway.TierDeveloper)
	revoked := newKey(t, admin, "globex", gateway.TierDeveloper)
	for _, token := range []string{kept, dropped} {
		_, err := keys.Lookup(context.Background(), token)
		require.NoError(t, err)
	}
	require.Equal(t, int64(2), st.lookups.Load())
	require.NoError(t, admin.RevokeKey(context.Background(), revoked[:12]))
	awaitChange(t, changes, "api_keys")
	_, err := keys.Lookup(context.Background(), kept)
	require.NoError(t, err)
	require.Equal(t, int64(2), st.lookups.Load(), "another account's key is served from memory")
	_, err = keys.Lookup(context.Background(), dropped)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.lookups.Load(), "the account's other key is looked up again")
}

// TestTierChangeReachesTheCache: a changed tier (and so rate limit) is seen
// once the change is announced.
func TestTierChangeReachesTheCache(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.New(t))
	keys, changes := replica(t, st)
	token := newKey(t, st, "acme", gateway.TierDeveloper)
	p, err := keys.Lookup(context.Background(), token)
	require.NoError(t, err)
	require.Equal(t, gateway.TierDeveloper, p.Tier)
	newKey(t, st, "acme", gateway.TierFree) // an explicit tier changes the account's
	awaitChange(t, changes, "accounts")
	p, err = keys.Lookup(context.Background(), token)
	require.NoError(t, err)
	require.Equal(t, gateway.TierFree, p.Tier)
}

// TestEveryChangeToALimitOrAKeysEndIsAnnounced: a change to an account's
// daily ceiling, to a project's budget, or to a key's end (a rotation's
// grace) is announced naming the account, so that every replica drops its
// keys (and its ledger its slices) and reads the limits anew.
func TestEveryChangeToALimitOrAKeysEndIsAnnounced(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.New(t))
	type change struct {
		table   string
		account uuid.UUID
	}
	changes := make(chan change, 10)
	replicaWith(t, st, access.Config{OnChange: func(table string, account uuid.UUID) {
		if table != "" {
			changes <- change{table, account}
		}
	}})
	ctx := context.Background()
	token := newKey(t, st, "acme", gateway.TierDeveloper)
	p, err := st.LookupKey(ctx, token)
	require.NoError(t, err)
	daily, budget := int64(100), int64(50)
	announced := func(table string) {
		t.Helper()
		select {
		case c := <-changes:
			require.Equal(t, change{table, p.AccountID}, c)
		case <-time.After(10 * time.Second):
			t.Fatalf("the change to %s was never announced", table)
		}
	}
	require.NoError(t, st.SetLimits(ctx, store.SetLimitsParams{Account: "acme", DailyRungs: &daily}))
	announced("accounts")
	require.NoError(t, st.SetLimits(ctx, store.SetLimitsParams{Account: "acme", Project: "default", BudgetRungs: &budget}))
	announced("projects")
	_, err = st.RotateKey(ctx, token[:12], time.Hour, nil)
	require.NoError(t, err)
	announced("api_keys")
}

// TestAnExpiredKeyIsRefusedThoughCached: a cached key is served no longer
// than until it expires, however long the cache keeps entries; it is then
// looked up again, and refused.
func TestAnExpiredKeyIsRefusedThoughCached(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	keys, _ := replica(t, st)
	tier := gateway.TierDeveloper
	expires := time.Now().Add(time.Second)
	token, err := st.CreateKey(context.Background(), store.CreateKeyParams{
		Account: "acme", Project: "default", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}, ExpiresAt: &expires,
	})
	require.NoError(t, err)
	p, err := keys.Lookup(context.Background(), token)
	require.NoError(t, err)
	require.WithinDuration(t, expires, *p.KeyExpiresAt, time.Millisecond)
	_, err = keys.Lookup(context.Background(), token)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.lookups.Load(), "served from the cache while it is valid")

	require.Eventually(t, func() bool {
		_, err := keys.Lookup(context.Background(), token)
		return err != nil
	}, 10*time.Second, 20*time.Millisecond, "refused once expired, within the cache's 30 s")
	refused(t, keys, token, "expired")
}

// racingStore, once armed, reads a key and then holds its lookup until
// released, so that a change comes between the read and the cache's use of
// it; and it listens only when the test lets it (a value sent on listen for
// each listen), until interrupted.
type racingStore struct {
	*store.Store
	armed   atomic.Bool
	read    chan struct{}
	release chan struct{}
	listen  chan struct{}
	stop    atomic.Pointer[context.CancelFunc]
}

func newRacingStore(st *store.Store) *racingStore {
	return &racingStore{Store: st, read: make(chan struct{}, 1), release: make(chan struct{}), listen: make(chan struct{}, 1)}
}

func (r *racingStore) LookupKey(ctx context.Context, token string) (*gateway.Principal, error) {
	p, err := r.Store.LookupKey(ctx, token)
	if r.armed.CompareAndSwap(true, false) {
		r.read <- struct{}{}
		<-r.release
	}
	return p, err
}

func (r *racingStore) ListenPrincipals(ctx context.Context, listening func(), changed func(string, uuid.UUID)) error {
	select {
	case <-r.listen:
	case <-ctx.Done():
		return ctx.Err()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r.stop.Store(&cancel)
	return r.Store.ListenPrincipals(ctx, listening, changed)
}

// interrupt ends the listen in progress, as a lost connection would.
func (r *racingStore) interrupt() { (*r.stop.Load())() }

// heldLookup starts a lookup of token that reads its key and then waits for
// st's release; its outcome arrives on the returned channel.
func heldLookup(t *testing.T, keys *access.Keys, st *racingStore, token string) <-chan error {
	t.Helper()
	st.armed.Store(true)
	errs := make(chan error, 1)
	go func() {
		_, err := keys.Lookup(context.Background(), token)
		errs <- err
	}()
	select {
	case <-st.read:
	case <-time.After(10 * time.Second):
		t.Fatal("the lookup never read its key")
	}
	return errs
}

// TestALookupThatRacesAChangeIsNotCached: a principal read before a change
// that is announced while its lookup is still on its way is not cached: the
// next request is looked up again, and its key, revoked meanwhile, refused.
func TestALookupThatRacesAChangeIsNotCached(t *testing.T) {
	t.Parallel()
	st := newRacingStore(store.New(testdb.New(t)))
	st.listen <- struct{}{}
	keys, changes := replica(t, st)
	token := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	held := heldLookup(t, keys, st, token)
	require.NoError(t, st.RevokeKey(context.Background(), token[:12]))
	awaitChange(t, changes, "api_keys")
	close(st.release)
	require.NoError(t, <-held, "read before the revocation")
	refused(t, keys, token, "looked up again, not served from what the raced lookup read")
}

// TestAChangeMissedWhileNotListeningIsNotServed: while its listener is down
// a replica serves nothing from memory (a key revoked meanwhile is refused
// at once); once it listens again it drops what it read before (a change
// may have been missed), a lookup on its way included, and tells its users
// so (OnChange with no table and no account), at its first listen too.
func TestAChangeMissedWhileNotListeningIsNotServed(t *testing.T) {
	t.Parallel()
	st := newRacingStore(store.New(testdb.New(t)))
	resumed := make(chan struct{}, 10)
	st.listen <- struct{}{}
	keys, _ := replicaWith(t, st, access.Config{OnChange: func(table string, account uuid.UUID) {
		if table == "" && account == uuid.Nil {
			resumed <- struct{}{}
		}
	}})
	ctx := context.Background()
	awaitResumed := func() {
		t.Helper()
		select {
		case <-resumed:
		case <-time.After(10 * time.Second):
			t.Fatal("the users were not told that changes may have been missed")
		}
	}
	awaitResumed()
	revoked := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	raced := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	for _, token := range []string{revoked, raced} {
		_, err := keys.Lookup(ctx, token)
		require.NoError(t, err)
	}

	st.interrupt()
	require.Eventually(t, func() bool { return !keys.Listening() }, 10*time.Second, time.Millisecond)
	require.NoError(t, st.RevokeKey(ctx, revoked[:12]))
	refused(t, keys, revoked, "looked up while not listening, not served from memory")

	held := heldLookup(t, keys, st, raced)
	require.NoError(t, st.RevokeKey(ctx, raced[:12]))
	st.listen <- struct{}{}
	require.Eventually(t, keys.Listening, 10*time.Second, time.Millisecond)
	awaitResumed()
	close(st.release)
	require.NoError(t, <-held, "read before the revocation")
	refused(t, keys, raced, "looked up again, not served from what was read before listening again")
}

// TestAChangeThatNamesNoAccountDropsEveryKey: a change announced without
// its account (any may have changed) drops every account's keys.
func TestAChangeThatNamesNoAccountDropsEveryKey(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	keys, changes := replica(t, st)
	tokens := []string{newKey(t, st.Store, "acme", gateway.TierDeveloper), newKey(t, st.Store, "globex", gateway.TierDeveloper)}
	lookUp := func() {
		t.Helper()
		for _, token := range tokens {
			_, err := keys.Lookup(context.Background(), token)
			require.NoError(t, err)
		}
	}
	lookUp()
	lookUp()
	require.Equal(t, int64(2), st.lookups.Load())
	_, err := st.Pool().Exec(context.Background(), `SELECT pg_notify('gateway_principals', 'accounts')`)
	require.NoError(t, err)
	awaitChange(t, changes, "accounts")
	lookUp()
	require.Equal(t, int64(4), st.lookups.Load(), "both accounts' keys looked up again")
}

// TestAFullCacheStartsOver: a cache that holds MaxEntries keys starts over
// with the next one, so that a flood of valid keys bounds its memory; a key
// it dropped is looked up again.
func TestAFullCacheStartsOver(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	keys, _ := replicaWith(t, st, access.Config{MaxEntries: 2})
	a, b, c := newKey(t, st.Store, "acme", gateway.TierDeveloper), newKey(t, st.Store, "acme", gateway.TierDeveloper), newKey(t, st.Store, "acme", gateway.TierDeveloper)
	lookUp := func(token string, lookups int64, msg string) {
		t.Helper()
		_, err := keys.Lookup(context.Background(), token)
		require.NoError(t, err)
		require.Equal(t, lookups, st.lookups.Load(), msg)
	}
	lookUp(a, 1, "a looked up")
	lookUp(b, 2, "b looked up")
	lookUp(a, 2, "a held")
	lookUp(c, 3, "c looked up, the cache full")
	lookUp(c, 3, "c held in the cache started over")
	lookUp(a, 4, "a dropped as the cache started over")
}

// TestEntriesLastTheirTTL: a key served from memory, and one refused from
// memory, are looked up again once the TTL has passed.
func TestEntriesLastTheirTTL(t *testing.T) {
	t.Parallel()
	st := &countingStore{Store: store.New(testdb.New(t))}
	const ttl = 200 * time.Millisecond
	keys, _ := replicaWith(t, st, access.Config{TTL: ttl})
	valid := newKey(t, st.Store, "acme", gateway.TierDeveloper)
	unknown, err := apikey.Generate()
	require.NoError(t, err)
	for _, k := range []struct {
		token string
		valid bool
	}{{valid, true}, {unknown.Token, false}} {
		before := st.lookups.Load()
		start := time.Now()
		for range 2 {
			_, err := keys.Lookup(context.Background(), k.token)
			require.Equal(t, k.valid, err == nil, err)
		}
		if time.Since(start) < ttl {
			require.Equal(t, before+1, st.lookups.Load(), "served from memory within the TTL")
		}
		require.Eventually(t, func() bool {
			_, err := keys.Lookup(context.Background(), k.token)
			return (err == nil) == k.valid && st.lookups.Load() == before+2
		}, 10*time.Second, 10*time.Millisecond, "looked up again after the TTL, with the same outcome")
	}
}
