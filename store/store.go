// Package store is the PostgreSQL implementation of the gateway's persistence:
// accounts, projects, API keys, committed requests and their evidence. Every
// query lives in store/queries and is compiled by sqlc into gen/db.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/apikey"
	"github.com/rungworks/gateway/gen/db"
	"github.com/rungworks/gateway/metrics"
)

// Store reads and writes the gateway's state in PostgreSQL.
type Store struct {
	pool    *pgxpool.Pool
	queries *db.Queries
	// quarantine holds accounts whose settlements fail reconciliation.
	quarantine quarantine
	// foldQuarantine holds expired quota leases that fail to fold.
	foldQuarantine quarantine
	// usageQuarantine holds accounts whose usage sums by minute fail to fold.
	usageQuarantine quarantine
	// retention is where the pass over usage past the retention goes on
	// (FoldOldUsage).
	retention retentionPass
	// evidenceMark, batchesMark and keysMark are where DeleteExpiredEvidence,
	// DeleteOldBatches and ExpireIdempotencyKeys stopped.
	evidenceMark, batchesMark, keysMark resumeMark
	// creations bounds the batch creations holding a connection at once (see
	// creationSlots).
	creations chan struct{}
	// groups gathers the batch creations of each account-day that arrive
	// together into one transaction.
	groups creationGroups
	// metrics, when set, records each group of creations that commits.
	metrics *metrics.Metrics
}

// New returns a store over pool.
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool, queries: db.New(), creations: make(chan struct{}, creationSlots(pool.Config().MaxConns))}
}

// creationSlots is how many batch creations may hold a connection of a pool
// of maxConns at once: half, at least one. A creation writes up to 100 items
// in its transaction; a burst of them (3,000 at once from 300 accounts, in a
// benchmark) held every connection for seconds, and the rate leases of other
// keys, the settlements of interactive requests and the drain's claims waited
// behind them, past their deadlines (503 for the requests). The other
// creations wait their turn without a connection, in order of arrival.
func creationSlots(maxConns int32) int {
	return max(1, int(maxConns)/2)
}

// Observe records the store's group transactions (batch creations) in m.
// Call it before the store is used.
func (s *Store) Observe(m *metrics.Metrics) { s.metrics = m }

// Pool returns the connection pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// PoolStats is what the connection pool tells of itself now, for the metrics
// (Metrics.DatabasePool).
func (s *Store) PoolStats() metrics.Pool {
	st := s.pool.Stat()
	return metrics.Pool{
		Acquired: st.AcquiredConns(), Idle: st.IdleConns(), Constructing: st.ConstructingConns(), Max: st.MaxConns(),
		Acquires: st.AcquireCount(), Waited: st.EmptyAcquireCount(), Canceled: st.CanceledAcquireCount(), Wait: st.EmptyAcquireWaitTime(),
	}
}

// CreateKeyParams names the owner and rights of a new key.
type CreateKeyParams struct {
	Account string
	Project string
	// Tier sets the account's tier; nil keeps an existing account's tier and
	// creates a new one as developer.
	Tier   *gateway.Tier
	Scopes []gateway.Scope
	// ExpiresAt, when set, is when the key stops being accepted; it must be
	// in the future.
	ExpiresAt *time.Time
}

// CreateKey creates the account and project on first use and issues a key,
// returning the key's token (shown once; only its hash is stored).
func (s *Store) CreateKey(ctx context.Context, p CreateKeyParams) (string, error) {
	if err := checkName("account", p.Account); err != nil {
		return "", err
	}
	if err := checkName("project", p.Project); err != nil {
		return "", err
	}
	if len(p.Scopes) == 0 {
		return "", errors.New("a key needs at least one scope")
	}
	if err := checkEnd(p.ExpiresAt); err != nil {
		return "", err
	}
	scopes := make([]string, 0, len(p.Scopes))
	for _, sc := range p.Scopes {
		if sc != gateway.ScopeInference && sc != gateway.ScopeUsage {
			return "", fmt.Errorf("unknown scope %q (use inference, usage)", sc)
		}
		if !slices.Contains(scopes, string(sc)) {
			scopes = append(scopes, string(sc))
		}
	}
	var tier *string
	if p.Tier != nil {
		if *p.Tier != gateway.TierFree && *p.Tier != gateway.TierDeveloper {
			return "", fmt.Errorf("unknown tier %q (use free, developer)", *p.Tier)
		}
		t := string(*p.Tier)
		tier = &t
	}

	var token string
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		account, err := s.queries.UpsertAccount(ctx, tx, db.UpsertAccountParams{ID: newID(), Name: p.Account, Tier: tier})
		if err != nil {
			return fmt.Errorf("error upserting account: %w", err)
		}
		project, err := s.queries.UpsertProject(ctx, tx, db.UpsertProjectParams{ID: newID(), AccountID: account.ID, Name: p.Project})
		if err != nil {
			return fmt.Errorf("error upserting project: %w", err)
		}
		token, err = s.insertKey(ctx, tx, project.ID, scopes, p.ExpiresAt)
		return err
	})
	if err != nil {
		return "", err
	}
	return token, nil
}

// maxNameBytes bounds the name of an account or a project.
const maxNameBytes = 200

// checkName refuses an account's or project's name (what) that operators
// could not read or type back: empty, longer than maxNameBytes, not UTF-8,
// with a control character (a line break or a terminal escape would forge
// lines of the CLI's tables and the logs) or a bidirectional control (a
// right-to-left override shows the rest of its line reversed, as in "Trojan
// Source"; the joiners that several scripts need are not among them), or
// with white space at either end (" acme" and "acme" would be two accounts).
func checkName(what, name string) error {
	switch {
	case strings.TrimSpace(name) == "":
		return fmt.Errorf("the %s name must not be empty", what)
	case len(name) > maxNameBytes:
		return fmt.Errorf("the %s name must be at most %d bytes; it is %d", what, maxNameBytes, len(name))
	case !utf8.ValidString(name):
		return fmt.Errorf("the %s name must be UTF-8", what)
	case strings.ContainsFunc(name, unicode.IsControl):
		return fmt.Errorf("the %s name must not hold control characters (line breaks, tabs, escapes)", what)
	case strings.ContainsFunc(name, func(r rune) bool { return unicode.Is(unicode.Bidi_Control, r) }):
		return fmt.Errorf("the %s name must not hold bidirectional controls (U+202E and the like reorder how it and the rest of its line are shown)", what)
	case strings.TrimSpace(name) != name:
		return fmt.Errorf("the %s name must not begin or end with white space", what)
	}
	return nil
}

// checkEnd refuses the end of a key to be issued when it has passed.
func checkEnd(expires *time.Time) error {
	if expires != nil && !expires.After(time.Now()) {
		return fmt.Errorf("the key would expire at %s, which has passed", expires.UTC().Format(time.RFC3339))
	}
	return nil
}

// insertKey issues a key of project with scopes, until expires (nil: for
// good), and returns its token.
func (s *Store) insertKey(ctx context.Context, tx pgx.Tx, project uuid.UUID, scopes []string, expires *time.Time) (string, error) {
	key, err := apikey.Generate()
	if err != nil {
		return "", fmt.Errorf("error generating key: %w", err)
	}
	// The prefix carries 40 random bits; a collision fails the unique index and
	// the command, never a silent overwrite.
	if _, err := s.queries.InsertAPIKey(ctx, tx, db.InsertAPIKeyParams{
		ID: newID(), ProjectID: project, Prefix: key.Prefix, Hash: key.Hash, Scopes: scopes, ExpiresAt: expires,
	}); err != nil {
		return "", fmt.Errorf("error inserting key: %w", err)
	}
	return key.Token, nil
}

// RotatedKey is the outcome of RotateKey.
type RotatedKey struct {
	// Token is the new key's (shown once).
	Token string
	// OldExpiresAt is when the key it replaces stops being accepted.
	OldExpiresAt time.Time
}

// RotateKey issues a key with the project and scopes of an active one (by id
// or prefix), until expires (nil: for good), and ends the old one after
// grace, or sooner if it was to end sooner: clients move to the new key
// meanwhile, and no request is refused while they do.
func (s *Store) RotateKey(ctx context.Context, idOrPrefix string, grace time.Duration, expires *time.Time) (RotatedKey, error) {
	if err := checkEnd(expires); err != nil {
		return RotatedKey{}, err
	}
	var out RotatedKey
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		old, err := s.queries.LockActiveAPIKey(ctx, tx, idOrPrefix)
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrKeyNotFound
		}
		if err != nil {
			return fmt.Errorf("error reading key: %w", err)
		}
		if out.Token, err = s.insertKey(ctx, tx, old.ProjectID, old.Scopes, expires); err != nil {
			return err
		}
		// At PostgreSQL's precision, so that what is reported is what is stored.
		out.OldExpiresAt = time.Now().Add(max(grace, 0)).Truncate(time.Microsecond)
		if old.ExpiresAt != nil && old.ExpiresAt.Before(out.OldExpiresAt) {
			out.OldExpiresAt = *old.ExpiresAt
		}
		if err := s.queries.SetAPIKeyExpiry(ctx, tx, db.SetAPIKeyExpiryParams{ID: old.ID, ExpiresAt: &out.OldExpiresAt}); err != nil {
			return fmt.Errorf("error ending the old key: %w", err)
		}
		return nil
	})
	if err != nil {
		return RotatedKey{}, err
	}
	return out, nil
}

// ErrKeyNotFound is returned when revoking or rotating a key that does not
// exist or is no longer active.
var ErrKeyNotFound = errors.New("no active key with that id or prefix (gateway keys list names each key, and whether it was revoked or expired)")

// RevokeKey revokes a key by its id or its prefix.
func (s *Store) RevokeKey(ctx context.Context, idOrPrefix string) error {
	n, err := s.queries.RevokeAPIKey(ctx, s.pool, idOrPrefix)
	if err != nil {
		return fmt.Errorf("error revoking key: %w", err)
	}
	if n == 0 {
		return ErrKeyNotFound
	}
	return nil
}

// RevokeAccountKeys revokes, in one statement, every active key of the named
// account, or of its project of that name when project is not empty, and
// returns how many it revoked; every replica refuses them from its next
// request. An account or project that does not exist is ErrAccountNotFound or
// ErrProjectNotFound.
func (s *Store) RevokeAccountKeys(ctx context.Context, account, project string) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		a, err := s.account(ctx, tx, account)
		if err != nil {
			return err
		}
		var projectID *uuid.UUID
		if project != "" {
			p, err := s.project(ctx, tx, a, project)
			if err != nil {
				return err
			}
			projectID = &p.ID
		}
		if n, err = s.queries.RevokeAccountAPIKeys(ctx, tx, db.RevokeAccountAPIKeysParams{AccountID: a.ID, ProjectID: projectID}); err != nil {
			return fmt.Errorf("error revoking keys: %w", err)
		}
		return nil
	})
	return n, err
}

// Key is an issued key as ListKeys describes it: never its secret.
type Key = db.ListAPIKeysRow

// ListKeys returns every key with its account and project, newest first, or
// only the named account's when account is not empty (ErrAccountNotFound when
// there is no such account).
func (s *Store) ListKeys(ctx context.Context, account string) ([]Key, error) {
	keys, err := s.queries.ListAPIKeys(ctx, s.pool, nameFilter(account))
	if err != nil {
		return nil, fmt.Errorf("error listing keys: %w", err)
	}
	if len(keys) == 0 {
		return nil, s.accountKnown(ctx, account)
	}
	return keys, nil
}

// accountKnown is nil when name is empty (no account named) or names an
// account, ErrAccountNotFound otherwise: a list filtered by an account that
// does not exist says so, rather than look like one with nothing to list.
func (s *Store) accountKnown(ctx context.Context, name string) error {
	if name == "" {
		return nil
	}
	_, err := s.account(ctx, s.pool, name)
	return err
}

// nameFilter is a query's optional filter by name: nil (everyone) for "".
func nameFilter(name string) *string {
	if name == "" {
		return nil
	}
	return &name
}

// SetLimitsParams are the limits to set; nil fields are left as they are,
// unless cleared.
type SetLimitsParams struct {
	Account    string
	DailyRungs *int64
	// ClearDaily drops the account's own ceiling: its tier's applies.
	ClearDaily  bool
	Project     string
	BudgetRungs *int64
	// ClearBudget drops the project's cap: it is uncapped.
	ClearBudget bool
}

// ErrAccountNotFound is returned when setting limits of an unknown account,
// revoking its keys, or listing its keys, batches or usage.
var ErrAccountNotFound = errors.New("no such account")

// ErrProjectNotFound is returned when setting the budget of an unknown
// project, or revoking its keys.
var ErrProjectNotFound = errors.New("no such project")

// SetLimits sets or clears an account's daily rung ceiling and/or a project's
// budget cap of an existing account and project; a missing one is named in
// the error.
func (s *Store) SetLimits(ctx context.Context, p SetLimitsParams) error {
	if (p.DailyRungs != nil && p.ClearDaily) || (p.BudgetRungs != nil && p.ClearBudget) {
		return errors.New("a limit is either set or cleared")
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		account, err := s.account(ctx, tx, p.Account)
		if err != nil {
			return err
		}
		if p.DailyRungs != nil || p.ClearDaily {
			if _, err := s.queries.SetAccountDailyCeiling(ctx, tx, db.SetAccountDailyCeilingParams{ID: account.ID, DailyRungCeiling: p.DailyRungs}); err != nil {
				return fmt.Errorf("error setting daily ceiling: %w", err)
			}
		}
		if p.BudgetRungs != nil || p.ClearBudget {
			project, err := s.project(ctx, tx, account, p.Project)
			if err != nil {
				return err
			}
			if _, err := s.queries.SetProjectBudget(ctx, tx, db.SetProjectBudgetParams{ID: project.ID, BudgetCapRungs: p.BudgetRungs}); err != nil {
				return fmt.Errorf("error setting budget: %w", err)
			}
		}
		return nil
	})
}

// account reads an account by its name; ErrAccountNotFound, saying how
// accounts are made, when there is none.
func (s *Store) account(ctx context.Context, q db.DBTX, name string) (db.Account, error) {
	account, err := s.queries.GetAccountByName(ctx, q, name)
	if errors.Is(err, pgx.ErrNoRows) {
		return db.Account{}, fmt.Errorf("%w %q (accounts are created with their first key: gateway keys create --account %s)", ErrAccountNotFound, name, name)
	}
	if err != nil {
		return db.Account{}, fmt.Errorf("error reading account: %w", err)
	}
	return account, nil
}

// project reads a project of account by its name; ErrProjectNotFound, saying
// how projects are made, when there is none.
func (s *Store) project(ctx context.Context, q db.DBTX, account db.Account, name string) (db.Project, error) {
	project, err := s.queries.GetProjectByName(ctx, q, db.GetProjectByNameParams{AccountID: account.ID, Name: name})
	if errors.Is(err, pgx.ErrNoRows) {
		return db.Project{}, fmt.Errorf("%w %q in account %q (projects are created with their first key: gateway keys create --account %s --project %s)",
			ErrProjectNotFound, name, account.Name, account.Name, name)
	}
	if err != nil {
		return db.Project{}, fmt.Errorf("error reading project: %w", err)
	}
	return project, nil
}

// Evidence returns the evidence of one of the account's requests while it is
// held; anything else is SOURCES_NOT_FOUND.
func (s *Store) Evidence(ctx context.Context, accountID, requestID uuid.UUID) (*gateway.Evidence, error) {
	row, err := s.queries.GetEvidence(ctx, s.pool, db.GetEvidenceParams{RequestID: requestID, AccountID: accountID})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, gateway.Errorf(gateway.ESourcesNotFound, "no evidence is held for request %s", requestID)
	}
	if err != nil {
		return nil, fmt.Errorf("error reading evidence: %w", err)
	}
	ev := &gateway.Evidence{RequestID: row.RequestID}
	if err := json.Unmarshal(row.Sources, &ev.Sources); err != nil {
		return nil, fmt.Errorf("error decoding sources: %w", err)
	}
	if row.Verdict != nil {
		ev.Verdict = *row.Verdict
	}
	return ev, nil
}

// DeleteExpiredEvidence removes up to maxRows evidence rows past retention,
// the earliest expiry first, reading from where its last run stopped (see
// resumeMark).
func (s *Store) DeleteExpiredEvidence(ctx context.Context, maxRows int32) (int64, error) {
	return s.evidenceMark.run(func(from time.Time) (int64, time.Time, error) {
		row, err := s.queries.DeleteExpiredEvidence(ctx, s.pool, db.DeleteExpiredEvidenceParams{ExpiredFrom: from, MaxRows: maxRows})
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("error deleting expired evidence: %w", err)
		}
		return row.Removed, row.ReadFrom, nil
	})
}

func newID() uuid.UUID { return uuid.Must(uuid.NewV7()) }

// Activity is what the database has done so far: transactions committed in
// the gateway's database, and WAL flushes (durable commits, grouped by the
// server) and WAL records of the whole server. Benchmarks read it before and
// after a run.
type Activity struct {
	Commits    int64
	WALSyncs   int64
	WALRecords int64
}

// Since is what was done between before and a.
func (a Activity) Since(before Activity) Activity {
	return Activity{Commits: a.Commits - before.Commits, WALSyncs: a.WALSyncs - before.WALSyncs, WALRecords: a.WALRecords - before.WALRecords}
}

// AnalyzeQueue takes the statistics of the batch tables now, as autovacuum
// does after a drain: benchmarks measure the drain that follows.
func (s *Store) AnalyzeQueue(ctx context.Context) error {
	if err := s.queries.AnalyzeQueue(ctx, s.pool); err != nil {
		return fmt.Errorf("error analyzing the batch tables: %w", err)
	}
	return nil
}

// Activity reads the database's activity counters.
func (s *Store) Activity(ctx context.Context) (Activity, error) {
	row, err := s.queries.DatabaseActivity(ctx, s.pool)
	if err != nil {
		return Activity{}, fmt.Errorf("error reading database activity: %w", err)
	}
	return Activity{Commits: row.Commits, WALSyncs: row.WalSyncs, WALRecords: row.WalRecords}, nil
}
