package store_test

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
	"github.com/rungworks/gateway/internal/proccpu"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// manyTenants fills the tables that hold a row per tenant (an account, its
// project and key, ten days of charges, a quota lease of another replica, a
// rate window and a batch settlement for each of n accounts) and analyzes
// them, as a deployment serving many tenants has them.
func manyTenants(tb testing.TB, ctx context.Context, st *store.Store, n int) {
	tb.Helper()
	tenants := `FROM projects p JOIN accounts a ON a.id = p.account_id WHERE a.name LIKE 'tenant%'`
	for _, statement := range []string{
		fmt.Sprintf(`INSERT INTO accounts (id, name, tier)
			SELECT gen_random_uuid(), 'tenant' || g, 'developer' FROM generate_series(1, %d) g`, n),
		`INSERT INTO projects (id, account_id, name, budget_cap_rungs)
			SELECT gen_random_uuid(), a.id, 'default', 1000000 FROM accounts a WHERE a.name LIKE 'tenant%'`,
		`INSERT INTO api_keys (id, project_id, prefix, hash, scopes)
			SELECT gen_random_uuid(), p.id, md5(p.id::text), '\x00', '{inference}' ` + tenants,
		`INSERT INTO daily_charges (account_id, day, charged_rungs)
			SELECT p.account_id, current_date - d, 10 FROM generate_series(0, 9) d, projects p
			  JOIN accounts a ON a.id = p.account_id WHERE a.name LIKE 'tenant%'`,
		`INSERT INTO quota_leases (id, owner, account_id, project_id, day, daily_rungs, budget_rungs, expires_at)
			SELECT gen_random_uuid(), gen_random_uuid(), p.account_id, p.id, current_date, 10, 10, now() + interval '1 hour' ` + tenants,
		`INSERT INTO rate_windows (key_id, window_start, count)
			SELECT k.id, date_trunc('minute', now()), 1 FROM api_keys k WHERE length(k.prefix) = 32`,
		`INSERT INTO batch_settlements (account_id, day, project_id, day_rungs, spent_rungs, reserved_rungs)
			SELECT p.account_id, current_date, p.id, 0, 0, 0 ` + tenants,
		`ANALYZE`,
	} {
		_, err := st.Pool().Exec(ctx, statement)
		require.NoError(tb, err, statement)
	}
}

// tenantTables are the tables with a row (or more) per tenant: a statement
// that serves one tenant, or a few, reads them by key.
var tenantTables = []string{"accounts", "projects", "api_keys", "daily_charges", "quota_leases", "rate_windows", "batch_settlements"}

var (
	// tenantTableScan matches a plan's line that reads a tenant table whole.
	tenantTableScan = regexp.MustCompile(`Seq Scan on (` + strings.Join(tenantTables, "|") + `)\b`)
	// indexRead matches a plan's line that reads an index, naming its table.
	indexRead = regexp.MustCompile(`using (\w+) on (\w+)`)
)

// TestMeteringStatementsReadTenantsByKey: with many tenants' rows, each
// metering statement of the hot path and of its maintenance reads the rows of
// the tenants it serves by key, in generic plans (those a prepared statement
// settles on): never a whole table, nor a whole index. A settlement that read
// every quota lease cost 2 ms of PostgreSQL's time at 20,000 leases, a fold
// that read every day's charge of every account 17 ms at 200,000; both grew
// with the number of tenants (and the fold with the days served).
func TestMeteringStatementsReadTenantsByKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	token, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1_000_000)))
	explained, plans := b.explained(t)
	manyTenants(t, b.ctx, explained, 3000)
	_, err := explained.Pool().Exec(b.ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	setUp := len(plans())

	_, err = explained.LookupKey(b.ctx, token)
	require.NoError(t, err)
	now := time.Now()
	_, err = explained.LeaseRate(b.ctx, p.KeyID, now, 600, 2)
	require.NoError(t, err)
	require.NoError(t, explained.ReturnRate(b.ctx, []store.RateReturn{{KeyID: p.KeyID, Window: now.Truncate(time.Minute), Count: 1}}))
	lease, gone := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	for _, id := range []uuid.UUID{lease, gone} {
		g, err := explained.GrantQuota(b.ctx, store.QuotaRequest{
			LeaseID: id, Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID, Day: time.Now(),
			DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: 100, Share: 4, Lease: time.Hour,
		})
		require.NoError(t, err)
		require.Equal(t, gateway.AdmitOK, g.Outcome)
	}
	held, err := explained.RenewQuotaLeases(b.ctx, owner, []uuid.UUID{lease, gone}, time.Hour)
	require.NoError(t, err)
	require.Len(t, held, 2)
	n, err := explained.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{gone})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	// One request under a lease held, one under the lease folded, charged
	// directly.
	for range 3 {
		require.NoError(t, explained.SettleRequests(b.ctx, []store.Settlement{
			{Record: record(p, uuid.Must(uuid.NewV7()), 10), LeaseID: &lease},
			{Record: record(p, uuid.Must(uuid.NewV7()), 10), LeaseID: &gone},
		}))
	}
	n, err = explained.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{lease})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	_, err = explained.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	_, err = db.New().ReconcileSettlements(b.ctx, explained.Pool(), db.ReconcileSettlementsParams{MaxRows: 100, Skip: []uuid.UUID{}, AccountID: &p.AccountID})
	require.NoError(t, err)
	// A batch's items are admitted, claimed and completed (their settlement
	// is kept for the reconciler).
	eb := &testBundle{ctx: b.ctx, store: explained}
	eb.newBatch(t, p, 3, 10, "", day())
	require.Len(t, eb.complete(t, owner, eb.claim(t, owner, 3, time.Minute), 10), 3)
	today := gateway.UTCDay(time.Now())
	v, err := explained.Usage(b.ctx, p, today, today.Add(24*time.Hour))
	require.NoError(t, err)
	require.Equal(t, int64(90), v.Daily.Charged, "every request charged once, under its lease or directly")
	require.Equal(t, int64(90), v.Budget.Spent)
	_, err = explained.ReconcileSettlements(b.ctx, 100)
	require.NoError(t, err)

	all := plans()[setUp:]
	var whole []string
	for _, plan := range all {
		if tenantTableScan.MatchString(plan) {
			whole = append(whole, plan)
		}
		for _, index := range tenantIndexes(plan) {
			if len(scansWithoutCond(plan, index)) > 0 {
				whole = append(whole, plan)
			}
		}
	}
	require.Empty(t, whole, "plans that read a tenant table or index whole")
	for _, statement := range []string{"INSERT INTO requests", "charge_directly", "UPDATE projects p SET spent_rungs", "fold_quota_leases", "reconcile_settlements", "lease_rate", "return_rate", "grant_quota"} {
		require.Contains(t, strings.Join(all, "\n"), statement, "%s was explained", statement)
	}
}

// TestSettlementKeepsItsPlan: among many tenants, the settlement's prepared
// statement settles on its generic plan after PostgreSQL's five custom ones,
// rather than being planned again for every group. With the leases it
// charges named by the group's lease ids as a parameter (an array the
// generic plan takes for ten), the generic plan looked dearer than a plan
// made for the group's one lease, and at 10,000 tenants every settlement was
// planned again: 400 µs of PostgreSQL's time instead of 210.
func TestSettlementKeepsItsPlan(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	manyTenants(t, b.ctx, b.store, 10_000)
	lease := uuid.Must(uuid.NewV7())
	b.grant(t, p, lease, 100, 16, time.Hour)
	single, one := singleConnection(t, b.store)
	for range 10 {
		require.NoError(t, single.SettleRequests(b.ctx, []store.Settlement{{Record: record(p, uuid.Must(uuid.NewV7()), 10), LeaseID: &lease}}))
	}
	var generic, custom int64
	require.NoError(t, one.QueryRow(b.ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '-- name: SettleRequests %'`).Scan(&generic, &custom))
	require.Equal(t, int64(5), custom, "PostgreSQL's five custom plans, then none")
	require.Equal(t, int64(5), generic)
}

// tenantIndexes returns the indexes of the tenant tables plan reads.
func tenantIndexes(plan string) []string {
	var indexes []string
	for _, m := range indexRead.FindAllStringSubmatch(plan, -1) {
		if slices.Contains(tenantTables, m[2]) {
			indexes = append(indexes, m[1])
		}
	}
	return indexes
}

// BenchmarkMeteringAmongTenants: a settlement under a lease (and a group
// under two leases), and a slice granted then folded back, as the tables
// hold few tenants and many. The figures do not grow with the tenants.
func BenchmarkMeteringAmongTenants(b *testing.B) {
	for _, tenants := range []int{100, 10_000} {
		b.Run(fmt.Sprintf("tenants=%d", tenants), func(b *testing.B) {
			ctx := context.Background()
			st := store.New(testdb.New(b))
			tier := gateway.TierDeveloper
			token, err := st.CreateKey(ctx, store.CreateKeyParams{Account: "acme", Project: "default", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
			require.NoError(b, err)
			p, err := st.LookupKey(ctx, token)
			require.NoError(b, err)
			manyTenants(b, ctx, st, tenants)
			grant := func(lease uuid.UUID) {
				_, err := st.GrantQuota(ctx, store.QuotaRequest{
					LeaseID: lease, Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID, Day: time.Now(),
					DefaultCeiling: 1 << 40, Need: 10, Share: 1 << 20, Lease: time.Hour,
				})
				require.NoError(b, err)
			}
			// A group of one request under its lease, and a group of two
			// under two leases (sent after their lock, in one batch).
			for _, c := range []struct {
				name   string
				leases int
			}{{"settle", 1}, {"settle-two-leases", 2}} {
				b.Run(c.name, func(b *testing.B) {
					leases := make([]uuid.UUID, c.leases)
					for i := range leases {
						leases[i] = uuid.Must(uuid.NewV7())
						grant(leases[i])
					}
					// One connection, whose server process's CPU is counted.
					single, one := singleConnection(b, st)
					cpu := backendCPU(b, one)
					group := make([]store.Settlement, c.leases)
					for b.Loop() {
						for i := range group {
							group[i] = store.Settlement{Record: record(p, uuid.Must(uuid.NewV7()), 10), LeaseID: &leases[i]}
						}
						if err := single.SettleRequests(ctx, group); err != nil {
							b.Fatal(err)
						}
					}
					cpu.report(b)
				})
			}
			b.Run("grant-fold", func(b *testing.B) {
				for b.Loop() {
					lease := uuid.Must(uuid.NewV7())
					grant(lease)
					if n, err := st.FoldQuotaLeases(ctx, owner, []uuid.UUID{lease}); err != nil || n != 1 {
						b.Fatalf("folded %d: %v", n, err)
					}
				}
			})
		})
	}
}

// singleConnection is a store on a pool of one connection to st's database,
// closed when the test ends: what it runs is on one server process, in one
// session.
func singleConnection(tb testing.TB, st *store.Store) (*store.Store, *pgxpool.Pool) {
	tb.Helper()
	pool, err := store.Connect(context.Background(), st.Pool().Config().ConnString(), tb.Name(), 1)
	require.NoError(tb, err)
	tb.Cleanup(pool.Close)
	return store.New(pool), pool
}

// backendCPUCounter counts the CPU time of a connection's server process.
type backendCPUCounter struct {
	pid   int
	start time.Duration
}

// backendCPU starts counting the CPU time of the server process behind pool's
// one connection; nil when that process cannot be read (a server on another
// machine, or in a container).
func backendCPU(b *testing.B, pool *pgxpool.Pool) *backendCPUCounter {
	b.Helper()
	var pid int
	require.NoError(b, pool.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	start, err := proccpu.Of(pid)
	if err != nil {
		return nil
	}
	return &backendCPUCounter{pid: pid, start: start}
}

// report adds the server process's CPU time per operation to b's results
// ("pg-µs/op"), to the clock tick: run enough operations for a few hundred
// ticks (-benchtime 5000x).
func (c *backendCPUCounter) report(b *testing.B) {
	if c == nil {
		return
	}
	end, err := proccpu.Of(c.pid)
	require.NoError(b, err)
	b.ReportMetric(float64((end-c.start).Microseconds())/float64(b.N), "pg-µs/op")
}
