package store_test

import (
	"context"
	_ "embed"
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
	pool := testdb.Connect(t, testdb.EmptyURL(t))
	sqlDB := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = sqlDB.Close() })
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS)
	require.NoError(t, err)
	_, err = provider.UpTo(ctx, 10)
	require.NoError(t, err)

	b := &testBundle{ctx: ctx, store: store.New(pool)}
	p := keyAt00010(t, pool)
	budget := int64(1000)
	b.limits(t, "acme", nil, &budget)
	_, err = pool.Exec(ctx, reservations00010)
	require.NoError(t, err)
	// Under 00010 the view read 350-60 charged (the settled item at its cost),
	// 40 spent and 100 reserved.
	_, err = provider.Up(ctx)
	require.NoError(t, err)
	v := b.view(t, p)
	require.Equal(t, int64(350-60-50), v.Daily.Charged, "the reservation no item held is refunded")
	require.Equal(t, gateway.BudgetState{Project: "default", Cap: &budget, Spent: 40, Reserved: 100}, v.Budget, "the running item still holds its reservation")

	// A replica of the earlier release, still running during the upgrade,
	// writes into the retired table without error and without effect.
	_, err = pool.Exec(ctx, earlierReleaseWrites)
	require.NoError(t, err)
	require.Equal(t, v, b.view(t, p))

	// The running item completes under the new ledger, the queued one is
	// claimed (reserving on the cap) and completes too.
	running := store.ClaimedItem{BatchID: batch00010, Index: 0, Request: store.ItemRequest{Prompt: "item 0"}}
	require.Len(t, b.complete(t, owner, []store.ClaimedItem{running}, 70), 1)
	v = b.view(t, p)
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

// keyAt00010 makes account acme, its project default and a key in it with the
// columns a schema at migration 00010 has (today's statements write columns
// added since), and returns the key's principal.
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
