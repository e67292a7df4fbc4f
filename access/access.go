// Package access authenticates callers from memory: each replica caches the
// principals of the keys it has seen, drops an account's whenever PostgreSQL
// announces a change to one of its keys, to it or to one of its projects
// (LISTEN/NOTIFY; all of them when a change names no account), and
// serves from the cache only while it is listening, so a revoked key is
// refused by every replica as soon as the notification arrives. A TTL bounds
// the life of an entry as a backstop. A key the database refused (unknown,
// revoked or past its end, none of which is ever valid again) is refused from
// memory for the TTL, so a client that repeats it costs no lookup. While the
// cache is in use, lookups in flight at once are bounded, so that a flood of
// keys it does not know holds few of the database's connections: cached
// keys, and everything else the connections serve, go on. Each request is
// then counted against the key's rate limit.
package access

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/apikey"
	"github.com/rungworks/gateway/internal/retrylog"
	"github.com/rungworks/gateway/metrics"
)

// KeyStore resolves keys and announces changes to them.
type KeyStore interface {
	LookupKey(ctx context.Context, token string) (*gateway.Principal, error)
	ListenPrincipals(ctx context.Context, listening func(), changed func(table string, account uuid.UUID)) error
}

// RateLimiter counts a request against its key's limit.
type RateLimiter interface {
	Take(ctx context.Context, keyID uuid.UUID, tier gateway.Tier) (gateway.RateStatus, error)
}

// Defaults of a Config.
const (
	DefaultTTL        = 30 * time.Second
	DefaultMaxEntries = 100_000
	DefaultMaxLookups = 2
	// maxRefused bounds the keys remembered as refused; when full it starts
	// over. A client repeating a refused key needs one entry; a flood of
	// random keys, each looked up once, only churns these.
	maxRefused = 10_000
	// relistenDelay is the pause before listening again after a failure.
	relistenDelay = time.Second
	// lookupTimeout bounds a lookup, its wait for its turn included: a
	// database that does not answer fails it (503 SERVICE_UNAVAILABLE)
	// instead of holding the request for as long as it does not. A key the
	// cache holds waits for nothing.
	lookupTimeout = 5 * time.Second
)

// Config configures a Keys cache; zero fields take the defaults.
type Config struct {
	// TTL bounds how long an entry is served without a lookup.
	TTL time.Duration
	// MaxEntries bounds the cache; when full it starts over.
	MaxEntries int
	// MaxLookups bounds the lookups in flight at once while the cache is in
	// use; more wait their turn, in order.
	MaxLookups int
	// OnChange, when set, is called on every announced change (after the
	// cache dropped what it changes), with the changed table's name and
	// account; "" and uuid.Nil when changes may have been missed (the
	// listener reconnected), uuid.Nil alone when any account may have changed.
	OnChange func(table string, account uuid.UUID)
	Logger   *slog.Logger
	// Metrics, when set, records whether changes are being listened for.
	Metrics *metrics.Metrics
}

// Keys caches principals by the hash of their key.
type Keys struct {
	cfg   Config
	store KeyStore
	// lookups holds a place for each lookup in flight.
	lookups chan struct{}

	mu      sync.RWMutex
	entries map[[sha256.Size]byte]entry
	// refused holds, until when, keys the database refused.
	refused   map[[sha256.Size]byte]time.Time
	listening bool
	// started is set once the first listen began.
	started atomic.Bool
	// generation changes whenever the cache is dropped, so a lookup that
	// raced a change does not store what it read before it.
	generation uint64
	// interruptions logs the listener's runs of failures.
	interruptions *retrylog.Failure
}

type entry struct {
	principal *gateway.Principal
	expires   time.Time
}

// NewKeys returns a cache over st; it caches only while Run listens.
func NewKeys(cfg Config, st KeyStore) *Keys {
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.MaxLookups <= 0 {
		cfg.MaxLookups = DefaultMaxLookups
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Keys{
		cfg: cfg, store: st, lookups: make(chan struct{}, cfg.MaxLookups), entries: map[[sha256.Size]byte]entry{}, refused: map[[sha256.Size]byte]time.Time{},
		interruptions: retrylog.New(cfg.Logger, slog.LevelWarn,
			"key change notifications interrupted; authenticating every request against the database until they resume", "key change notifications resumed"),
	}
}

// Lookup returns the principal of token (Rate unset), from the cache when it
// holds it, or UNAUTHORIZED: from the cache for a key the database refused
// within the TTL, without a lookup for a malformed one.
func (k *Keys) Lookup(ctx context.Context, token string) (*gateway.Principal, error) {
	sum := sha256.Sum256([]byte(token))
	now := time.Now()
	k.mu.RLock()
	e, ok := k.entries[sum]
	refusedUntil, refused := k.refused[sum]
	listening, generation := k.listening, k.generation
	k.mu.RUnlock()
	if listening && ok && now.Before(e.expires) {
		return e.principal, nil
	}
	if listening && refused && now.Before(refusedUntil) {
		return nil, gateway.UnauthorizedError()
	}
	// Checked on a miss only (the cache holds well-formed keys alone), so
	// that a malformed key is neither looked up nor remembered.
	if _, err := apikey.Parse(token); err != nil {
		return nil, gateway.UnauthorizedError()
	}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	// While the cache serves the keys it knows, those it does not take
	// their turn for a lookup. While it does not, every request is looked
	// up, and a bound would bound the replica's requests.
	if listening {
		select {
		case k.lookups <- struct{}{}:
			defer func() { <-k.lookups }()
		case <-ctx.Done():
			return nil, fmt.Errorf("error waiting to look a key up: %w", ctx.Err())
		}
	}
	p, err := k.store.LookupKey(ctx, token)
	if err != nil {
		if gateway.ErrorCodeOf(err) == gateway.EUnauthorized {
			k.remember(sum, now)
		}
		return nil, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.listening && k.generation == generation {
		if len(k.entries) >= k.cfg.MaxEntries {
			k.entries = map[[sha256.Size]byte]entry{}
		}
		expires := now.Add(k.cfg.TTL)
		if p.KeyExpiresAt != nil && p.KeyExpiresAt.Before(expires) {
			expires = *p.KeyExpiresAt // then looked up again, and refused
		}
		k.entries[sum] = entry{principal: p, expires: expires}
	}
	return p, nil
}

// remember records that the database refused the key of sum, while the
// cache is in use. Unlike a principal, a refusal read before a change still
// holds after it: no change makes a refused key valid.
func (k *Keys) remember(sum [sha256.Size]byte, now time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.listening {
		return
	}
	if len(k.refused) >= maxRefused {
		k.refused = map[[sha256.Size]byte]time.Time{}
	}
	k.refused[sum] = now.Add(k.cfg.TTL)
}

// Listening reports whether changes are being listened for (and so whether
// the cache is in use).
func (k *Keys) Listening() bool {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.listening
}

// ErrNotListening is the readiness of a replica that has not yet listened
// for key changes.
var ErrNotListening = errors.New("not yet listening for changes to keys and limits")

// Ready reports whether changes have been listened for since the start: a
// replica that begins to listen invalidates the quota slices it holds (it may
// have missed a change), so it takes traffic only once it has.
func (k *Keys) Ready(context.Context) error {
	if !k.started.Load() {
		return ErrNotListening
	}
	return nil
}

// drop empties the cache and sets whether it may fill again.
func (k *Keys) drop(listening bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.entries = map[[sha256.Size]byte]entry{}
	k.refused = map[[sha256.Size]byte]time.Time{}
	k.listening = listening
	k.generation++
}

// dropAccount drops the keys of account (all keys when it is uuid.Nil).
func (k *Keys) dropAccount(account uuid.UUID) {
	if account == uuid.Nil {
		k.drop(true)
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for sum, e := range k.entries {
		if e.principal.AccountID == account {
			delete(k.entries, sum)
		}
	}
	k.generation++
}

// Run listens for changes until ctx ends, reconnecting after failures; while
// it is not listening nothing is served from the cache. An interruption is
// logged when it begins, each retrylog.Remind while it lasts, and when it
// ends.
func (k *Keys) Run(ctx context.Context) {
	for ctx.Err() == nil {
		err := k.store.ListenPrincipals(ctx, func() {
			k.drop(true)
			k.started.Store(true)
			k.cfg.Metrics.Listening(metrics.ListenerKeys, true)
			k.interruptions.Succeeded()
			k.changed("", uuid.Nil)
		}, func(table string, account uuid.UUID) {
			k.dropAccount(account)
			k.changed(table, account)
		})
		k.drop(false)
		k.cfg.Metrics.Listening(metrics.ListenerKeys, false)
		if ctx.Err() != nil {
			return
		}
		k.interruptions.Failed(err)
		select {
		case <-ctx.Done():
		case <-time.After(relistenDelay):
		}
	}
}

func (k *Keys) changed(table string, account uuid.UUID) {
	if k.cfg.OnChange != nil {
		k.cfg.OnChange(table, account)
	}
}

// Authenticator resolves a token to its principal and counts the request
// against the key's rate limit.
type Authenticator struct {
	Keys  *Keys
	Rates RateLimiter
}

// Authenticate returns the caller's principal with the request's rate outcome.
func (a *Authenticator) Authenticate(ctx context.Context, token string) (*gateway.Principal, error) {
	p, err := a.Keys.Lookup(ctx, token)
	if err != nil {
		return nil, err
	}
	rate, err := a.Rates.Take(ctx, p.KeyID, p.Tier)
	if err != nil {
		return nil, err
	}
	counted := *p
	counted.Rate = rate
	return &counted, nil
}
