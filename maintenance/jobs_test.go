package maintenance_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/maintenance"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

// TestEveryJobRunsAgainstTheSchema: each job's statement runs on the
// migrated database, and the jobs with work waiting do it: a quota lease that
// ran out is folded, an item whose batch lease ran out is rescued (and
// counted), the queue is sampled, a batch past its window ends, what they
// settled is folded into the counters, the usage sums of a minute long past
// are folded into one, and a request past the request retention into its
// day's sums, its minute's sums left to its hour's. The jobs that run every
// 30 s in a replica run here at once.
func TestEveryJobRunsAgainstTheSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := store.New(testdb.Connect(t, testdb.URL(t)))
	token, err := st.CreateKey(ctx, store.CreateKeyParams{Account: "acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.NoError(t, err)
	p, err := st.LookupKey(ctx, token)
	require.NoError(t, err)

	now := time.Now().UTC()
	grant, err := st.GrantQuota(ctx, store.QuotaRequest{
		LeaseID: uuid.Must(uuid.NewV7()), Owner: uuid.Must(uuid.NewV7()), AccountID: p.AccountID, ProjectID: p.ProjectID,
		Day: now, DefaultCeiling: 1000, Need: 10, Share: 1, Lease: -time.Minute,
	})
	require.NoError(t, err)
	require.Equal(t, gateway.AdmitOK, grant.Outcome)

	batch := func(n int, expires time.Time) {
		items := make([]store.NewItem, n)
		for i := range items {
			items[i] = store.NewItem{Request: store.ItemRequest{Prompt: fmt.Sprintf("item %d", i), Model: gateway.ModelInstant, MaxOutputRungs: 10}, Estimate: 1}
		}
		hash, err := store.HashRequest(map[string]any{"n": n, "expires": expires})
		require.NoError(t, err)
		_, err = st.CreateBatch(ctx, store.NewBatch{Principal: p, RequestHash: hash, Items: items, CreatedAt: time.Now().UTC(), ExpiresAt: expires})
		require.NoError(t, err)
	}
	batch(1, now.Add(time.Hour))
	claimed, err := st.ClaimItems(ctx, store.ClaimParams{Owner: uuid.Must(uuid.NewV7()), Max: 1, PerAccount: 1, Lease: time.Millisecond})
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	batch(2, now.Add(-time.Second)) // past its window, its items queued
	for _, past := range []time.Time{now.Add(-10 * time.Minute), now.Add(-72 * time.Hour)} {
		require.NoError(t, st.SettleRequests(ctx, []store.Settlement{{Record: gateway.UsageRecord{
			RequestID: uuid.Must(uuid.NewV7()), Principal: p, Model: gateway.ModelInstant, Entry: gateway.EntryResponses,
			Usage:     gateway.Usage{InputTokens: 1, OutputTokens: 1, InputRungs: 1, OutputRungs: 1, TotalRungs: 2},
			CreatedAt: past, CompletedAt: past, EvidenceExpiresAt: now,
		}}}))
	}
	time.Sleep(10 * time.Millisecond) // the claimed item's lease runs out

	m := metrics.New()
	jobs := maintenance.Jobs(st, maintenance.Settings{BatchWindow: 24 * time.Hour, BatchRetention: 24 * time.Hour, Lease: 30 * time.Second, RequestRetention: 48 * time.Hour}, m)
	done := map[string]int64{}
	for _, job := range jobs {
		require.Positive(t, job.Interval, job.Name)
		require.NotContains(t, done, job.Name, "job names are their locks: each once")
		n, err := job.Run(ctx)
		require.NoError(t, err, job.Name)
		job.Record(n, err) // as maintenance.Run does
		done[job.Name] = n
	}
	require.Equal(t, int64(1), done["fold expired quota leases"])
	require.Equal(t, int64(1), done["rescue expired leases"], "one batch rescued")
	require.Equal(t, int64(1), done["expire batches"])
	require.Positive(t, done["reconcile settlements"], "what the rescue and the expiry settled is folded into the counters")
	require.Equal(t, int64(2), done["fold usage minutes"], "the two requests' minutes")
	require.Equal(t, int64(2), done["fold old usage"], "the request of three days ago, and its minute (folded into its hour)")
	scrape := metricstest.Scrape(m)
	require.Contains(t, scrape, `gateway_maintenance_rows_total{task="fold old usage"} 2`+"\n")
	require.Contains(t, scrape, `gateway_maintenance_rows_total{task="rescue expired leases"} 1`+"\n")
	for _, job := range jobs {
		require.Contains(t, scrape, `gateway_maintenance_failures_total{task="`+job.Name+`"} 0`+"\n")
	}
	require.Contains(t, scrape, "gateway_batch_lease_rescues_total 1\n")
	require.Contains(t, scrape, "gateway_batch_queue_depth 2\n", "the expired batch's items, sampled before it ended")
}

// TestRequestsAreKeptWithoutARetention: with no request retention (zero),
// there is no job that folds requests or removes the sums by minute.
func TestRequestsAreKeptWithoutARetention(t *testing.T) {
	t.Parallel()
	for _, job := range maintenance.Jobs(nil, maintenance.Settings{BatchWindow: time.Hour, BatchRetention: time.Hour, Lease: time.Second}, nil) {
		require.NotEqual(t, "fold old usage", job.Name)
	}
	jobs := maintenance.Jobs(nil, maintenance.Settings{BatchWindow: time.Hour, BatchRetention: time.Hour, Lease: time.Second, RequestRetention: 24 * time.Hour}, nil)
	require.Equal(t, "fold old usage", jobs[len(jobs)-1].Name)
}

// lockFailing fails every job's lock, as a database away does before any job
// runs.
type lockFailing struct{ maintenance.Store }

func (lockFailing) WithJobLock(context.Context, string, func() (int, error)) (bool, error) {
	return false, errors.New("the database is away")
}

// TestFailuresAreCounted: a job's failed run is counted under its name, when
// its lock failed too (the database away); a run the shutdown cut short is
// not a failure.
func TestFailuresAreCounted(t *testing.T) {
	t.Parallel()
	settings := maintenance.Settings{BatchWindow: time.Hour, BatchRetention: time.Hour, Lease: time.Second}
	m := metrics.New()
	jobs := maintenance.Jobs(lockFailing{}, settings, m)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); maintenance.Run(ctx, lockFailing{}, jobs, slog.New(slog.DiscardHandler)) }()
	require.Eventually(t, func() bool {
		scrape := metricstest.Scrape(m)
		for _, job := range jobs {
			if strings.Contains(scrape, `gateway_maintenance_failures_total{task="`+job.Name+`"} 0`+"\n") {
				return false
			}
		}
		return true
	}, 10*time.Second, 10*time.Millisecond, "each job's first run failed, and is counted")
	cancel()
	<-done

	m = metrics.New()
	jobs = maintenance.Jobs(freeLocks{cancelledStore{}}, settings, m)
	i := slices.IndexFunc(jobs, func(j maintenance.Job) bool { return j.Name == "delete old rate windows" })
	require.GreaterOrEqual(t, i, 0)
	runs, run := 0, jobs[i].Run
	jobs[i].Run = func(ctx context.Context) (int64, error) { runs++; return run(ctx) }
	maintenance.Run(ctx, freeLocks{cancelledStore{}}, jobs[i:i+1], slog.New(slog.DiscardHandler)) // ctx ended: one run, cut short
	require.Equal(t, 1, runs)
	require.Contains(t, metricstest.Scrape(m), `gateway_maintenance_failures_total{task="delete old rate windows"} 0`+"\n")
}

// cancelledStore's removal of old rate windows ends with its context.
type cancelledStore struct{ maintenance.Store }

func (cancelledStore) DeleteOldRateWindows(ctx context.Context, _ time.Time) (int64, error) {
	return 0, fmt.Errorf("error deleting old rate windows: %w", ctx.Err())
}
