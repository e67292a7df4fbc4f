package store_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// settle commits one request of cost total under lease (nil: none).
func (b *testBundle) settle(t *testing.T, p *gateway.Principal, lease *uuid.UUID, total int64) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: record(p, id, total), LeaseID: lease}}))
	return id
}

// insertRequest stores r as a completed request's row alone (no evidence,
// no charge), with the columns every schema since migration 00038 has,
// through conn: the pool, or a transaction left open.
func (b *testBundle) insertRequest(t *testing.T, conn db.DBTX, r gateway.UsageRecord) {
	t.Helper()
	_, err := conn.Exec(b.ctx, `
		INSERT INTO requests (id, account_id, project_id, api_key_id, model, entry_point, status,
		                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
		VALUES ($1, $2, $3, $4, $5, $6, 'completed', $7, $8, $9, $10, $11, $12, $13)`,
		r.RequestID, r.Principal.AccountID, r.Principal.ProjectID, r.Principal.KeyID, string(r.Model), string(r.Entry),
		r.Usage.InputTokens, r.Usage.OutputTokens, r.Usage.InputRungs, r.Usage.OutputRungs, r.Usage.TotalRungs, r.CreatedAt, r.CompletedAt)
	require.NoError(t, err)
}

func record(p *gateway.Principal, id uuid.UUID, total int64) gateway.UsageRecord {
	now := time.Now().UTC()
	return gateway.UsageRecord{
		RequestID: id, Principal: p, Model: gateway.ModelInstant, Entry: gateway.EntryResponses,
		Usage:     gateway.Usage{InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: total - 1, TotalRungs: total},
		CreatedAt: now, CompletedAt: now, EvidenceExpiresAt: now.Add(time.Hour),
	}
}

// grant asks for a slice of at least need (1/share of what is left) on id,
// a lease that lasts lease (negative: it has run out).
func (b *testBundle) grant(t *testing.T, p *gateway.Principal, id uuid.UUID, need int64, share int, lease time.Duration) store.QuotaGrant {
	t.Helper()
	return b.grantOn(t, time.Now(), p, id, need, share, lease)
}

// grantOn is grant on the account's UTC day of day.
func (b *testBundle) grantOn(t *testing.T, day time.Time, p *gateway.Principal, id uuid.UUID, need int64, share int, lease time.Duration) store.QuotaGrant {
	t.Helper()
	g, err := b.store.GrantQuota(b.ctx, store.QuotaRequest{
		LeaseID: id, Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID, Day: day,
		DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: need, Share: share, Lease: lease,
	})
	require.NoError(t, err)
	return g
}

// owner is the replica the tests' leases belong to.
var owner = uuid.MustParse("01900000-0000-7000-8000-00000000000a")

func (b *testBundle) view(t *testing.T, p *gateway.Principal) *gateway.UsageView {
	t.Helper()
	day := gateway.UTCDay(time.Now())
	v, err := b.store.Usage(b.ctx, p, day, day.Add(24*time.Hour))
	require.NoError(t, err)
	return v
}

func (b *testBundle) limits(t testing.TB, account string, daily, budget *int64) {
	t.Helper()
	require.NoError(t, b.store.SetLimits(b.ctx, store.SetLimitsParams{Account: account, DailyRungs: daily, Project: "default", BudgetRungs: budget}))
}

func ptr[T any](v T) *T { return &v }

// TestQuotaLeaseLifecycle: a slice is charged and reserved when granted; the
// view counts what was used under it, never its unused part; folding it moves
// the day and the budget to what was used.
func TestQuotaLeaseLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(2000)), ptr(int64(1000)))
	lease := uuid.Must(uuid.NewV7())

	g := b.grant(t, p, lease, 100, 4, time.Hour)
	require.Equal(t, store.QuotaGrant{Outcome: gateway.AdmitOK, Granted: 250, Capped: true, Ceiling: 2000, Cap: 1000, Left: 750}, g,
		"a quarter of what the cap leaves, the smaller of the two")
	g = b.grant(t, p, lease, 10, 4, time.Hour)
	require.Equal(t, int64(187), g.Granted, "slices shrink as the remainder does")
	v := b.view(t, p)
	require.Zero(t, v.Daily.Charged, "an unused slice is no charge")
	require.Zero(t, v.Budget.Reserved)

	b.settle(t, p, &lease, 30)
	b.settle(t, p, &lease, 50)
	v = b.view(t, p)
	require.Equal(t, int64(80), v.Daily.Charged)
	require.Equal(t, int64(80), v.Budget.Spent)
	require.Equal(t, int64(2), v.Totals.Requests)

	n, err := b.store.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{lease})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, v, b.view(t, p), "folding changes nothing the view shows")
	g = b.grant(t, p, uuid.Must(uuid.NewV7()), 920, 4, time.Hour)
	require.Equal(t, int64(920), g.Granted, "everything the cap leaves after the fold")

	// A ceiling set below what is charged leaves nothing, not less.
	b.limits(t, "acme", ptr(int64(50)), nil)
	v = b.view(t, p)
	require.Equal(t, int64(80), v.Daily.Charged)
	require.Zero(t, v.Daily.Remaining)
}

// TestReconcileFoldsUpToItsLimitPassingOverRowsInUse: a run folds at most
// its limit of settlements, and passes over those another transaction holds
// (a run on another replica) rather than wait for them (here, longer than its
// lock timeout: waiting, it would fail).
func TestReconcileFoldsUpToItsLimitPassingOverRowsInUse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO batch_settlements (account_id, day, project_id, day_rungs, spent_rungs, reserved_rungs)
		SELECT $1, $2::date, $3, i, 0, 0 FROM generate_series(1, 4) i`, p.AccountID, gateway.UTCDay(time.Now()), p.ProjectID)
	require.NoError(t, err)
	tx, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM batch_settlements WHERE day_rungs = 1 FOR UPDATE`)
	require.NoError(t, err)

	impatient := b.impatient(t)
	n, err := impatient.ReconcileSettlements(b.ctx, 2)
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "its limit")
	n, err = impatient.ReconcileSettlements(b.ctx, 2)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "all but the one held")
	require.NoError(t, tx.Rollback(b.ctx))
	n, err = impatient.ReconcileSettlements(b.ctx, 2)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, int64(1+2+3+4), b.view(t, p).Daily.Charged)
}

// TestAFoldMovesEachLeaseOnItsOwnDay: leases of one account on two days,
// folded together, each move their own day's charge (one by what was used
// past its slice, the other by its unused slice).
func TestAFoldMovesEachLeaseOnItsOwnDay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	today := gateway.UTCDay(time.Now())
	yesterday := today.Add(-24 * time.Hour)
	overused := uuid.Must(uuid.NewV7())
	require.Equal(t, int64(100), b.grantOn(t, yesterday, p, uuid.Must(uuid.NewV7()), 100, 1<<30, -time.Second).Granted)
	require.Equal(t, int64(10), b.grantOn(t, today, p, overused, 10, 1<<30, -time.Second).Granted)
	b.settle(t, p, &overused, 50)

	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(2), n)
	charged := func(day time.Time) (c int64) {
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT charged_rungs FROM daily_charges WHERE account_id = $1 AND day = $2`,
			p.AccountID, day).Scan(&c))
		return c
	}
	require.Zero(t, charged(yesterday), "the unused slice came back")
	require.Equal(t, int64(50), charged(today), "what was used, past the slice")
}

// TestAFoldNeverTakesACounterBelowZero: a fold returning more than a
// counter holds (here set lower by hand) leaves it at zero, not less.
func TestAFoldNeverTakesACounterBelowZero(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	b.grant(t, p, uuid.Must(uuid.NewV7()), 100, 1<<30, -time.Second)
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE daily_charges SET charged_rungs = 10 WHERE account_id = $1`, p.AccountID)
	require.NoError(t, err)
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE projects SET reserved_rungs = 10 WHERE id = $1`, p.ProjectID)
	require.NoError(t, err)

	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	v := b.view(t, p)
	require.Zero(t, v.Daily.Charged)
	require.Zero(t, v.Budget.Reserved)
}

// TestAFoldPassesOverLeasesInUse: a fold of expired leases takes those no
// transaction holds (a settlement under a lease locks it) and does not wait
// for the others (here, longer than its lock timeout: waiting, it would
// fail); they are folded by a later run.
func TestAFoldPassesOverLeasesInUse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	held, free := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	b.grant(t, p, held, 10, 1<<30, -time.Second)
	b.grant(t, p, free, 10, 1<<30, -time.Second)
	tx, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM quota_leases WHERE id = $1 FOR NO KEY UPDATE`, held)
	require.NoError(t, err)

	impatient := b.impatient(t)
	n, err := impatient.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.NoError(t, tx.Rollback(b.ctx))
	n, err = impatient.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
}

func TestGrantQuotaRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(250)), nil)
	g := b.grant(t, p, uuid.Must(uuid.NewV7()), 200, 1, time.Hour)
	require.Equal(t, int64(250), g.Granted)
	require.False(t, g.Capped)
	require.Zero(t, g.Left, "the grant took the whole day")
	g = b.grant(t, p, uuid.Must(uuid.NewV7()), 1, 1, time.Hour)
	require.Equal(t, gateway.AdmitDaily, g.Outcome)
	require.Zero(t, g.Granted)
	require.Equal(t, int64(250), g.Ceiling)
	require.Equal(t, int64(250), g.Free, "the slice is held, not charged for good")

	_, q := b.key(t, "budgeted", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "budgeted", ptr(int64(100)), ptr(int64(60)))
	g = b.grant(t, q, uuid.Must(uuid.NewV7()), 101, 1, time.Hour)
	require.Equal(t, gateway.AdmitBudget, g.Outcome, "the cap is checked first")
	require.Equal(t, int64(60), g.Cap)
	require.Equal(t, int64(60), g.Free)
	g = b.grant(t, q, uuid.Must(uuid.NewV7()), 60, 1, time.Hour)
	require.Equal(t, gateway.AdmitOK, g.Outcome)
	v := b.view(t, q)
	require.Zero(t, v.Daily.Charged)
	// Spent past the cap (the overspend D5 bounds): nothing is free, not less.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE projects SET spent_rungs = 75 WHERE id = $1`, q.ProjectID)
	require.NoError(t, err)
	g = b.grant(t, q, uuid.Must(uuid.NewV7()), 1, 1, time.Hour)
	require.Equal(t, gateway.AdmitBudget, g.Outcome)
	require.Zero(t, g.Free)
	require.Zero(t, g.Left)
	// Charged past a lowered ceiling: nothing is left, not less.
	b.limits(t, "acme", ptr(int64(100)), nil)
	g = b.grant(t, p, uuid.Must(uuid.NewV7()), 1, 1, time.Hour)
	require.Equal(t, gateway.AdmitDaily, g.Outcome)
	require.Zero(t, g.Left)
	_, d := b.key(t, "plain", gateway.TierDeveloper, gateway.ScopeInference)
	require.Equal(t, int64(10_000_000), b.view(t, d).Daily.Ceiling, "developer default")

	_, f := b.key(t, "freeco", gateway.TierFree, gateway.ScopeInference)
	require.Equal(t, int64(1_000_000), b.view(t, f).Daily.Ceiling, "free default")
}

// TestGrantsNeverPassTheCap: 200 concurrent grants against a cap that fits
// 10 never grant an eleventh.
func TestGrantsNeverPassTheCap(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(1000)), ptr(int64(1000)))
	var granted atomic.Int64
	var wg sync.WaitGroup
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g := b.grant(t, p, uuid.Must(uuid.NewV7()), 100, 100, time.Hour)
			granted.Add(g.Granted)
		}()
	}
	wg.Wait()
	require.Equal(t, int64(1000), granted.Load())
}

// TestGrantsOfTwoDaysShareTheCap: a grant on one day's charge (as around
// midnight) reads the project's budget once a grant on the other day's
// commits, not before, though it waits for no charge of that day: the two
// never reserve past the cap.
func TestGrantsOfTwoDaysShareTheCap(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(100)))
	yesterday, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = yesterday.Rollback(b.ctx) }()
	var outcome string
	require.NoError(t, yesterday.QueryRow(b.ctx, `SELECT outcome FROM grant_quota($1, $2, $3, $4, $5, $6, 100, 1, now() + interval '1 hour')`,
		uuid.Must(uuid.NewV7()), owner, p.AccountID, p.ProjectID, gateway.UTCDay(time.Now()).Add(-24*time.Hour),
		p.Tier.DefaultDailyCeiling()).Scan(&outcome))
	require.Equal(t, gateway.AdmitOK, outcome)

	today := make(chan store.QuotaGrant, 1)
	go func() {
		g, err := b.store.GrantQuota(b.ctx, store.QuotaRequest{
			LeaseID: uuid.Must(uuid.NewV7()), Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID,
			Day: time.Now(), DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: 100, Share: 1, Lease: time.Hour,
		})
		assert.NoError(t, err)
		today <- g
	}()
	b.requireOneWaiting(t, "today's grant waits for the project")
	require.NoError(t, yesterday.Commit(b.ctx))
	g := <-today
	require.Equal(t, gateway.AdmitBudget, g.Outcome, "yesterday's grant took the budget")
	require.Zero(t, g.Granted)
}

// TestSettleRequestsTwice: a group sent again (its reply was lost after the
// commit) is stored and billed once.
func TestSettleRequestsTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	lease := uuid.Must(uuid.NewV7())
	b.grant(t, p, lease, 100, 16, time.Hour)
	cited := record(p, uuid.Must(uuid.NewV7()), 20)
	cited.Sources, cited.Verdict = []gateway.Source{{Title: "T", URL: "https://x"}}, "supported"
	group := []store.Settlement{
		{Record: record(p, uuid.Must(uuid.NewV7()), 10), LeaseID: &lease},
		{Record: cited, LeaseID: &lease},
		{Record: record(p, uuid.Must(uuid.NewV7()), 40)},
	}
	require.NoError(t, b.store.SettleRequests(b.ctx, group))
	require.NoError(t, b.store.SettleRequests(b.ctx, group))
	v := b.view(t, p)
	require.Equal(t, int64(3), v.Totals.Requests)
	require.Equal(t, int64(70), v.Totals.TotalRungs)
	require.Equal(t, int64(70), v.Daily.Charged)
	require.Equal(t, int64(70), v.Budget.Spent)
}

// TestADirectChargeGoesToTheDayTheRequestBegan: a request charged directly
// (no lease) is charged to the UTC day it began, whose ceiling admitted it,
// though it ended the day after.
func TestADirectChargeGoesToTheDayTheRequestBegan(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	midnight := gateway.UTCDay(time.Now())
	r := record(p, uuid.Must(uuid.NewV7()), 30)
	r.CreatedAt, r.CompletedAt = midnight.Add(-time.Second), midnight.Add(time.Second)
	require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: r}}))
	rows, err := b.store.Pool().Query(b.ctx, `SELECT day, charged_rungs FROM daily_charges WHERE account_id = $1`, p.AccountID)
	require.NoError(t, err)
	type charge struct {
		Day     time.Time
		Charged int64
	}
	charges, err := pgx.CollectRows(rows, pgx.RowToStructByPos[charge])
	require.NoError(t, err)
	require.Equal(t, []charge{{midnight.Add(-24 * time.Hour), 30}}, charges)
}

// TestSettleUnderAFoldedLease: a request settling after its lease was folded
// (its replica lost the database past the lease) is charged directly, once.
func TestSettleUnderAFoldedLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	lease := uuid.Must(uuid.NewV7())
	b.grant(t, p, lease, 100, 1, -time.Second)
	b.settle(t, p, &lease, 25)
	n, err := b.store.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	v := b.view(t, p)
	require.Equal(t, int64(25), v.Daily.Charged)
	require.Equal(t, int64(25), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved, "the dead replica's slice came back")

	b.settle(t, p, &lease, 35)
	v = b.view(t, p)
	require.Equal(t, int64(60), v.Daily.Charged)
	require.Equal(t, int64(60), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)
}

// keyedRow names a row of table by the columns of its key and their values.
type keyedRow struct {
	table string
	key   []string
	value []any
}

func (r keyedRow) where() string {
	conds := make([]string, len(r.key))
	for i, col := range r.key {
		conds[i] = fmt.Sprintf("%s = $%d", col, i+1)
	}
	return strings.Join(conds, " AND ")
}

// requireLocksInOrder: op, given a store whose planner scans the heap (as
// over a small table), locks first before second (of one table: the row
// after it in key order), even with first's row moved past second's in the
// heap. A transaction holding first (as a claim, a grant or another
// replica's statement that locks in that order would) while op waits, then
// takes second and commits; op then succeeds. An op that took second before
// waiting for first deadlocked with it, and PostgreSQL failed one of the two
// after a second.
func (b *testBundle) requireLocksInOrder(t *testing.T, first, second keyedRow, op func(*store.Store) error) {
	t.Helper()
	_, err := b.store.Pool().Exec(b.ctx, fmt.Sprintf(`UPDATE %s SET %s = %[2]s WHERE %s`, first.table, first.key[0], first.where()), first.value...)
	require.NoError(t, err, "the first row moves past the second")
	heap := b.unindexed(t)

	holder, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(b.ctx) }()
	lock := func(r keyedRow) error {
		ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
		defer cancel()
		_, err := holder.Exec(ctx, fmt.Sprintf(`SELECT 1 FROM %s WHERE %s FOR NO KEY UPDATE`, r.table, r.where()), r.value...)
		return err
	}
	require.NoError(t, lock(first))
	done := make(chan error, 1)
	go func() { done <- op(heap) }()
	b.requireOneWaiting(t, "op waits for the first row")
	require.NoError(t, lock(second), "the holder takes the second row")
	require.NoError(t, holder.Commit(b.ctx))
	require.NoError(t, <-done)
}

// requireOneWaiting waits until one statement of the test's database waits
// for a lock.
func (b *testBundle) requireOneWaiting(t *testing.T, msg string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting int
		err := b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 10*time.Second, 5*time.Millisecond, msg)
}

// twoLeases makes the keys of two accounts, acme (p) and globex (q), and
// grants each a slice under a lease of an hour (lp, lq).
func (b *testBundle) twoLeases(t *testing.T) (p, q *gateway.Principal, lp, lq uuid.UUID) {
	t.Helper()
	_, p = b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, q = b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	lp, lq = uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	b.grant(t, p, lp, 10, 4, time.Hour)
	b.grant(t, q, lq, 10, 4, time.Hour)
	return p, q, lp, lq
}

// inKeyOrder returns a and b, the lesser first.
func inKeyOrder(a, b uuid.UUID) (first, second uuid.UUID) {
	if bytes.Compare(b[:], a[:]) < 0 {
		return b, a
	}
	return a, b
}

// TestDirectChargesLockProjectsInKeyOrder: a settlement of requests charged
// directly (no lease) locks their projects in key order, as a claim of batch
// items does.
func TestDirectChargesLockProjectsInKeyOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, q := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	first, second := inKeyOrder(p.ProjectID, q.ProjectID)
	b.requireLocksInOrder(t, keyedRow{"projects", []string{"id"}, []any{first}}, keyedRow{"projects", []string{"id"}, []any{second}},
		func(st *store.Store) error {
			return st.SettleRequests(b.ctx, []store.Settlement{
				{Record: record(p, uuid.Must(uuid.NewV7()), 3)}, {Record: record(q, uuid.Must(uuid.NewV7()), 5)},
			})
		})
	require.Equal(t, int64(3), b.view(t, p).Budget.Spent)
	require.Equal(t, int64(5), b.view(t, q).Budget.Spent)
}

// TestSettlementsAndRenewalsLockLeasesInKeyOrder: a settlement whose group
// charges two leases, and the renewal of a replica's leases, which run side
// by side in a replica, lock the leases in key order, as the fold of leases
// does.
func TestSettlementsAndRenewalsLockLeasesInKeyOrder(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"settlement", "renewal"} {
		renewal := name == "renewal"
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			p, q, lp, lq := b.twoLeases(t)
			first, second := inKeyOrder(lp, lq)
			b.requireLocksInOrder(t, keyedRow{"quota_leases", []string{"id"}, []any{first}}, keyedRow{"quota_leases", []string{"id"}, []any{second}},
				func(st *store.Store) error {
					if renewal {
						held, err := st.RenewQuotaLeases(b.ctx, owner, []uuid.UUID{lp, lq}, 2*time.Hour)
						if err == nil && len(held) != 2 {
							err = fmt.Errorf("renewed %d leases of 2", len(held))
						}
						return err
					}
					return st.SettleRequests(b.ctx, []store.Settlement{
						{Record: record(p, uuid.Must(uuid.NewV7()), 3), LeaseID: &lp}, {Record: record(q, uuid.Must(uuid.NewV7()), 5), LeaseID: &lq},
					})
				})
			if !renewal {
				require.Equal(t, int64(3), b.view(t, p).Daily.Charged, "charged under its lease")
				require.Equal(t, int64(5), b.view(t, q).Daily.Charged)
			}
		})
	}
}

// TestASettlementHoldsItsLeasesUntilItEnds: a group that charges two leases
// locks them in its own transaction (LockQuotaLeases is sent with the
// settlement, not committed before it), so they stay locked, in key order,
// until its update has run: a settlement kept waiting (here for one of its
// requests, which another transaction is inserting) holds both, then
// commits. Were the locks released before the update, the update could take
// them in the order of its plan and deadlock with a renewal.
func TestASettlementHoldsItsLeasesUntilItEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, q, lp, lq := b.twoLeases(t)
	x := record(p, uuid.Must(uuid.NewV7()), 3)

	inserting, err := b.store.Pool().Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = inserting.Rollback(b.ctx) }()
	b.insertRequest(t, inserting, x)

	done := make(chan error, 1)
	go func() {
		done <- b.store.SettleRequests(b.ctx, []store.Settlement{
			{Record: x, LeaseID: &lp}, {Record: record(q, uuid.Must(uuid.NewV7()), 5), LeaseID: &lq},
		})
	}()
	b.requireOneWaiting(t, "the settlement waits for the request being inserted")
	for _, lease := range []uuid.UUID{lp, lq} {
		_, err := b.store.Pool().Exec(b.ctx, `SELECT 1 FROM quota_leases WHERE id = $1 FOR NO KEY UPDATE NOWAIT`, lease)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "lease %s is locked while its settlement waits", lease)
		require.Equal(t, "55P03", pgErr.Code, "lock_not_available")
	}

	require.NoError(t, inserting.Rollback(b.ctx))
	require.NoError(t, <-done)
	require.Equal(t, int64(3), b.view(t, p).Daily.Charged, "charged under its lease")
	require.Equal(t, int64(5), b.view(t, q).Daily.Charged)
}

// TestTodaysChargeCountsTodayOnly: the day's charge counts the settlements
// not yet folded and the leases of that day, not another day's.
func TestTodaysChargeCountsTodayOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	yesterday := gateway.UTCDay(time.Now()).Add(-24 * time.Hour)
	lease := uuid.Must(uuid.NewV7())
	g, err := b.store.GrantQuota(b.ctx, store.QuotaRequest{
		LeaseID: lease, Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID, Day: yesterday,
		DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: 10, Share: 1000, Lease: time.Hour,
	})
	require.NoError(t, err)
	require.Equal(t, gateway.AdmitOK, g.Outcome)
	b.settle(t, p, &lease, 30)
	_, err = b.store.Pool().Exec(b.ctx, `INSERT INTO batch_settlements (account_id, day, project_id, day_rungs, spent_rungs, reserved_rungs)
		VALUES ($1, $2, $3, 40, 0, 0)`, p.AccountID, yesterday, p.ProjectID)
	require.NoError(t, err)
	require.Zero(t, b.view(t, p).Daily.Charged, "yesterday's lease and settlement are no charge today")
}

// TestOnlyASettlementUnderSeveralLeasesLocksThemFirst: a group under one
// lease (named by several requests, beside requests under none) is sent as
// its one statement; a group under two is sent after their lock, in one
// batch. Each is stored with its status.
func TestOnlyASettlementUnderSeveralLeasesLocksThemFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, q, lp, lq := b.twoLeases(t)
	names := &statementNames{}
	traced := b.traced(t, names)
	_, err := traced.Pool().Exec(b.ctx, "SELECT 1") // its connection is set up (BoundLostSessions)
	require.NoError(t, err)
	settle := func(group ...store.Settlement) []string {
		t.Helper()
		names.take()
		require.NoError(t, traced.SettleRequests(b.ctx, group))
		return names.take()
	}
	failed := record(p, uuid.Must(uuid.NewV7()), 3)
	failed.Failed = true
	completed := record(p, uuid.Must(uuid.NewV7()), 4)
	require.Equal(t, []string{"SettleRequests"}, settle(
		store.Settlement{Record: failed, LeaseID: &lp}, store.Settlement{Record: record(p, uuid.Must(uuid.NewV7()), 2), LeaseID: &lp},
		store.Settlement{Record: completed}))
	require.Equal(t, []string{"SettleRequests"}, settle(
		store.Settlement{Record: record(p, uuid.Must(uuid.NewV7()), 2), LeaseID: &lp}, store.Settlement{Record: record(q, uuid.Must(uuid.NewV7()), 2)}))
	require.Equal(t, []string{"LockQuotaLeases", "SettleRequests"}, settle(
		store.Settlement{Record: record(p, uuid.Must(uuid.NewV7()), 2), LeaseID: &lp}, store.Settlement{Record: record(q, uuid.Must(uuid.NewV7()), 2), LeaseID: &lq}))
	for id, want := range map[uuid.UUID]string{failed.RequestID: "failed", completed.RequestID: "completed"} {
		var status string
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT status FROM requests WHERE id = $1`, id).Scan(&status))
		require.Equal(t, want, status)
	}
}

// statementNames records the names of the sqlc queries a pool sends, alone
// or in batches.
type statementNames struct {
	startTracer
	mu    sync.Mutex
	names []string
}

func (s *statementNames) add(sql string) {
	if _, rest, ok := strings.Cut(sql, "-- name: "); ok {
		name, _, _ := strings.Cut(rest, " ")
		s.mu.Lock()
		s.names = append(s.names, name)
		s.mu.Unlock()
	}
}

// take returns the names recorded since the last take.
func (s *statementNames) take() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := s.names
	s.names = nil
	return names
}

// takeCount takes the names recorded since the last take and returns how
// many of them are name.
func (s *statementNames) takeCount(name string) int {
	n := 0
	for _, taken := range s.take() {
		if taken == name {
			n++
		}
	}
	return n
}

func (s *statementNames) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.add(d.SQL)
	return ctx
}

func (s *statementNames) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (s *statementNames) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.add(d.SQL)
}

func (s *statementNames) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestRateReturnsLockWindowsInKeyOrder: a replica's return of unused rate
// slices locks the keys' windows in key order: the returns of two replicas
// may name the same keys.
func TestRateReturnsLockWindowsInKeyOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	at := time.Now()
	window := at.Truncate(time.Minute)
	k, l := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	for _, key := range []uuid.UUID{k, l} {
		_, err := b.store.LeaseRate(b.ctx, key, at, 50, 1)
		require.NoError(t, err)
	}
	// Other keys' windows, as a replica sees them: PostgreSQL then hashes
	// the return and probes it with the table's rows.
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO rate_windows SELECT gen_random_uuid(), $1, 1 FROM generate_series(1, 300)`, window)
	require.NoError(t, err)
	_, err = b.store.Pool().Exec(b.ctx, `ANALYZE rate_windows`)
	require.NoError(t, err)
	first, second := inKeyOrder(k, l)
	row := func(key uuid.UUID) keyedRow {
		return keyedRow{"rate_windows", []string{"key_id", "window_start"}, []any{key, window}}
	}
	b.requireLocksInOrder(t, row(first), row(second), func(st *store.Store) error {
		return st.ReturnRate(b.ctx, []store.RateReturn{{KeyID: k, Window: window, Count: 20}, {KeyID: l, Window: window, Count: 30}})
	})
	for key, counted := range map[uuid.UUID]int{k: 30, l: 20} {
		g, err := b.store.LeaseRate(b.ctx, key, at, 50, 1)
		require.NoError(t, err)
		require.Equal(t, 50-counted, g.Granted, "the return counted")
	}
}

// TestRenewAndFoldOnlyOwnLeases: a replica renews and returns its own leases,
// never another's; expired leases of anyone are folded.
func TestRenewAndFoldOnlyOwnLeases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	mine, theirs := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	b.grant(t, p, mine, 10, 16, time.Hour)
	_, err := b.store.GrantQuota(b.ctx, store.QuotaRequest{
		LeaseID: theirs, Owner: uuid.Must(uuid.NewV7()), AccountID: p.AccountID, ProjectID: p.ProjectID, Day: time.Now(),
		DefaultCeiling: 1000, Need: 10, Share: 16, Lease: time.Hour,
	})
	require.NoError(t, err)
	held, err := b.store.RenewQuotaLeases(b.ctx, owner, []uuid.UUID{mine, theirs}, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{mine}, held)
	n, err := b.store.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{mine, theirs})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = b.store.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err)
	require.Zero(t, n, "theirs is alive")
}

// TestQuotaLeasesRunOutByTheDatabaseClock: a lease's end is the database's
// now() plus the lease, at its grant and at each renewal, the clock the folds
// of expired leases read; a replica's clock, which may be off, is not asked.
func TestQuotaLeasesRunOutByTheDatabaseClock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	lease := uuid.Must(uuid.NewV7())
	left := func() time.Duration {
		t.Helper()
		var secs float64
		require.NoError(t, b.store.Pool().QueryRow(b.ctx,
			`SELECT extract(epoch FROM expires_at - now()) FROM quota_leases WHERE id = $1`, lease).Scan(&secs))
		return time.Duration(secs * float64(time.Second))
	}
	b.grant(t, p, lease, 10, 16, time.Hour)
	require.InDelta(t, time.Hour.Seconds(), left().Seconds(), 5, "granted for an hour by the database's clock")
	held, err := b.store.RenewQuotaLeases(b.ctx, owner, []uuid.UUID{lease}, 3*time.Hour)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{lease}, held)
	require.InDelta(t, (3 * time.Hour).Seconds(), left().Seconds(), 5, "renewed for three")
}

// TestAFoldTakesTheAccountDayBeforeTheProject: a fold locks a lease's
// account-day before its project, as a grant and every other statement that
// changes both do. A fold that took the project first, while a grant held the
// account-day and waited for the project, deadlocked with it; PostgreSQL ended
// one of the two after a second, and when that was the fold, the slice stayed
// away until its lease ran out.
func TestAFoldTakesTheAccountDayBeforeTheProject(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(2000)), ptr(int64(1000)))
	lease := uuid.Must(uuid.NewV7())
	b.grant(t, p, lease, 10, 4, time.Hour)

	// A grant's locks: its account-day, then its project.
	b.requireLocksInOrder(t, keyedRow{"daily_charges", []string{"account_id", "day"}, []any{p.AccountID, gateway.UTCDay(time.Now())}},
		keyedRow{"projects", []string{"id"}, []any{p.ProjectID}},
		func(st *store.Store) error {
			_, err := st.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{lease})
			return err
		})
	require.Zero(t, b.view(t, p).Budget.Reserved, "the slice is back")
}

// TestLeaseRateNeverPassesTheLimit: concurrent slices from two replicas sum
// to the limit exactly; returned counts can be leased again.
func TestLeaseRateNeverPassesTheLimit(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	a, c := store.New(testdb.Connect(t, url)), store.New(testdb.Connect(t, url))
	key := uuid.Must(uuid.NewV7())
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	var granted atomic.Int64
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := a
			if i%2 == 1 {
				st = c
			}
			g, err := st.LeaseRate(context.Background(), key, at, 50, 3)
			require.NoError(t, err)
			require.LessOrEqual(t, g.Used, float64(50))
			granted.Add(int64(g.Granted))
		}()
	}
	wg.Wait()
	require.Equal(t, int64(50), granted.Load())
	require.NoError(t, a.ReturnRate(context.Background(), []store.RateReturn{{KeyID: key, Window: at.Truncate(time.Minute), Count: 4}}))
	g, err := c.LeaseRate(context.Background(), key, at, 50, 1)
	require.NoError(t, err)
	require.Equal(t, store.RateGrant{Granted: 4, Used: 50, Current: 50}, g)

	// A return of more than the window counts (one sent again after its
	// reply was lost, say) leaves none counted, not less.
	require.NoError(t, a.ReturnRate(context.Background(), []store.RateReturn{{KeyID: key, Window: at.Truncate(time.Minute), Count: 80}}))
	g, err = c.LeaseRate(context.Background(), key, at, 50, 1)
	require.NoError(t, err)
	require.Equal(t, store.RateGrant{Granted: 50, Used: 50, Current: 50}, g)
}

// TestARateReturnGoesToItsWindow: returns of one key to two windows each
// give back to their own.
func TestARateReturnGoesToItsWindow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	key := uuid.Must(uuid.NewV7())
	minute := time.Now().Truncate(time.Minute)
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO rate_windows (key_id, window_start, count) VALUES ($1, $2, 10), ($1, $3, 20)`,
		key, minute, minute.Add(time.Minute))
	require.NoError(t, err)
	require.NoError(t, b.store.ReturnRate(b.ctx, []store.RateReturn{{KeyID: key, Window: minute, Count: 3}, {KeyID: key, Window: minute.Add(time.Minute), Count: 5}}))
	rows, err := b.store.Pool().Query(b.ctx, `SELECT count FROM rate_windows WHERE key_id = $1 ORDER BY window_start`, key)
	require.NoError(t, err)
	counts, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	require.Equal(t, []int32{7, 15}, counts)
}

// TestLeaseRateSlidingWindow: the previous minute counts by how much of it
// still overlaps the last 60 s.
func TestLeaseRateSlidingWindow(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.New(t))
	key := uuid.Must(uuid.NewV7())
	minute := time.Now().Truncate(time.Minute)
	lease := func(at time.Time) int {
		g, err := st.LeaseRate(context.Background(), key, at, 10, 1)
		require.NoError(t, err)
		return g.Granted
	}
	require.Equal(t, 10, lease(minute.Add(50*time.Second)))
	require.Zero(t, lease(minute.Add(55*time.Second)))
	// 15 s into the next minute, 3/4 of the previous minute still counts: 7.5 used.
	g, err := st.LeaseRate(context.Background(), key, minute.Add(75*time.Second), 10, 1)
	require.NoError(t, err)
	require.Equal(t, store.RateGrant{Granted: 2, Used: 9.5, Previous: 10, Current: 2}, g, "with the counts it weighs")
	require.Equal(t, 10, lease(minute.Add(180*time.Second)))
}

// TestLeaseRateAhead: a slice of the next minute is sized as at its start,
// where the minute before weighs whole; while it is held, grants of the minute
// before leave room for it.
func TestLeaseRateAhead(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.New(t))
	ctx := context.Background()
	key := uuid.Must(uuid.NewV7())
	minute := time.Now().Truncate(time.Minute)
	next := minute.Add(time.Minute)
	lease := func(at time.Time, share int) store.RateGrant {
		g, err := st.LeaseRate(ctx, key, at, 20, share)
		require.NoError(t, err)
		return g
	}
	ahead := func() store.RateGrant {
		g, err := st.LeaseRateAhead(ctx, key, next, 20, 2)
		require.NoError(t, err)
		return g
	}
	require.Equal(t, 5, lease(minute.Add(30*time.Second), 4).Granted)
	require.Equal(t, store.RateGrant{Granted: 7, Used: 12, Previous: 5, Current: 7}, ahead(), "half of 20 - 5")
	require.Equal(t, store.RateGrant{Granted: 8, Used: 13, Current: 13}, lease(minute.Add(50*time.Second), 1),
		"the window leaves 15, of which 7 are the next minute's")
	require.Zero(t, ahead().Granted)
	require.Zero(t, lease(next, 1).Granted, "13 + 7 as the minute starts")
	require.Equal(t, 6, lease(next.Add(30*time.Second), 1).Granted, "half of 13, and 7")

	g, err := st.LeaseRateAhead(ctx, uuid.Must(uuid.NewV7()), next, 3, 20)
	require.NoError(t, err)
	require.Equal(t, 1, g.Granted, "one at least while there is room, however small the share")
}

func TestUsageView(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "other", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	record := func(who *gateway.Principal, model gateway.Model, in, out int64, at time.Time) {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: gateway.UsageRecord{
			RequestID: uuid.Must(uuid.NewV7()), Principal: who, Model: model, Entry: gateway.EntryResponses,
			Usage:     gateway.Usage{InputRungs: in, OutputRungs: out, TotalRungs: in + out},
			CreatedAt: at, CompletedAt: at, EvidenceExpiresAt: at.Add(time.Hour),
		}}}))
	}
	record(p, gateway.ModelInstant, 1, 2, now)
	record(p, gateway.ModelInstant, 3, 4, now)
	record(p, gateway.ModelReasoning, 10, 20, now)
	record(p, gateway.ModelElements, 100, 100, now.Add(-48*time.Hour)) // outside the period
	record(other, gateway.ModelInstant, 1000, 1000, now)               // another account

	v, err := b.store.Usage(b.ctx, p, now.Add(-time.Hour), now.Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, gateway.ModelUsage{Requests: 3, InputRungs: 14, OutputRungs: 26, TotalRungs: 40}, v.Totals)
	require.Equal(t, []gateway.ModelUsage{
		{Model: gateway.ModelInstant, Requests: 2, InputRungs: 4, OutputRungs: 6, TotalRungs: 10},
		{Model: gateway.ModelReasoning, Requests: 1, InputRungs: 10, OutputRungs: 20, TotalRungs: 30},
	}, v.ByModel)
	require.Equal(t, "default", v.Budget.Project)
	require.Nil(t, v.Budget.Cap)
	require.Equal(t, gateway.UTCDay(now).Add(24*time.Hour), v.Daily.ResetsAt)

	empty, err := b.store.Usage(b.ctx, p, now.Add(time.Hour), now.Add(2*time.Hour))
	require.NoError(t, err)
	require.Empty(t, empty.ByModel)
	require.NotNil(t, empty.ByModel, "an empty list, not null")
}

// TestUsageViewListsModelsInOrder: the view's models come in the order of
// their names, whatever order they were used in and however PostgreSQL
// groups them (here by hashing, sorting being the last resort).
func TestUsageViewListsModelsInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	for i, model := range []gateway.Model{gateway.ModelReasoning, gateway.ModelElements, gateway.ModelInstant} {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, now.Add(-time.Duration(i)*time.Minute), model, 10)}}))
	}
	hashing := store.New(b.poolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["enable_sort"] = "off" }))
	v, err := hashing.Usage(b.ctx, p, now.Add(-time.Hour), now.Add(time.Hour))
	require.NoError(t, err)
	var models []gateway.Model
	for _, m := range v.ByModel {
		models = append(models, m.Model)
	}
	require.Equal(t, []gateway.Model{gateway.ModelElements, gateway.ModelInstant, gateway.ModelReasoning}, models)
}

// TestUsageReport: the report sums committed usage per account, project, UTC
// day of completion, model and entry point, over whole days, and for one
// account when asked.
func TestUsageReport(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, globex := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	tier := gateway.TierDeveloper
	token, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: "acme", Project: "research", Tier: &tier, Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	research, err := b.store.LookupKey(b.ctx, token)
	require.NoError(t, err)

	day1 := time.Date(2026, 10, 1, 0, 0, 0, 0, time.UTC)
	day2 := day1.AddDate(0, 0, 1)
	store1 := func(p *gateway.Principal, model gateway.Model, entry gateway.EntryPoint, at time.Time, total int64) {
		r := record(p, uuid.Must(uuid.NewV7()), total)
		r.Model, r.Entry, r.CreatedAt, r.CompletedAt = model, entry, at.Add(-time.Second), at
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: r}}))
	}
	store1(acme, gateway.ModelInstant, gateway.EntryResponses, day1, 100)
	store1(acme, gateway.ModelInstant, gateway.EntryResponses, day1.Add(23*time.Hour), 50)
	store1(acme, gateway.ModelInstant, gateway.EntryBatch, day1.Add(time.Hour), 30)
	store1(acme, gateway.ModelReasoning, gateway.EntryResponses, day2.Add(12*time.Hour), 70)
	store1(research, gateway.ModelInstant, gateway.EntryChat, day2, 10)
	store1(globex, gateway.ModelInstant, gateway.EntryResponses, day1, 5)
	store1(acme, gateway.ModelInstant, gateway.EntryResponses, day1.Add(-time.Nanosecond), 1000) // the day before
	store1(acme, gateway.ModelInstant, gateway.EntryResponses, day2.AddDate(0, 0, 1), 1000)      // the day after

	line := func(account, project string, day time.Time, model gateway.Model, entry gateway.EntryPoint, requests, total int64) store.UsageLine {
		return store.UsageLine{Account: account, Project: project, Day: day, Model: string(model), EntryPoint: string(entry),
			Requests: requests, InputRungs: requests, OutputRungs: total - requests, TotalRungs: total}
	}
	lines, err := b.store.UsageReport(b.ctx, day1, day2.AddDate(0, 0, 1), "")
	require.NoError(t, err)
	require.Equal(t, []store.UsageLine{
		line("acme", "default", day1, gateway.ModelInstant, gateway.EntryBatch, 1, 30),
		line("acme", "default", day1, gateway.ModelInstant, gateway.EntryResponses, 2, 150),
		line("acme", "default", day2, gateway.ModelReasoning, gateway.EntryResponses, 1, 70),
		line("acme", "research", day2, gateway.ModelInstant, gateway.EntryChat, 1, 10),
		line("globex", "default", day1, gateway.ModelInstant, gateway.EntryResponses, 1, 5),
	}, lines)

	lines, err = b.store.UsageReport(b.ctx, day1, day2.AddDate(0, 0, 1), "globex")
	require.NoError(t, err)
	require.Equal(t, []store.UsageLine{line("globex", "default", day1, gateway.ModelInstant, gateway.EntryResponses, 1, 5)}, lines)
	lines, err = b.store.UsageReport(b.ctx, day2, day2.AddDate(0, 0, 1), "globex")
	require.NoError(t, err)
	require.Empty(t, lines, "an account that used nothing those days")
	_, err = b.store.UsageReport(b.ctx, day1, day2.AddDate(0, 0, 1), "nobody")
	require.ErrorIs(t, err, store.ErrAccountNotFound, "a report for an account that does not exist is not one of zero usage")
}

// TestUsageReportOfADayPartlyPastTheRetention: a day whose first requests
// were folded into its sums and whose last are kept is reported whole, the
// sums and the requests added, even where they are alike; the sums of the
// days before the report's first are no part of it.
func TestUsageReportOfADayPartlyPastTheRetention(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	day := gateway.UTCDay(time.Now()).AddDate(0, 0, -90)
	for _, completed := range []time.Time{day.Add(-19 * time.Hour), day.Add(time.Hour), day.Add(20 * time.Hour)} {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, completed, gateway.ModelInstant, 10)}}))
	}
	n, err := b.store.FoldOldUsage(b.ctx, day.Add(12*time.Hour), 100)
	require.NoError(t, err)
	require.Positive(t, n)
	var days int64
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM usage_days`).Scan(&days))
	require.Equal(t, int64(2), days, "the day before and the first request of the day are folded")

	lines, err := b.store.UsageReport(b.ctx, day, day.AddDate(0, 0, 1), "")
	require.NoError(t, err)
	require.Equal(t, []store.UsageLine{{Account: "acme", Project: "default", Day: day, Model: string(gateway.ModelInstant),
		EntryPoint: string(gateway.EntryResponses), Requests: 2, InputRungs: 2, OutputRungs: 18, TotalRungs: 20}}, lines)
}
