package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

// creationOutcome is what a CreateBatch returned.
type creationOutcome struct {
	res store.CreateResult
	err error
}

// createBehindABlockedOne starts the creation first, which waits on a lock of
// the items' table, then the creations queued one after another, each
// waiting for its turn before the next starts, and returns the outcomes of
// all (first's first) once the lock is released.
func (b *testBundle) createBehindABlockedOne(t *testing.T, first store.NewBatch, queued ...store.NewBatch) []creationOutcome {
	t.Helper()
	small, pool, unlock := b.lockedItems(t, 4)
	outs := make([]chan creationOutcome, 1+len(queued))
	start := func(i int, nb store.NewBatch) {
		outs[i] = make(chan creationOutcome, 1)
		go func() {
			res, err := small.CreateBatch(b.ctx, nb)
			outs[i] <- creationOutcome{res, err}
		}()
	}
	start(0, first)
	require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 1 }, 10*time.Second, time.Millisecond,
		"the first creation is being stored")
	for i, nb := range queued {
		start(i+1, nb)
		require.Eventually(t, func() bool { return small.CreationsWaiting() == i+1 }, 10*time.Second, time.Millisecond,
			"creation %d waits for its turn", i+1)
	}
	unlock()
	got := make([]creationOutcome, len(outs))
	for i, ch := range outs {
		got[i] = <-ch
	}
	return got
}

// transactions counts the transactions that stored the account's batches.
func (b *testBundle) transactions(t *testing.T, account uuid.UUID) int {
	t.Helper()
	var n int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx,
		"SELECT count(DISTINCT xmin::text) FROM batches WHERE account_id = $1", account).Scan(&n))
	return n
}

// storedItems counts the items stored of each of the account's batches.
func (b *testBundle) storedItems(t *testing.T, account uuid.UUID) map[uuid.UUID]int {
	t.Helper()
	rows, err := b.store.Pool().Query(b.ctx,
		"SELECT b.id, count(i.idx) FROM batches b LEFT JOIN batch_items i ON i.batch_id = b.id WHERE b.account_id = $1 GROUP BY b.id", account)
	require.NoError(t, err)
	got := map[uuid.UUID]int{}
	for rows.Next() {
		var id uuid.UUID
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		got[id] = n
	}
	require.NoError(t, rows.Err())
	var orphans int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx,
		"SELECT count(*) FROM batch_items i WHERE NOT EXISTS (SELECT 1 FROM batches b WHERE b.id = i.batch_id)").Scan(&orphans))
	require.Zero(t, orphans, "no item outlives its batch")
	return got
}

// TestCreationsOfAnAccountCommitTogether: the creations of an account that
// arrive while one of its creations is being stored are stored together, in
// one transaction, each with its items and its charge.
func TestCreationsOfAnAccountCommitTogether(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, other := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	sizes := []int{6, 1, 2, 3, 4, 5}
	queued := make([]store.NewBatch, len(sizes)-1)
	for i := range queued {
		queued[i] = b.batchOf(p, sizes[i+1], 10, "", day())
	}
	got := b.createBehindABlockedOne(t, b.batchOf(p, sizes[0], 10, "", day()), queued...)

	want := map[uuid.UUID]int{}
	for i, o := range got {
		require.NoError(t, o.err, "creation %d", i)
		require.False(t, o.res.Replayed)
		want[o.res.BatchID] = sizes[i]
	}
	require.Len(t, want, 6, "each its own batch")
	require.Equal(t, want, b.storedItems(t, p.AccountID))
	require.Equal(t, 2, b.transactions(t, p.AccountID), "the first alone, the five queued behind it together")
	require.Equal(t, int64(10*(6+1+2+3+4+5)), b.view(t, p).Daily.Charged, "each charged its estimate")

	// Another account's creation waits for none of them.
	b.newBatch(t, other, 1, 10, "", day())
	require.Equal(t, 1, b.transactions(t, other.AccountID))
}

// TestCreationRefusedByRequestsRunning: a batch refused because slices of
// the day, leased for interactive requests still running, fill the ceiling
// is told to retry shortly; one that the charges for good leave no room for
// is told the day's end.
func TestCreationRefusedByRequestsRunning(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	lease := uuid.Must(uuid.NewV7())
	require.Equal(t, int64(70), b.grant(t, p, lease, 70, 1000, time.Hour).Granted)
	_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 30, "", day()))
	var e *gateway.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Equal(t, gateway.HeldRetryAfter, e.RetryAfter, "%s", e.Message)

	b.newBatch(t, p, 1, 30, "", day()) // charged while it runs, as a batch is
	_, err = b.store.FoldQuotaLeases(b.ctx, owner, []uuid.UUID{lease})
	require.NoError(t, err)
	b.newBatch(t, p, 1, 50, "", day())
	b.complete(t, owner, b.claim(t, owner, 2, time.Minute), 40) // 80 charged for good
	_, err = b.store.CreateBatch(b.ctx, b.batchOf(p, 2, 15, "", day()))
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Greater(t, e.RetryAfter, gateway.HeldRetryAfter, "80 charged, 30 more do not fit today: %s", e.Message)
	require.Contains(t, e.Message, "00:00 UTC")
}

// TestRefusalsByUnfinishedBatches: a batch, or a slice for interactive
// requests, refused because the estimates of the account's batch items not
// yet finished fill the day's ceiling, while what is charged for good leaves
// room once they end, is told to retry in a minute, not at midnight; the
// refused batch's own items, stored and removed again in its transaction,
// are not counted among them. Once the items finish, the refusal is the
// day's.
func TestRefusalsByUnfinishedBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	b.newBatch(t, p, 1, 20, "", day())
	b.complete(t, owner, b.claim(t, owner, 1, time.Minute), 20) // 20 charged for good
	b.newBatch(t, p, 2, 25, "", day())                          // 50 held by items queued
	refused := func(nb store.NewBatch) *gateway.Error {
		t.Helper()
		_, err := b.store.CreateBatch(b.ctx, nb)
		var e *gateway.Error
		require.ErrorAs(t, err, &e)
		require.Equal(t, gateway.ERateLimited, e.Code)
		return e
	}

	e := refused(b.batchOf(p, 1, 70, "", day()))
	require.Equal(t, gateway.BatchesRetryAfter, e.RetryAfter, "30 free and 50 held by batches cover 70: %s", e.Message)
	require.Contains(t, e.Message, "batch items not yet finished")
	e = refused(b.batchOf(p, 2, 45, "", day()))
	require.Contains(t, e.Message, "00:00 UTC", "30 free and 50 held do not cover 90, its own items not counted: %s", e.Message)
	g := b.grant(t, p, uuid.Must(uuid.NewV7()), 70, 1, time.Hour)
	require.Equal(t, gateway.AdmitDaily, g.Outcome)
	require.Equal(t, int64(30), g.Free)
	require.Equal(t, int64(50), g.Batches, "a slice refused reads what the batches hold")

	b.complete(t, owner, b.claim(t, owner, 2, time.Minute), 5) // 40 of the 50 go back,
	_, err := b.store.ReconcileSettlements(b.ctx, 100)         // once folded into the day
	require.NoError(t, err)
	b.newBatch(t, p, 1, 70, "", day()) // 30 for good, 70 held
	e = refused(b.batchOf(p, 1, 10, "", day()))
	require.Equal(t, gateway.BatchesRetryAfter, e.RetryAfter, "%s", e.Message)
	b.complete(t, owner, b.claim(t, owner, 1, time.Minute), 70)
	e = refused(b.batchOf(p, 1, 10, "", day()))
	require.Contains(t, e.Message, "00:00 UTC", "the batch ended at its estimate: %s", e.Message)
}

// TestRefusalsReadTheBatchesOfTheirDay: a refusal by the ceiling counts
// as held the items of the batches created that day alone: those of a
// batch created the day before, or after, hold those days' charges, and
// their end frees nothing of this one's.
func TestRefusalsReadTheBatchesOfTheirDay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	b.newBatch(t, p, 1, 70, "", day())
	b.complete(t, owner, b.claim(t, owner, 1, time.Minute), 70) // 70 charged for good
	now := time.Now().UTC()
	for _, created := range []time.Time{now.AddDate(0, 0, -1), now.AddDate(0, 0, 1)} {
		nb := b.batchOf(p, 2, 40, "", created.AddDate(0, 0, 1))
		nb.CreatedAt = created
		_, err := b.store.CreateBatch(b.ctx, nb)
		require.NoError(t, err)
	}
	_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 1, 40, "", day()))
	var e *gateway.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Contains(t, e.Message, "00:00 UTC", "30 free, and no batch of the day's holds any: %s", e.Message)
	require.NotEqual(t, gateway.BatchesRetryAfter, e.RetryAfter)
}

// TestRefusalsCountTheItemsStillRunning: a refusal by the ceiling counts as
// held the estimates of the items still queued or running, a cancelled
// batch's running items among them, and not those of the items that ended.
func TestRefusalsCountTheItemsStillRunning(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	id := b.newBatch(t, p, 3, 30, "", day())
	claimed := b.claim(t, owner, 2, time.Minute)
	b.complete(t, owner, claimed[:1], 30)                           // 30 charged for good
	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id)) // the queued item's 30 back
	_, err := b.store.ReconcileSettlements(b.ctx, 100)
	require.NoError(t, err)
	refused := func(est int64) *gateway.Error {
		t.Helper()
		_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 1, est, "", day()))
		var e *gateway.Error
		require.ErrorAs(t, err, &e)
		require.Equal(t, gateway.ERateLimited, e.Code)
		return e
	}
	e := refused(50)
	require.Equal(t, gateway.BatchesRetryAfter, e.RetryAfter, "40 free and 30 held by the running item cover 50: %s", e.Message)
	e = refused(75)
	require.Contains(t, e.Message, "00:00 UTC", "40 free and 30 held do not cover 75: %s", e.Message)
}

// TestCreationsStoredTogetherKeepTheirOutcomes: creations stored together
// end as they would one after another: the daily ceiling charges them in
// turn (one it refuses does not stop a later one that fits), a refused one
// sends and stores nothing, and two naming one idempotency key are never in
// one group.
func TestCreationsStoredTogetherKeepTheirOutcomes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	copied := &itemsCopied{}
	b.tracer = copied
	got := b.createBehindABlockedOne(t, b.batchOf(p, 1, 20, "", day()),
		b.batchOf(p, 1, 30, "", day()),  // 1: fits (50)
		b.batchOf(p, 1, 60, "", day()),  // 2: refused (110)
		b.batchOf(p, 1, 30, "k", day()), // 3: fits (80)
		b.batchOf(p, 1, 30, "k", day()), // 4: the same body, key k: a replay of 3
		b.batchOf(p, 1, 10, "k", day()), // 5: another body, key k: refused
		b.batchOf(p, 1, 150, "", day()), // 6: past the whole ceiling
		b.batchOf(p, 1, 20, "", day()),  // 7: fits (100)
		b.batchOf(p, 1, 10, "", day()),  // 8: refused (110)
	)
	created := map[uuid.UUID]int{}
	for _, i := range []int{0, 1, 3, 7} {
		require.NoError(t, got[i].err, "creation %d", i)
		require.False(t, got[i].res.Replayed, "creation %d", i)
		created[got[i].res.BatchID] = 1
	}
	for _, i := range []int{2, 6, 8} {
		require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(got[i].err), "creation %d: %v", i, got[i].err)
	}
	require.Contains(t, got[6].err.Error(), "larger than the account's whole daily rung ceiling")
	require.Contains(t, got[8].err.Error(), "cannot cover this batch's estimate of 10 rungs")
	require.NoError(t, got[4].err)
	require.Equal(t, store.CreateResult{BatchID: got[3].res.BatchID, Replayed: true}, got[4].res)
	require.Equal(t, gateway.EIdempotencyKeyReused, gateway.ErrorCodeOf(got[5].err), "%v", got[5].err)

	require.Equal(t, created, b.storedItems(t, p.AccountID), "the refused stored nothing")
	require.Equal(t, int64(len(created)), copied.n.Load(), "nor sent their items: a creation that fits alone but not after those before it neither")
	require.Equal(t, int64(100), b.view(t, p).Daily.Charged)
	require.Equal(t, 2, b.transactions(t, p.AccountID), "the first alone, the others that fit together")
}

// TestReplaysStoredTogetherWithNewCreations: a creation that repeats a
// batch stored before resolves in its group without stopping the creations
// after it: a replay, a new creation and a key reused for another body,
// stored together, end as they would one after another.
func TestReplaysStoredTogetherWithNewCreations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	stored := b.newBatch(t, p, 2, 10, "a", day())
	b.newBatch(t, p, 1, 10, "b", day())
	got := b.createBehindABlockedOne(t, b.batchOf(p, 1, 10, "", day()),
		b.batchOf(p, 2, 10, "a", day()), // 1: a replay of the batch of key a
		b.batchOf(p, 3, 10, "", day()),  // 2: new
		b.batchOf(p, 4, 10, "b", day()), // 3: key b, another body
	)
	require.NoError(t, got[1].err)
	require.Equal(t, store.CreateResult{BatchID: stored, Replayed: true}, got[1].res)
	require.NoError(t, got[2].err)
	require.False(t, got[2].res.Replayed)
	require.Equal(t, gateway.EIdempotencyKeyReused, gateway.ErrorCodeOf(got[3].err), "%v", got[3].err)

	items := b.storedItems(t, p.AccountID)
	require.Len(t, items, 4, "the two before, the first and the new one")
	require.Equal(t, 3, items[got[2].res.BatchID], "the new one stored its items")
	require.Equal(t, int64(10*(2+1+1+3)), b.view(t, p).Daily.Charged, "the new one charged its estimate, the others nothing more")
	require.Equal(t, 4, b.transactions(t, p.AccountID), "the two before, the first alone, the queued together")
}

// itemsCopied counts the batch items sent with COPY.
type itemsCopied struct {
	n atomic.Int64
}

// copyingItems marks the context of a COPY of batch items, from its start
// to its end.
type copyingItems struct{}

func (*itemsCopied) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (*itemsCopied) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (*itemsCopied) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceCopyFromStartData) context.Context {
	if d.TableName.Sanitize() == `"batch_items"` {
		return context.WithValue(ctx, copyingItems{}, true)
	}
	return ctx
}

func (c *itemsCopied) TraceCopyFromEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceCopyFromEndData) {
	if ctx.Value(copyingItems{}) != nil {
		c.n.Add(d.CommandTag.RowsAffected())
	}
}

// TestARefusedCreationSendsNoItems: a creation whose estimate passes what the
// day has left is refused before its items are sent (a client repeating a
// refused batch of megabytes writes none of them), with the refusal it would
// get after them, and keeps no idempotency key; one that fits sends its items.
func TestARefusedCreationSendsNoItems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	copied := &itemsCopied{}
	traced := b.traced(t, copied)

	first, err := traced.CreateBatch(b.ctx, b.batchOf(p, 2, 35, "", day()))
	require.NoError(t, err)
	require.Equal(t, int64(2), copied.n.Load(), "a creation that fits sends its items")

	_, err = traced.CreateBatch(b.ctx, b.batchOf(p, 1, 40, "k", day()))
	var e *gateway.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Contains(t, e.Message, "cannot cover this batch's estimate of 40 rungs")
	require.Equal(t, gateway.BatchesRetryAfter, e.RetryAfter, "the first batch's end may cure it: %s", e.Message)
	_, err = traced.CreateBatch(b.ctx, b.batchOf(p, 1, 150, "", day()))
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Contains(t, e.Message, "larger than the account's whole daily rung ceiling")
	require.Equal(t, int64(2), copied.n.Load(), "no refused creation sent its items")

	second, err := traced.CreateBatch(b.ctx, b.batchOf(p, 1, 30, "k", day()))
	require.NoError(t, err, "the refused creation kept no key")
	require.Equal(t, int64(3), copied.n.Load())
	require.Equal(t, map[uuid.UUID]int{first.BatchID: 2, second.BatchID: 1}, b.storedItems(t, p.AccountID))
	require.Equal(t, int64(100), b.view(t, p).Daily.Charged)
}

// TestACreationFailingForItsDataFailsAlone: a group whose transaction fails
// for one creation's data (here an item past the hundredth, which the
// service never sends) is stored creation by creation, and only that one
// fails.
func TestACreationFailingForItsDataFailsAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.metrics = metrics.New()
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	got := b.createBehindABlockedOne(t, b.batchOf(p, 1, 10, "", day()),
		b.batchOf(p, 2, 10, "", day()),
		b.batchOf(p, 101, 10, "", day()),
		b.batchOf(p, 3, 10, "", day()),
	)
	want := map[uuid.UUID]int{}
	for _, i := range []int{0, 1, 3} {
		require.NoError(t, got[i].err, "creation %d", i)
		want[got[i].res.BatchID] = []int{1, 2, 0, 3}[i]
	}
	require.Error(t, got[2].err)
	require.False(t, store.Transient(got[2].err), "its data fails, however often it is sent: %v", got[2].err)
	require.Equal(t, want, b.storedItems(t, p.AccountID))
	require.Equal(t, int64(10*(1+2+3)), b.view(t, p).Daily.Charged)
	require.Equal(t, []string{`gateway_group_commit_size_count{work="batch_creations"} 3`}, groupCommits(t, b.metrics),
		"the first alone, then the two stored alone: the failed group and the failed creation did not commit")
}

// TestAGroupOfCreationsIsBounded: creations queued behind one being stored
// are stored sixteen at most a transaction.
func TestAGroupOfCreationsIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	queued := make([]store.NewBatch, 17)
	for i := range queued {
		queued[i] = b.batchOf(p, 1, 10, "", day())
	}
	for i, o := range b.createBehindABlockedOne(t, b.batchOf(p, 1, 10, "", day()), queued...) {
		require.NoError(t, o.err, "creation %d", i)
	}
	require.Equal(t, 3, b.transactions(t, p.AccountID), "the first alone, then sixteen, then one")
}

// TestRefusalsInAGroupReadTheRoomOnce: the creations of a group that the
// ceiling refuses are told apart by one read of the day's room, which counts
// the batches of the group that were charged among those unfinished.
func TestRefusalsInAGroupReadTheRoomOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(30)), nil)
	names := &statementNames{}
	b.tracer = names
	got := b.createBehindABlockedOne(t, b.batchOf(p, 1, 10, "", day()),
		b.batchOf(p, 1, 10, "", day()), // charged: 20 of 30
		b.batchOf(p, 1, 25, "", day()), // 10 free, and 20 held by unfinished batches
		b.batchOf(p, 1, 25, "", day()),
	)
	require.NoError(t, got[0].err)
	require.NoError(t, got[1].err)
	for _, o := range got[2:] {
		require.ErrorContains(t, o.err, "held by the estimates of its batch items not yet finished")
	}
	require.Equal(t, 1, names.takeCount("UnfinishedBatchEstimates"))
}

// TestAdmissionChargesInTurnUpToTheCeiling: the admission of a group of
// batches (admit_batches) charges each batch's estimate in turn, counting
// those before it in the group and what the day holds at its lock, as far as
// the ceiling allows; a batch filling the day exactly fits, one past the
// ceiling alone never does.
func TestAdmissionChargesInTurnUpToTheCeiling(t *testing.T) {
	t.Parallel()
	b := setup(t)
	admit := func(p *gateway.Principal, estimates ...int64) []string {
		t.Helper()
		defaults := make([]int64, len(estimates))
		for i := range defaults {
			defaults[i] = p.Tier.DefaultDailyCeiling()
		}
		var outcomes []string
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT admit_batches($1, $2, $3, $4)::text[]`,
			p.AccountID, gateway.UTCDay(time.Now()), defaults, estimates).Scan(&outcomes))
		return outcomes
	}
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(40)), nil)
	require.Equal(t, []string{gateway.AdmitDailyNever}, admit(p, 41))
	require.Equal(t, []string{gateway.AdmitOK}, admit(p, 10))
	require.Equal(t, []string{gateway.AdmitOK, gateway.AdmitDaily, gateway.AdmitOK, gateway.AdmitDailyNever, gateway.AdmitDaily},
		admit(p, 20, 15, 10, 41, 1))
	require.Equal(t, int64(40), b.view(t, p).Daily.Charged)

	_, q := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "globex", ptr(int64(40)), nil)
	require.Equal(t, []string{gateway.AdmitOK}, admit(q, 40), "a batch filling the day exactly")

	// So does a creation's own reading of the day, before its items are sent.
	_, r := b.key(t, "initech", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "initech", ptr(int64(40)), nil)
	b.newBatch(t, r, 4, 10, "", day())
	require.Equal(t, int64(40), b.view(t, r).Daily.Charged)
}

// TestACreationSentAgainReadsNoCharge: a creation of a batch stored already
// (its reply was lost) resolves to it without reading the day's charge.
func TestACreationSentAgainReadsNoCharge(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	nb := b.batchOf(p, 1, 10, "", day())
	nb.ID = uuid.Must(uuid.NewV7())
	_, err := b.store.CreateBatch(b.ctx, nb)
	require.NoError(t, err)
	names := &statementNames{}
	res, err := b.traced(t, names).CreateBatch(b.ctx, nb)
	require.NoError(t, err)
	require.Equal(t, store.CreateResult{BatchID: nb.ID}, res)
	sent := names.take()
	require.Contains(t, sent, "InsertBatches")
	require.NotContains(t, sent, "DayCharge")
}

// groupCommits is the count lines of m's group commits.
func groupCommits(t *testing.T, m *metrics.Metrics) []string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler(false).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	var lines []string
	for line := range strings.Lines(rec.Body.String()) {
		if strings.HasPrefix(line, "gateway_group_commit_size_count") {
			lines = append(lines, strings.TrimSpace(line))
		}
	}
	return lines
}

// TestCreationsOfManyAccountsInOneReplica: creations of many accounts at once,
// several each, all stored with their charges.
func TestCreationsOfManyAccountsInOneReplica(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const accounts, each = 8, 6
	principals := make([]*gateway.Principal, accounts)
	for i := range principals {
		_, principals[i] = b.key(t, fmt.Sprintf("tenant-%d", i), gateway.TierDeveloper, gateway.ScopeInference)
	}
	errs := make(chan error, accounts*each)
	for _, p := range principals {
		for j := range each {
			go func() {
				_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, j+1, 10, fmt.Sprintf("key-%d", j), day()))
				errs <- err
			}()
		}
	}
	for range accounts * each {
		require.NoError(t, <-errs)
	}
	for _, p := range principals {
		items := b.storedItems(t, p.AccountID)
		require.Len(t, items, each)
		require.Equal(t, int64(10*each*(each+1)/2), b.view(t, p).Daily.Charged)
	}
}

// BenchmarkABurstOfCreations: 32 batches of 100 items created at once, as a
// client sending its work in one go does, by one account or spread over 16.
// One account's creations are stored in groups (transactions/burst).
func BenchmarkABurstOfCreations(b *testing.B) {
	for _, accounts := range []int{1, 16} {
		b.Run(fmt.Sprintf("accounts=%d", accounts), func(b *testing.B) {
			bundle := &testBundle{ctx: context.Background(), store: store.New(testdb.New(b))}
			principals := make([]*gateway.Principal, accounts)
			for i := range principals {
				_, principals[i] = bundle.key(b, fmt.Sprintf("tenant-%d", i), gateway.TierDeveloper, gateway.ScopeInference)
			}
			const burst = 32
			errs := make(chan error, burst)
			for b.Loop() {
				for i := range burst {
					nb := bundle.batchOf(principals[i%accounts], 100, 10, "", day())
					go func() {
						_, err := bundle.store.CreateBatch(bundle.ctx, nb)
						errs <- err
					}()
				}
				for range burst {
					if err := <-errs; err != nil {
						b.Fatal(err)
					}
				}
			}
			var transactions int
			require.NoError(b, bundle.store.Pool().QueryRow(bundle.ctx, "SELECT count(DISTINCT xmin::text) FROM batches").Scan(&transactions))
			b.ReportMetric(float64(transactions)/float64(b.N), "transactions/burst")
		})
	}
}

// BenchmarkARefusedCreation: a batch of 100 prompts of 100 KB that the daily
// ceiling refuses, sent again and again as a client that ignores Retry-After
// does: sent-bytes/op is what the store sends PostgreSQL for each,
// WAL-bytes/op what each writes to the database's log (the cluster's: run
// it alone, -run '^$' -bench ARefusedCreation).
func BenchmarkARefusedCreation(b *testing.B) {
	bundle := setup(b)
	_, p := bundle.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	bundle.limits(b, "acme", ptr(int64(1000)), nil)
	nb := bundle.batchOf(p, 100, 100, "", day())
	rnd := rand.New(rand.NewPCG(1, 2))
	prompt := make([]byte, 100_000)
	for i := range prompt {
		prompt[i] = "abcdefghijklmnopqrstuvwxyz "[rnd.IntN(27)]
	}
	for i := range nb.Items {
		nb.Items[i].Request.Prompt = string(prompt)
	}
	var sent atomic.Int64
	counted := bundle.counted(b, &sent)
	wal := func() (lsn string) {
		require.NoError(b, bundle.store.Pool().QueryRow(bundle.ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn))
		return lsn
	}
	start := wal()
	for b.Loop() {
		if _, err := counted.CreateBatch(bundle.ctx, nb); gateway.ErrorCodeOf(err) != gateway.ERateLimited {
			b.Fatalf("want a refusal by the daily ceiling, got %v", err)
		}
	}
	b.ReportMetric(float64(sent.Load())/float64(b.N), "sent-bytes/op")
	var written float64
	require.NoError(b, bundle.store.Pool().QueryRow(bundle.ctx, "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)", wal(), start).Scan(&written))
	b.ReportMetric(written/float64(b.N), "WAL-bytes/op")
}

// counted is a store on a pool of its own whose connections add what they
// send to sent.
func (b *testBundle) counted(t testing.TB, sent *atomic.Int64) *store.Store {
	t.Helper()
	return store.New(b.poolWith(t, func(cfg *pgxpool.Config) {
		dial := cfg.ConnConfig.DialFunc
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &countingConn{Conn: c, sent: sent}, nil
		}
	}))
}

// countingConn adds what it writes to sent.
type countingConn struct {
	net.Conn
	sent *atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.sent.Add(int64(n))
	return n, err
}

// TestCreationsOfTwoReplicasNeverPassTheCeiling: 40 creations of one account
// at once, through two stores (two replicas' queues) over one database,
// against a daily ceiling that fits 10 of them: exactly 10 are stored, the
// day is charged exactly the ceiling, and the others are refused.
func TestCreationsOfTwoReplicasNeverPassTheCeiling(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	replicas := []*store.Store{b.store, store.New(b.store.Pool())}
	const creations = 40
	outs := make(chan creationOutcome, creations)
	for i := range creations {
		go func() {
			res, err := replicas[i%2].CreateBatch(b.ctx, b.batchOf(p, 2, 5, "", day()))
			outs <- creationOutcome{res, err}
		}()
	}
	created := map[uuid.UUID]int{}
	for range creations {
		o := <-outs
		if o.err != nil {
			require.Equal(t, gateway.ERateLimited, gateway.ErrorCodeOf(o.err), "%v", o.err)
			continue
		}
		created[o.res.BatchID] = 2
	}
	require.Len(t, created, 10)
	require.Equal(t, created, b.storedItems(t, p.AccountID))
	require.Equal(t, int64(100), b.view(t, p).Daily.Charged)
}

// TestACreationWhoseCallerLeftIsNotSent: a creation whose context has ended
// before it is sent, its caller gone, is not stored, and its error says that
// nothing was sent, however often it is tried.
func TestACreationWhoseCallerLeftIsNotSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	gone, cancel := context.WithCancel(b.ctx)
	cancel()
	for range 20 {
		_, err := b.store.CreateBatch(gone, b.batchOf(p, 1, 10, "", day()))
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, store.MayHaveCommitted(err), "nothing was sent")
	}
	require.Empty(t, b.storedItems(t, p.AccountID))
	require.Zero(t, b.view(t, p).Daily.Charged)
	// Those that left gave up their turns: the next creation takes one.
	_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 1, 10, "", day()))
	require.NoError(t, err)
}

// TestACreationBehindAFailingOneIsChargedAlone: a creation that finds no room
// in its group, behind another's charge, is stored alone, where it fits,
// once the group's transaction fails for the other's data: the charge of
// the one that failed is not counted.
func TestACreationBehindAFailingOneIsChargedAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(300)), nil)
	got := b.createBehindABlockedOne(t, b.batchOf(p, 1, 10, "", day()),
		b.batchOf(p, 101, 2, "", day()), // 202 rungs, and an item past the hundredth
		b.batchOf(p, 1, 150, "", day()), // no room after the 202 in the group; room alone
	)
	require.NoError(t, got[0].err)
	require.Error(t, got[1].err)
	require.NoError(t, got[2].err, "stored alone, it fits")
	require.Equal(t, int64(10+150), b.view(t, p).Daily.Charged)
}
