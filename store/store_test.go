package store_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/migrations"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type testBundle struct {
	ctx   context.Context
	store *store.Store
	// tracer, when set, traces the statements of the stores lockedItems
	// makes; metrics, when set, records their group transactions.
	tracer  pgx.QueryTracer
	metrics *metrics.Metrics
}

func setup(t testing.TB) *testBundle {
	t.Helper()
	return &testBundle{ctx: context.Background(), store: store.New(testdb.New(t))}
}

// poolWith is a pool of its own on the test's database, configured as the
// store's with tweak applied; it closes with the test.
func (b *testBundle) poolWith(t testing.TB, tweak func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg := b.store.Pool().Config()
	tweak(cfg)
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// impatient is a store on the test's database whose statements give up
// waiting for a lock after 100 ms: a statement that should pass over rows
// another transaction holds fails there if it waits for them instead.
func (b *testBundle) impatient(t testing.TB) *store.Store {
	t.Helper()
	return store.New(b.poolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["lock_timeout"] = "100ms" }))
}

// unindexed is a store on the test's database whose planner reads tables
// through their heap, not their indexes (as over small tables): a statement
// whose order or bound rests on an index's order shows it there.
func (b *testBundle) unindexed(t testing.TB) *store.Store {
	t.Helper()
	return store.New(b.poolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["enable_indexscan"] = "off"
		cfg.ConnConfig.RuntimeParams["enable_bitmapscan"] = "off"
		cfg.ConnConfig.RuntimeParams["enable_indexonlyscan"] = "off"
	}))
}

func (b *testBundle) key(t testing.TB, account string, tier gateway.Tier, scopes ...gateway.Scope) (string, *gateway.Principal) {
	t.Helper()
	token, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: account, Project: "default", Tier: &tier, Scopes: scopes})
	require.NoError(t, err)
	p, err := b.store.LookupKey(b.ctx, token)
	require.NoError(t, err)
	return token, p
}

func TestCreateKeyAndAuthenticate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	token, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference, gateway.ScopeUsage, gateway.ScopeInference)
	require.Equal(t, "acme", p.AccountName)
	require.Equal(t, "default", p.ProjectName)
	require.Equal(t, gateway.TierDeveloper, p.Tier)
	require.Equal(t, []gateway.Scope{gateway.ScopeInference, gateway.ScopeUsage}, p.Scopes)

	// A second key reuses the account and project; an explicit tier updates it.
	_, p2 := b.key(t, "acme", gateway.TierFree, gateway.ScopeUsage)
	require.Equal(t, p.AccountID, p2.AccountID)
	require.Equal(t, p.ProjectID, p2.ProjectID)
	require.NotEqual(t, p.KeyID, p2.KeyID)
	require.Equal(t, gateway.TierFree, p2.Tier)

	// Without a tier, an existing account keeps its tier and a new one is developer.
	t3, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: "acme", Project: "other", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	p3, err := b.store.LookupKey(b.ctx, t3)
	require.NoError(t, err)
	require.Equal(t, gateway.TierFree, p3.Tier)
	require.NotEqual(t, p.ProjectID, p3.ProjectID)
	t4, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: "newco", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	p4, err := b.store.LookupKey(b.ctx, t4)
	require.NoError(t, err)
	require.Equal(t, gateway.TierDeveloper, p4.Tier)

	_, err = b.store.LookupKey(b.ctx, token)
	require.NoError(t, err, "the first key still works")
}

func TestCreateKeyValidates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bad := gateway.Tier("gold")
	for _, tc := range []struct {
		p    store.CreateKeyParams
		want string
	}{
		{store.CreateKeyParams{Account: "", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "the account name must not be empty"},
		{store.CreateKeyParams{Account: "a", Project: " ", Scopes: []gateway.Scope{gateway.ScopeInference}}, "the project name must not be empty"},
		{store.CreateKeyParams{Account: strings.Repeat("a", 201), Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "at most 200 bytes; it is 201"},
		{store.CreateKeyParams{Account: "a\xff", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "the account name must be UTF-8"},
		{store.CreateKeyParams{Account: "evil\nname", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "control characters"},
		{store.CreateKeyParams{Account: "a", Project: "p\x1b[31m", Scopes: []gateway.Scope{gateway.ScopeInference}}, "the project name must not hold control characters"},
		{store.CreateKeyParams{Account: " acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "must not begin or end with white space"},
		{store.CreateKeyParams{Account: "acme\u202egnp.exe", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}}, "bidirectional controls"},
		{store.CreateKeyParams{Account: "a", Project: "de\u2066fault", Scopes: []gateway.Scope{gateway.ScopeInference}}, "the project name must not hold bidirectional controls"},
		{store.CreateKeyParams{Account: "a", Project: "default"}, "a key needs at least one scope"},
		{store.CreateKeyParams{Account: "a", Project: "default", Scopes: []gateway.Scope{"admin"}}, `unknown scope "admin" (use inference, usage)`},
		{store.CreateKeyParams{Account: "a", Project: "default", Tier: &bad, Scopes: []gateway.Scope{gateway.ScopeInference}}, `unknown tier "gold" (use free, developer)`},
	} {
		_, err := b.store.CreateKey(b.ctx, tc.p)
		require.ErrorContains(t, err, tc.want, "%+v", tc.p)
	}
	// Names may hold spaces and any printable character, up to 200 bytes,
	// and the joiners of scripts that need them (here a zero-width joiner
	// in Devanagari).
	for _, name := range []string{"acme corp", "Zürich-Labs (test)", strings.Repeat("a", 200), "\u0915\u094d\u200d\u0937"} {
		_, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: name, Project: name, Scopes: []gateway.Scope{gateway.ScopeInference}})
		require.NoError(t, err, name)
	}
}

func TestAuthenticateRejects(t *testing.T) {
	t.Parallel()
	b := setup(t)
	token, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)

	wrongSecret := token[:12] + "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	for _, bad := range []string{"", "garbage", wrongSecret} {
		_, err := b.store.LookupKey(b.ctx, bad)
		require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err), bad)
	}

	require.NoError(t, b.store.RevokeKey(b.ctx, token[:12]))
	_, err := b.store.LookupKey(b.ctx, token)
	require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err))
	require.ErrorIs(t, b.store.RevokeKey(b.ctx, token[:12]), store.ErrKeyNotFound)

	// Revoking by id works too.
	token2, p2 := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	require.NoError(t, b.store.RevokeKey(b.ctx, p2.KeyID.String()))
	_, err = b.store.LookupKey(b.ctx, token2)
	require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err))
	require.NotEqual(t, p.KeyID, p2.KeyID)
}

func TestListKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, p1 := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, p2 := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference, gateway.ScopeUsage)
	_, p3 := b.key(t, "other", gateway.TierFree, gateway.ScopeUsage)
	require.NoError(t, b.store.RevokeKey(b.ctx, first[:12]))

	all, err := b.store.ListKeys(b.ctx, "")
	require.NoError(t, err)
	ids := make([]uuid.UUID, len(all))
	for i, k := range all {
		ids[i] = k.ID
	}
	require.Equal(t, []uuid.UUID{p3.KeyID, p2.KeyID, p1.KeyID}, ids, "newest first")
	require.Equal(t, "other", all[0].Account)
	require.Equal(t, "free", all[0].Tier)
	require.Equal(t, []string{"usage"}, all[0].Scopes)
	require.Nil(t, all[0].RevokedAt)
	require.Equal(t, first[:12], all[2].Prefix)
	require.NotNil(t, all[2].RevokedAt, "a revoked key is listed, with when")

	acme, err := b.store.ListKeys(b.ctx, "acme")
	require.NoError(t, err)
	require.Len(t, acme, 2)
	for _, k := range acme {
		require.Equal(t, "acme", k.Account)
	}
	_, err = b.store.ListKeys(b.ctx, "nobody")
	require.ErrorIs(t, err, store.ErrAccountNotFound, "an account that does not exist is not one without keys")
}

// TestRevokeAccountKeys: an operator cuts a tenant off by revoking every
// active key of its account, or of one of its projects, at once; other
// accounts' keys, and the keys already revoked or past their end, keep their
// state.
func TestRevokeAccountKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tier := gateway.TierDeveloper
	issue := func(account, project string) string {
		t.Helper()
		token, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: account, Project: project, Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
		require.NoError(t, err)
		return token
	}
	refused := func(token string) bool {
		t.Helper()
		_, err := b.store.LookupKey(b.ctx, token)
		if err == nil {
			return false
		}
		require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err))
		return true
	}
	research, research2, web := issue("abuser", "research"), issue("abuser", "research"), issue("abuser", "web")
	revokedBefore, ended := issue("abuser", "web"), issue("abuser", "web")
	require.NoError(t, b.store.RevokeKey(b.ctx, revokedBefore[:12]))
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE prefix = $1`, ended[:12])
	require.NoError(t, err)
	other := issue("acme", "research")

	n, err := b.store.RevokeAccountKeys(b.ctx, "abuser", "research")
	require.NoError(t, err)
	require.Equal(t, int64(2), n)
	require.True(t, refused(research))
	require.True(t, refused(research2))
	require.False(t, refused(web), "another project's key")
	require.False(t, refused(other), "another account's project of the same name")

	n, err = b.store.RevokeAccountKeys(b.ctx, "abuser", "")
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "only the key still active: not those revoked or past their end")
	require.True(t, refused(web))
	require.False(t, refused(other))
	keys, err := b.store.ListKeys(b.ctx, "abuser")
	require.NoError(t, err)
	for _, k := range keys {
		if k.Prefix == ended[:12] {
			require.Nil(t, k.RevokedAt, "a key past its end keeps its end as what ended it")
		} else {
			require.NotNil(t, k.RevokedAt, k.Prefix)
		}
	}
	n, err = b.store.RevokeAccountKeys(b.ctx, "abuser", "")
	require.NoError(t, err)
	require.Zero(t, n, "revoking again is a no-op")

	_, err = b.store.RevokeAccountKeys(b.ctx, "nobody", "")
	require.ErrorIs(t, err, store.ErrAccountNotFound)
	_, err = b.store.RevokeAccountKeys(b.ctx, "abuser", "nowhere")
	require.ErrorIs(t, err, store.ErrProjectNotFound)
	require.False(t, refused(other))
}

// TestKeyExpiry: a key issued with an end carries it, is listed with it, and
// is refused once it has passed; no key is issued already expired.
func TestKeyExpiry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tier := gateway.TierDeveloper
	params := func(expires time.Time) store.CreateKeyParams {
		return store.CreateKeyParams{Account: "acme", Project: "default", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}, ExpiresAt: &expires}
	}
	for _, end := range []time.Time{time.Now().Add(-time.Second), time.Now()} {
		_, err := b.store.CreateKey(b.ctx, params(end))
		require.ErrorContains(t, err, "which has passed", "an end that is now has passed once the key would be stored")
	}

	expires := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	token, err := b.store.CreateKey(b.ctx, params(expires))
	require.NoError(t, err)
	p, err := b.store.LookupKey(b.ctx, token)
	require.NoError(t, err)
	require.True(t, expires.Equal(*p.KeyExpiresAt), "%v", p.KeyExpiresAt)
	listed, err := b.store.ListKeys(b.ctx, "acme")
	require.NoError(t, err)
	require.True(t, expires.Equal(*listed[0].ExpiresAt))
	_, unending := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	require.Nil(t, unending.KeyExpiresAt, "a key issued without an end never expires")

	// Its end passes.
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE id = $1`, p.KeyID)
	require.NoError(t, err)
	_, err = b.store.LookupKey(b.ctx, token)
	require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err))
}

// TestListsOfNothingAreEmpty: on a database without accounts, the
// operators' lists of everyone are empty, not a missing account's error.
func TestListsOfNothingAreEmpty(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keys, err := b.store.ListKeys(b.ctx, "")
	require.NoError(t, err)
	require.Empty(t, keys)
	lines, err := b.store.UsageReport(b.ctx, time.Now().Add(-48*time.Hour), time.Now(), "")
	require.NoError(t, err)
	require.Empty(t, lines)
	batches, err := b.store.BatchesForOperator(b.ctx, "", nil, nil, 10)
	require.NoError(t, err)
	require.Empty(t, batches)
	_, err = b.store.ListKeys(b.ctx, "acme")
	require.ErrorIs(t, err, store.ErrAccountNotFound, "a list of an account that is not there says so")
}

// TestRotateKey: a rotation issues a key of the same project and scopes and
// ends the old one after the grace (or at its own end, if sooner); only an
// active key rotates.
func TestRotateKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference, gateway.ScopeUsage)

	before := time.Now()
	rotated, err := b.store.RotateKey(b.ctx, old[:12], time.Hour, nil)
	require.NoError(t, err)
	require.WithinDuration(t, before.Add(time.Hour), rotated.OldExpiresAt, time.Minute)
	fresh, err := b.store.LookupKey(b.ctx, rotated.Token)
	require.NoError(t, err)
	require.NotEqual(t, p.KeyID, fresh.KeyID)
	require.Equal(t, []any{p.ProjectID, p.Scopes}, []any{fresh.ProjectID, fresh.Scopes}, "the same project and scopes")
	require.Nil(t, fresh.KeyExpiresAt, "the new key never expires unless asked")
	stillOld, err := b.store.LookupKey(b.ctx, old)
	require.NoError(t, err, "the old key is accepted during the grace")
	require.True(t, rotated.OldExpiresAt.Equal(*stillOld.KeyExpiresAt), "reported as stored")

	// Rotated again with a longer grace, the old key keeps its sooner end;
	// with none (or less), it ends now.
	again, err := b.store.RotateKey(b.ctx, p.KeyID.String(), 48*time.Hour, nil)
	require.NoError(t, err)
	require.True(t, rotated.OldExpiresAt.Equal(again.OldExpiresAt), "its end is not pushed back")
	ends := time.Now().Add(time.Hour)
	_, err = b.store.RotateKey(b.ctx, old, 0, &ends)
	require.ErrorIs(t, err, store.ErrKeyNotFound, "a key is named by its prefix or id, not its secret")
	beforeLast := time.Now().Truncate(time.Microsecond)
	last, err := b.store.RotateKey(b.ctx, old[:12], -time.Hour, &ends)
	require.NoError(t, err)
	require.False(t, last.OldExpiresAt.Before(beforeLast), "a negative grace is none: the old key ends now, not in the past")
	_, err = b.store.LookupKey(b.ctx, old)
	require.Equal(t, gateway.EUnauthorized, gateway.ErrorCodeOf(err), "no grace: refused at once")
	newest, err := b.store.LookupKey(b.ctx, last.Token)
	require.NoError(t, err)
	require.WithinDuration(t, ends, *newest.KeyExpiresAt, time.Millisecond)

	_, err = b.store.RotateKey(b.ctx, old[:12], time.Hour, nil)
	require.ErrorIs(t, err, store.ErrKeyNotFound, "an ended key does not rotate")
	require.NoError(t, b.store.RevokeKey(b.ctx, rotated.Token[:12]))
	_, err = b.store.RotateKey(b.ctx, rotated.Token[:12], time.Hour, nil)
	require.ErrorIs(t, err, store.ErrKeyNotFound, "nor does a revoked one")
	past := time.Now().Add(-time.Second)
	_, err = b.store.RotateKey(b.ctx, last.Token[:12], time.Hour, &past)
	require.ErrorContains(t, err, "which has passed")
}

func TestRecordRequestAndEvidence(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, owner := b.key(t, "owner", gateway.TierDeveloper, gateway.ScopeInference)
	_, stranger := b.key(t, "stranger", gateway.TierDeveloper, gateway.ScopeInference)

	now := time.Now().UTC()
	record := func(sources []gateway.Source, verdict string, expires time.Time) uuid.UUID {
		id := uuid.Must(uuid.NewV7())
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: gateway.UsageRecord{
			RequestID: id, Principal: owner, Model: gateway.ModelInstant, Entry: gateway.EntryResponses,
			Usage:     gateway.Usage{InputTokens: 3, OutputTokens: 4, InputRungs: 3, OutputRungs: 4, TotalRungs: 7},
			CreatedAt: now, CompletedAt: now, Sources: sources, Verdict: verdict, EvidenceExpiresAt: expires,
		}}}))
		return id
	}
	src := []gateway.Source{{Title: "T", URL: "https://x", Snippet: "s"}, {Title: "U", URL: "https://y"}}
	withEvidence := record(src, "supported", now.Add(time.Hour))
	verdictOnly := record(nil, "unsupported", now.Add(time.Hour))
	withoutEvidence := record(nil, "", now.Add(time.Hour))
	emptyList := record([]gateway.Source{}, "", now.Add(time.Hour))
	expired := record(src, "supported", now.Add(-time.Second))
	expiredEmpty := record(nil, "", now.Add(-time.Second))
	sourcesOnly := record(src, "", now.Add(time.Hour))

	ev, err := b.store.Evidence(b.ctx, owner.AccountID, withEvidence)
	require.NoError(t, err)
	require.Equal(t, &gateway.Evidence{RequestID: withEvidence, Sources: src, Verdict: "supported"}, ev)
	ev, err = b.store.Evidence(b.ctx, owner.AccountID, verdictOnly)
	require.NoError(t, err)
	require.Equal(t, &gateway.Evidence{RequestID: verdictOnly, Sources: []gateway.Source{}, Verdict: "unsupported"}, ev)
	for _, id := range []uuid.UUID{withoutEvidence, emptyList} {
		ev, err = b.store.Evidence(b.ctx, owner.AccountID, id)
		require.NoError(t, err, "empty evidence is held as long as any")
		require.Equal(t, &gateway.Evidence{RequestID: id, Sources: []gateway.Source{}}, ev)
	}
	require.Equal(t, map[uuid.UUID]bool{withEvidence: true, verdictOnly: true, expired: true, sourcesOnly: true},
		b.evidenceRows(t), "a request with neither sources nor a verdict writes no row of evidence")
	ev, err = b.store.Evidence(b.ctx, owner.AccountID, sourcesOnly)
	require.NoError(t, err)
	require.Equal(t, &gateway.Evidence{RequestID: sourcesOnly, Sources: src}, ev)
	var noVerdict bool
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT verdict IS NULL FROM evidence WHERE request_id = $1`, sourcesOnly).Scan(&noVerdict))
	require.True(t, noVerdict, "no verdict is NULL, not empty")
	var emptyEnds int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM requests r
		WHERE r.empty_evidence_expires_at IS NOT NULL AND EXISTS (SELECT 1 FROM evidence e WHERE e.request_id = r.id)`).Scan(&emptyEnds))
	require.Zero(t, emptyEnds, "a request with a row of evidence holds no end of empty evidence")

	for name, c := range map[string]struct {
		account uuid.UUID
		id      uuid.UUID
	}{
		"foreign":       {stranger.AccountID, withEvidence},
		"foreign empty": {stranger.AccountID, withoutEvidence},
		"expired":       {owner.AccountID, expired},
		"expired empty": {owner.AccountID, expiredEmpty},
		"unknown":       {owner.AccountID, uuid.Must(uuid.NewV7())},
	} {
		_, err := b.store.Evidence(b.ctx, c.account, c.id)
		require.Equal(t, gateway.ESourcesNotFound, gateway.ErrorCodeOf(err), name)
	}
}

// evidenceRows is the set of requests with a row of evidence.
func (b *testBundle) evidenceRows(t *testing.T) map[uuid.UUID]bool {
	t.Helper()
	rows, err := b.store.Pool().Query(b.ctx, `SELECT request_id FROM evidence`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	set := make(map[uuid.UUID]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return set
}

// TestRowsKeepTheirInvariants: a request row with a negative amount, a model
// or entry point the gateway does not know, or a total other than its input
// and output, is refused, and so is a quota lease with a negative amount
// (migration 00033 keeps these as domains); nothing of a refused group is
// stored.
func TestRowsKeepTheirInvariants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	lease := uuid.Must(uuid.NewV7())
	b.grant(t, p, lease, 100, 16, time.Hour)
	for name, spoil := range map[string]func(r *gateway.UsageRecord){
		"negative tokens":     func(r *gateway.UsageRecord) { r.Usage.InputTokens = -1 },
		"negative rungs":      func(r *gateway.UsageRecord) { r.Usage.OutputRungs, r.Usage.TotalRungs = -5, r.Usage.InputRungs-5 },
		"unknown model":       func(r *gateway.UsageRecord) { r.Model = "oracle" },
		"unknown entry point": func(r *gateway.UsageRecord) { r.Entry = "fax" },
		"wrong total":         func(r *gateway.UsageRecord) { r.Usage.TotalRungs++ },
	} {
		good, bad := record(p, uuid.Must(uuid.NewV7()), 10), record(p, uuid.Must(uuid.NewV7()), 10)
		spoil(&bad)
		err := b.store.SettleRequests(b.ctx, []store.Settlement{{Record: good, LeaseID: &lease}, {Record: bad, LeaseID: &lease}})
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, name)
		require.Equal(t, "23514", pgErr.Code, "check_violation: %s", name)
	}
	require.Zero(t, b.view(t, p).Totals.Requests, "no refused group stored anything")

	_, err := b.store.Pool().Exec(b.ctx, `UPDATE quota_leases SET used_rungs = -1 WHERE id = $1`, lease)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23514", pgErr.Code, "check_violation")
}

// TestSetLimits: limits are set, shown with what is charged against them, and
// cleared (the tier's ceiling, no cap); they never create what they limit.
func TestSetLimits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	tier := gateway.TierDeveloper
	for _, project := range []string{"research", "analytics"} { // listed by name, not as created
		_, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: "acme", Project: project, Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
		require.NoError(t, err)
	}
	b.settle(t, p, nil, 120)

	l, err := b.store.Limits(b.ctx, "acme")
	require.NoError(t, err)
	day := gateway.UTCDay(time.Now())
	require.Equal(t, &store.AccountLimits{
		Account: "acme", Tier: gateway.TierDeveloper, DailyDefault: true,
		Daily:    gateway.DailyState{Ceiling: tier.DefaultDailyCeiling(), Charged: 120, Remaining: tier.DefaultDailyCeiling() - 120, ResetsAt: day.Add(24 * time.Hour)},
		Projects: []gateway.BudgetState{{Project: "analytics"}, {Project: "default", Spent: 120}, {Project: "research"}},
	}, l)

	daily, budget := int64(5000), int64(700)
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", DailyRungs: &daily}))
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", Project: "default", BudgetRungs: &budget}))
	l, err = b.store.Limits(b.ctx, "acme")
	require.NoError(t, err)
	require.False(t, l.DailyDefault)
	require.Equal(t, gateway.DailyState{Ceiling: 5000, Charged: 120, Remaining: 4880, ResetsAt: day.Add(24 * time.Hour)}, l.Daily)
	require.Equal(t, []gateway.BudgetState{{Project: "analytics"}, {Project: "default", Cap: &budget, Spent: 120}, {Project: "research"}}, l.Projects)

	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", ClearDaily: true, Project: "default", ClearBudget: true}))
	l, err = b.store.Limits(b.ctx, "acme")
	require.NoError(t, err)
	require.True(t, l.DailyDefault)
	require.Equal(t, tier.DefaultDailyCeiling(), l.Daily.Ceiling)
	require.Nil(t, l.Projects[1].Cap, "uncapped again")
	require.Error(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", DailyRungs: &daily, ClearDaily: true}))

	err = b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "acme", Project: "sales", BudgetRungs: &budget})
	require.ErrorIs(t, err, store.ErrProjectNotFound, "limits never create a project")
	require.ErrorContains(t, err, `"sales"`)
	err = b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: "nobody", DailyRungs: &daily})
	require.ErrorIs(t, err, store.ErrAccountNotFound)
	require.ErrorContains(t, err, `"nobody"`)
	_, err = b.store.Limits(b.ctx, "nobody")
	require.ErrorIs(t, err, store.ErrAccountNotFound)
}

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	// Replicas starting at once on an empty database: one applies each migration,
	// the others wait on the advisory lock and find nothing left to do.
	pool := testdb.Connect(t, testdb.EmptyURL(t))
	var wg sync.WaitGroup
	applied := make([]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			applied[i], errs[i] = store.Migrate(context.Background(), pool)
		}()
	}
	wg.Wait()
	total := 0
	for i := range 4 {
		require.NoError(t, errs[i])
		total += applied[i]
	}
	entries, err := migrations.FS.ReadDir(".")
	require.NoError(t, err)
	sqlFiles := 0
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".sql") {
			sqlFiles++
		}
	}
	require.Equal(t, sqlFiles, total, "each migration applied exactly once")

	n, err := store.Migrate(context.Background(), pool)
	require.NoError(t, err)
	require.Zero(t, n)
}

// idle is a maintenance job's run that does nothing and asks for no rest.
func idle() (int, error) { return 0, nil }

func TestWithJobLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	inside, release, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		ran, err := b.store.WithJobLock(b.ctx, "sweep", func() (int, error) {
			close(inside)
			<-release
			return 0, nil
		})
		require.NoError(t, err)
		require.True(t, ran)
	}()
	<-inside
	ran, err := b.store.WithJobLock(b.ctx, "sweep", func() (int, error) {
		t.Error("a second replica ran the job while the first held it")
		return 0, nil
	})
	require.NoError(t, err)
	require.False(t, ran)
	ran, err = b.store.WithJobLock(b.ctx, "clean", idle)
	require.NoError(t, err)
	require.True(t, ran, "another job is not held up")
	close(release)
	<-done
	failed := errors.New("job failed")
	ran, err = b.store.WithJobLock(b.ctx, "sweep", func() (int, error) { return 9, failed })
	require.True(t, ran, "free again once released")
	require.ErrorIs(t, err, failed)
	ran, err = b.store.WithJobLock(b.ctx, "sweep", idle)
	require.NoError(t, err)
	require.True(t, ran, "a failed run does not rest the job")
}

// TestAJobRests: a run that asks for a rest of nine keeps the job from every
// replica for nine times as long as it held the lock, counted from its end;
// the other jobs run meanwhile, and the job runs again once the rest is over.
func TestAJobRests(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var start, end time.Time
	ran, err := b.store.WithJobLock(b.ctx, "sweep", func() (int, error) {
		start = time.Now()
		time.Sleep(200 * time.Millisecond) // a rest of 1.8 s: the next call comes well inside it
		end = time.Now()
		return 9, nil
	})
	require.NoError(t, err)
	require.True(t, ran)

	other := store.New(b.poolWith(t, func(*pgxpool.Config) {})) // another replica
	ran, err = other.WithJobLock(b.ctx, "sweep", func() (int, error) {
		t.Error("a replica ran the job while it rested")
		return 0, nil
	})
	require.NoError(t, err)
	require.False(t, ran)
	ran, err = other.WithJobLock(b.ctx, "clean", idle)
	require.NoError(t, err)
	require.True(t, ran, "another job does not rest")
	var again time.Time
	require.Eventually(t, func() bool {
		ran, err := other.WithJobLock(b.ctx, "sweep", func() (int, error) {
			again = time.Now()
			return 0, nil
		})
		require.NoError(t, err)
		return ran
	}, 10*time.Second, 5*time.Millisecond, "the job runs again after its rest")
	require.GreaterOrEqual(t, again.Sub(end), 9*end.Sub(start))

	// A later rest of the job holds as the first did.
	ran, err = other.WithJobLock(b.ctx, "sweep", func() (int, error) {
		time.Sleep(200 * time.Millisecond)
		return 9, nil
	})
	require.NoError(t, err)
	require.True(t, ran)
	ran, err = b.store.WithJobLock(b.ctx, "sweep", func() (int, error) {
		t.Error("a replica ran the job while it rested again")
		return 0, nil
	})
	require.NoError(t, err)
	require.False(t, ran)
}
