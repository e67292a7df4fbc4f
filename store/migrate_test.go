package store_test

import (
	"context"
	_ "embed"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/migrations"
	"github.com/rungworks/gateway/store"
)

//go:embed testdata/reservations_00010.sql
var reservations00010 string

//go:embed testdata/earlier_release_writes.sql
var earlierReleaseWrites string

// batch00010 is the batch of that fixture.
var batch00010 = uuid.MustParse("01900000-0000-7000-8000-0000000000b1")

// TestMigrationMovesReservations: migration 00011 replaces the reservation rows
// of batch items. A running item keeps its budget reservation on the item, a
// settled reservation not yet folded becomes a settlement, and a reservation
// no unfinished item holds is refunded; the counters then come out as if the
// items had settled under the old ledger. Replicas of the earlier release may
// still write reservations meanwhile: nothing comes of it.
func TestMigrationMovesReservations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, provider := migratedTo(t, 10)

	b := &testBundle{ctx: ctx, store: store.New(pool)}
	p := keyAt00010(t, pool)
	budget := int64(1000)
	b.limits(t, "acme", nil, &budget)
	_, err := pool.Exec(ctx, reservations00010)
	require.NoError(t, err)
	// Under 00010 the view read 350-60 charged (the settled item at its cost),
	// 40 spent and 100 reserved.
	_, err = provider.UpTo(ctx, 37) // the last to keep the retired table
	require.NoError(t, err)
	// The counters, as the usage view shows them (read without it, whose
	// sums by minute come with 00039).
	counters := func() *store.AccountLimits {
		l, err := b.store.Limits(ctx, "acme")
		require.NoError(t, err)
		return l
	}
	c := counters()
	require.Equal(t, int64(350-60-50), c.Daily.Charged, "the reservation no item held is refunded")
	require.Equal(t, []gateway.BudgetState{{Project: "default", Cap: &budget, Spent: 40, Reserved: 100}}, c.Projects, "the running item still holds its reservation")

	// A replica of the earlier release, still running during the upgrade,
	// writes into the retired table without error and without effect.
	_, err = pool.Exec(ctx, earlierReleaseWrites)
	require.NoError(t, err)
	require.Equal(t, c, counters())
	// Migration 00038, a release later, drops the retired table.
	_, err = provider.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, c, counters())

	// The running item completes under the new ledger, the queued one is
	// claimed (reserving on the cap) and completes too.
	running := store.ClaimedItem{BatchID: batch00010, Index: 0, Request: store.ItemRequest{Prompt: "item 0"}}
	require.Len(t, b.complete(t, owner, []store.ClaimedItem{running}, 70), 1)
	v := b.view(t, p)
	require.Equal(t, int64(350-60-50-30), v.Daily.Charged)
	require.Equal(t, gateway.BudgetState{Project: "default", Cap: &budget, Spent: 110, Reserved: 0}, v.Budget)
	claimed := b.claim(t, owner, 10, time.Minute)
	require.Len(t, claimed, 1)
	require.Equal(t, 2, claimed[0].Index)
	require.Equal(t, int64(100), b.view(t, p).Budget.Reserved)
	b.complete(t, owner, claimed, 20)

	n, err := b.store.ReconcileSettlements(ctx, 100)
	require.NoError(t, err)
	require.Positive(t, n)
	v = b.view(t, p)
	require.Equal(t, int64(350-60-50-30-80), v.Daily.Charged)
	require.Equal(t, gateway.BudgetState{Project: "default", Cap: &budget, Spent: 130, Reserved: 0}, v.Budget)
	batch, _ := b.batch(t, p, batch00010)
	require.Equal(t, gateway.BatchCompleted, batch.Status)
	require.Equal(t, int64(40+70+20), batch.Usage.TotalRungs)
}

// migratedTo is a database of its own migrated up to version, and the
// migrations' provider, for the test to go on with.
func migratedTo(t *testing.T, version int64) (*pgxpool.Pool, *goose.Provider) {
	t.Helper()
	pool := testdb.Connect(t, testdb.EmptyURL(t))
	sqlDB := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = sqlDB.Close() })
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS)
	require.NoError(t, err)
	_, err = provider.UpTo(context.Background(), version)
	require.NoError(t, err)
	return pool, provider
}

// keyAt00010 makes account acme, its project default and a key in it with the
// columns a schema at migration 00010 has, which later ones keep (today's
// statements write columns added since), and returns the key's principal.
func keyAt00010(t *testing.T, pool *pgxpool.Pool) *gateway.Principal {
	t.Helper()
	p := &gateway.Principal{
		KeyID: uuid.Must(uuid.NewV7()), ProjectID: uuid.Must(uuid.NewV7()), ProjectName: "default",
		AccountID: uuid.Must(uuid.NewV7()), AccountName: "acme", Tier: gateway.TierDeveloper, Scopes: []gateway.Scope{gateway.ScopeInference},
	}
	for _, stmt := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO accounts (id, name, tier) VALUES ($1, $2, $3)`, []any{p.AccountID, p.AccountName, string(p.Tier)}},
		{`INSERT INTO projects (id, account_id, name) VALUES ($1, $2, $3)`, []any{p.ProjectID, p.AccountID, p.ProjectName}},
		{`INSERT INTO api_keys (id, project_id, prefix, hash, scopes) VALUES ($1, $2, 'igw_00010key', '\x00', '{inference}')`, []any{p.KeyID, p.ProjectID}},
	} {
		_, err := pool.Exec(context.Background(), stmt.sql, stmt.args...)
		require.NoError(t, err)
	}
	return p
}

// TestTheSchemaHoldsOnlyWhatIsUsed: every function of the migrated schema is
// called by one of the store's queries, fires as a trigger, or is called by
// one that is; every table is named by one of those. What a migration retires
// for the replicas of the release before is dropped a release later (00038),
// not left behind: retired lists what is kept until then.
func TestTheSchemaHoldsOnlyWhatIsUsed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)

	files, err := filepath.Glob(filepath.Join("queries", "*.sql"))
	require.NoError(t, err)
	require.NotEmpty(t, files)
	var queries strings.Builder
	for _, f := range files {
		text, err := os.ReadFile(f)
		require.NoError(t, err)
		queries.WriteString(withoutComments(string(text)))
	}

	rows, err := pool.Query(ctx, `
		SELECT p.proname, p.prosrc, EXISTS (SELECT 1 FROM pg_trigger g WHERE g.tgfoid = p.oid)
		  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		 WHERE n.nspname = 'public'`)
	require.NoError(t, err)
	type function struct {
		body    string
		trigger bool
	}
	functions := map[string]function{}
	for rows.Next() {
		var name string
		var f function
		require.NoError(t, rows.Scan(&name, &f.body, &f.trigger))
		f.body = withoutComments(f.body)
		functions[name] = f
	}
	require.NoError(t, rows.Err())
	require.NotEmpty(t, functions)

	// The text that runs: the queries, then the body of every function they
	// call or that fires as a trigger, until no more is reached.
	reached := map[string]bool{}
	running := queries.String()
	for grew := true; grew; {
		grew = false
		for name, f := range functions {
			called := regexp.MustCompile(`\b` + name + `\s*\(`).MatchString(running)
			if !reached[name] && (f.trigger || called) {
				reached[name] = true
				running += f.body
				grew = true
			}
		}
	}
	// Kept a release for the replicas of the release before, then dropped
	// (by the migration that retired it, when one is listed).
	retired := map[string]string{"lease_rate": "00045", "batches_for_operator": "00046"}
	for name := range functions {
		if _, kept := retired[name]; kept {
			require.False(t, reached[name], "function %s is retired but still called", name)
			continue
		}
		require.True(t, reached[name], "function %s is never called", name)
	}
	for name := range retired {
		require.Contains(t, functions, name, "retired function %s was dropped: take it off the list", name)
	}

	var tables []string
	require.NoError(t, pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(c.relname::text), '{}') FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm') AND c.relname <> 'goose_db_version'`).Scan(&tables))
	require.NotEmpty(t, tables)
	for _, table := range tables {
		named := regexp.MustCompile(`\b` + table + `\b`).MatchString(running)
		require.True(t, named, "table %s is never named", table)
	}
}

// withoutComments is SQL text without its -- comments.
func withoutComments(sql string) string {
	return regexp.MustCompile(`--[^\n]*`).ReplaceAllString(sql, "")
}
