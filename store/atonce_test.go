package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/maintenance"
	"github.com/rungworks/gateway/store"
)

// TestEverythingOfTwoTenantsAtOnce: two replicas (two stores, each with its
// own queue of creations) create, claim, start, complete, hand back, finish
// and cancel batches of two tenants with capped projects, while interactive
// requests are granted slices, settled in groups under both tenants' slices
// and folded back, each replica renews its slices' leases and returns rate
// slices of both tenants' keys, an operator changes the tenants' limits,
// and a replica's maintenance jobs reconcile batch settlements, fold expired
// leases, rescue items whose lease ran out, end stranded and expired batches
// and delete what is past retention — all at once. No statement fails
// (PostgreSQL fails one of two that deadlock), every batch ends, and each
// tenant's day and budget hold exactly what it used.
func TestEverythingOfTwoTenantsAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var tenants [2]*gateway.Principal
	for i, name := range []string{"acme", "globex"} {
		_, tenants[i] = b.key(t, name, gateway.TierDeveloper, gateway.ScopeInference)
		b.limits(t, name, ptr(int64(1_000_000_000)), ptr(int64(1_000_000_000)))
	}
	replicas := []*store.Store{b.store, store.New(b.store.Pool())}
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()

	const batchesEach, itemsEach, estimate, itemCost = 12, 10, 7, 3
	var (
		work sync.WaitGroup // creators and interactive requests: they end
		jobs sync.WaitGroup // drainers and maintenance: they run until stop
		stop = make(chan struct{})
		errs = make(chan error, 16)
		used [2]atomic.Int64
	)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}

	for r, st := range replicas {
		work.Add(1)
		go func() { // a client creating batches, and cancelling every third
			defer work.Done()
			for i := range batchesEach {
				n := (r + i) % 2
				res, err := st.CreateBatch(ctx, b.batchOf(tenants[n], itemsEach, estimate, "", day()))
				if err != nil {
					fail(err)
					return
				}
				if i%3 == 2 {
					err := st.CancelBatch(ctx, tenants[n].AccountID, res.BatchID)
					if err != nil && gateway.ErrorCodeOf(err) != gateway.EBatchNotCancellable {
						fail(err)
						return
					}
				}
			}
		}()
		jobs.Add(1)
		go func() { // a drainer
			defer jobs.Done()
			owner := uuid.Must(uuid.NewV7())
			claims := 0
			for !stopped() {
				items, err := st.ClaimItems(ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 16, PerAccount: 8, Lease: time.Minute})
				if err != nil {
					fail(err)
					return
				}
				var started []uuid.UUID
				tenantOf := map[uuid.UUID]int{} // batch → tenant: 0 unless it is the second's
				for _, it := range items {
					if it.AccountID == tenants[1].AccountID {
						tenantOf[it.BatchID] = 1
					}
					if it.BatchQueued {
						started = append(started, it.BatchID)
					}
				}
				if err := st.StartBatches(ctx, started); err != nil {
					fail(err)
					return
				}
				if claims++; claims%5 == 0 && len(items) > 0 { // the last one was never dispatched: back to the queue
					last := items[len(items)-1]
					items = items[:len(items)-1]
					if _, err := st.RequeueItems(ctx, owner, []store.ItemKey{{BatchID: last.BatchID, Index: last.Index}}); err != nil {
						fail(err)
						return
					}
				}
				applied, err := st.CompleteItems(ctx, owner, itemResults(items, itemCost))
				if err != nil {
					fail(err)
					return
				}
				finished := make([]uuid.UUID, len(applied))
				for i, k := range applied {
					finished[i] = k.BatchID
					used[tenantOf[k.BatchID]].Add(itemCost)
				}
				if err := st.FinishBatches(ctx, finished); err != nil {
					fail(err)
					return
				}
				if len(items) == 0 {
					time.Sleep(time.Millisecond)
				}
			}
		}()
		owner := uuid.Must(uuid.NewV7())
		var (
			heldMu sync.Mutex
			held   []uuid.UUID // the replica's leases that last an hour
		)
		interactive := make(chan struct{})
		work.Add(1)
		go func() { // interactive requests of both tenants
			defer work.Done()
			defer close(interactive)
			grant := func(p *gateway.Principal, id uuid.UUID, lease time.Duration) error {
				_, err := st.GrantQuota(ctx, store.QuotaRequest{
					LeaseID: id, Owner: owner, AccountID: p.AccountID, ProjectID: p.ProjectID, Day: time.Now(),
					DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: 10, Share: 8, Lease: lease,
				})
				return err
			}
			for i := range 30 {
				n := (r + i) % 2
				p, other := tenants[n], tenants[1-n]
				id, otherID, lease := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), time.Hour
				if i%3 == 0 {
					lease = -time.Second // left to the folds of expired leases
				}
				err := grant(p, id, lease)
				if err == nil {
					err = grant(other, otherID, time.Hour)
				}
				heldMu.Lock()
				held = append(held, otherID)
				if i%3 != 0 {
					held = append(held, id)
				}
				heldMu.Unlock()
				if err == nil { // a group under two leases, and charged directly
					err = st.SettleRequests(ctx, []store.Settlement{
						{Record: record(p, uuid.Must(uuid.NewV7()), 3), LeaseID: &id},
						{Record: record(other, uuid.Must(uuid.NewV7()), 5)},
						{Record: record(other, uuid.Must(uuid.NewV7()), 4), LeaseID: &otherID},
					})
				}
				if err == nil {
					used[n].Add(3)
					used[1-n].Add(9)
				}
				if err == nil && i%3 != 0 {
					_, err = st.FoldQuotaLeases(ctx, owner, []uuid.UUID{id})
				}
				if err != nil {
					fail(err)
					return
				}
			}
		}()
		work.Add(1)
		go func() { // the replica renewing its leases while they settle
			defer work.Done()
			for {
				select {
				case <-interactive:
					return
				default:
				}
				heldMu.Lock()
				ids := append([]uuid.UUID(nil), held...)
				heldMu.Unlock()
				if _, err := st.RenewQuotaLeases(ctx, owner, ids, time.Hour); err != nil {
					fail(err)
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
		work.Add(1)
		go func() { // the replica leasing rate slices of both keys, and returning them
			defer work.Done()
			for i := range 60 {
				keys := []uuid.UUID{tenants[(r+i)%2].KeyID, tenants[(r+i+1)%2].KeyID}
				now := time.Now()
				var returns []store.RateReturn
				for _, key := range keys {
					g, err := st.LeaseRate(ctx, key, now, 1_000_000, 8)
					if err != nil {
						fail(err)
						return
					}
					returns = append(returns, store.RateReturn{KeyID: key, Window: now.Truncate(time.Minute), Count: g.Granted})
				}
				if err := st.ReturnRate(ctx, returns); err != nil {
					fail(err)
					return
				}
			}
		}()
	}
	work.Add(1)
	go func() { // an operator changing both tenants' limits (never low enough to refuse)
		defer work.Done()
		for i := range 20 {
			limit := int64(1_000_000_000 + i)
			err := b.store.SetLimits(ctx, store.SetLimitsParams{Account: []string{"acme", "globex"}[i%2], DailyRungs: &limit, Project: "default", BudgetRungs: &limit})
			if err != nil {
				fail(err)
				return
			}
		}
	}()
	jobs.Add(1)
	go func() { // the maintenance jobs of a replica, one after another
		defer jobs.Done()
		all := maintenance.Jobs(b.store, maintenance.Settings{BatchWindow: 24 * time.Hour, BatchRetention: 24 * time.Hour, Lease: time.Minute}, nil)
		for !stopped() {
			for _, job := range all {
				if _, err := job.Run(ctx); err != nil {
					fail(fmt.Errorf("error running %s: %w", job.Name, err))
					return
				}
			}
		}
	}()

	work.Wait()
	require.Eventually(t, func() bool {
		var open int
		err := b.store.Pool().QueryRow(ctx, `SELECT count(*) FROM batches WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired')`).Scan(&open)
		return err == nil && open == 0
	}, time.Minute, 10*time.Millisecond, "every batch ends")
	close(stop)
	jobs.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	var completed, cancelled int
	require.NoError(t, b.store.Pool().QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'completed'),
		count(*) FILTER (WHERE status = 'cancelled') FROM batches`).Scan(&completed, &cancelled))
	require.Positive(t, completed, "batches were drained")
	require.Positive(t, cancelled, "batches were cancelled")

	_, err := b.store.Pool().Exec(ctx, `UPDATE quota_leases SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	_, err = b.store.FoldExpiredQuotaLeases(ctx, 1000)
	require.NoError(t, err)
	_, err = b.store.ReconcileSettlements(ctx, 10_000)
	require.NoError(t, err)
	for n, p := range tenants {
		v := b.view(t, p)
		require.Equal(t, used[n].Load(), v.Daily.Charged, "the day holds what was used, once")
		require.Equal(t, used[n].Load(), v.Budget.Spent, "the budget too")
		require.Zero(t, v.Budget.Reserved, "nothing is left reserved")
		require.Equal(t, used[n].Load(), v.Totals.TotalRungs)
	}
}
