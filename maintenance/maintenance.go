// Package maintenance runs the gateway's periodic jobs in every replica:
// folding settled batch items into the daily and budget counters, failing
// batch items whose replica died (lease rescuer), ending batches past their
// window (expiry sweeper), folding the usage sums of past minutes and the
// requests past their retention into sums by day, and removing batches,
// idempotency keys, rate-limit windows, evidence and usage sums by minute
// past retention. Every job is one statement or function that is safe to run
// on several replicas at once (SKIP LOCKED, or idempotent deletes), so no
// leader is needed.
package maintenance

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/rungworks/gateway/internal/retrylog"
	"github.com/rungworks/gateway/metrics"
)

// Store is what the jobs need.
type Store interface {
	ReconcileSettlements(ctx context.Context, maxRows int32) (int64, error)
	DeleteOldRateWindows(ctx context.Context, before time.Time) (int64, error)
	DeleteExpiredEvidence(ctx context.Context, maxRows int32) (int64, error)
	FoldUsageMinutes(ctx context.Context, before time.Time, maxRows int32) (int64, error)
	FoldOldUsage(ctx context.Context, before time.Time, maxRows int32) (int64, error)
	RescueExpiredLeases(ctx context.Context, maxRows int32) (int64, error)
	FoldExpiredQuotaLeases(ctx context.Context, maxRows int) (int64, error)
	ExpireBatches(ctx context.Context, maxRows int32) (int64, error)
	FinishStrandedBatches(ctx context.Context, maxRows int32) (int64, error)
	DeleteOldBatches(ctx context.Context, before time.Time, maxRows int32) (int64, error)
	ExpireIdempotencyKeys(ctx context.Context, before time.Time, maxRows int32) (int64, error)
	QueueDepth(ctx context.Context) (int64, error)
	// WithJobLock runs fn unless another replica runs the job or it rests;
	// a positive rest from fn rests the job on every replica for rest times
	// as long as it ran.
	WithJobLock(ctx context.Context, job string, fn func() (rest int, err error)) (bool, error)
}

// Settings are the periods the jobs enforce.
type Settings struct {
	// BatchWindow is how long an idempotency key is kept.
	BatchWindow time.Duration
	// BatchRetention is how long a terminal batch is kept.
	BatchRetention time.Duration
	// Lease is the batch item lease: the rescuer looks this often.
	Lease time.Duration
	// RequestRetention is how long a request is kept before it is folded
	// into its day's sums, and the usage sums of a minute before they are
	// left to their hour's; zero keeps both for good (no job).
	RequestRetention time.Duration
}

// Default intervals and bounds.
const (
	// ReconcileInterval keeps the counters close to the committed usage; until
	// a settlement is folded in, admission counts it at its (larger) estimate.
	ReconcileInterval = 200 * time.Millisecond
	// HousekeepingInterval paces recovery and cleaning.
	HousekeepingInterval = 30 * time.Second
	// queueDepthInterval paces the queue-depth sample.
	queueDepthInterval = 5 * time.Second
	// scanSpacing bounds the cost of the jobs that read the whole queue:
	// counting the queued items (about a microsecond an item) and looking
	// for stranded batches among the open ones (4–9 µs a batch) take
	// longer the longer the queue, so a long queue is read less often, with
	// at most 1 % of the time going to each.
	scanSpacing = 100
	// batchRows bounds the rows one run of a job touches.
	batchRows = 1000
	// backlogShare bounds the time a cleanup job takes while it works
	// through a backlog (old rows piled up: a first start on a database of
	// months of requests, a retention made shorter, a replica long stopped):
	// after a full run it rests backlogShare-1 times as long as the run took,
	// on every replica, so it runs a tenth of the time at most however many
	// replicas there are and however slow the database has become. Run back
	// to back, the fold of old requests kept a database backend busy and
	// filled the WAL every commit flushes, and requests waited up to four
	// times as long (docs/benchmarks.md, "Cleanup through a backlog"); at a
	// tenth it still folds some 5,000 requests a second under a load of 1,000
	// a second.
	backlogShare = 10
	// DefaultRunTimeout bounds one run of a job: a database that does not
	// answer (frozen, or cut off by a network that drops its packets) fails
	// the run, which is logged, and the next turn tries again, instead of
	// holding every job of the replica behind it until the connection gives
	// up.
	DefaultRunTimeout = time.Minute
	// rateWindowKeep is how long rate-limit windows are kept: the sliding window
	// reads the current and the previous minute.
	rateWindowKeep = 2 * time.Minute
	// usageFoldAfter is how old a minute of usage is when its sums, one for
	// each server process that settled in it, are folded into one: settling
	// in it is then over, nearly always (a later settlement adds a row, folded
	// at the next run).
	usageFoldAfter = 2 * time.Minute
)

// Job is one periodic task.
type Job struct {
	Name     string
	Interval time.Duration
	// Timeout bounds a run; zero is DefaultRunTimeout.
	Timeout time.Duration
	// Cleanup marks a job that removes or compacts old rows, which nothing
	// waits for: through a backlog its full runs are spaced to
	// 1/backlogShare of the time, over all replicas. The others (rescues,
	// expiries of batches and idempotency keys, reconciliation), whose work
	// requests and batches wait for, run again at once.
	Cleanup bool
	Run     func(ctx context.Context) (int64, error)
	// Record, when set, is told of each run's rows and failure, the job
	// lock's included (the database away fails there, before Run), but for
	// a run the replica's shutdown cut short.
	Record func(rows int64, err error)
}

// pauses says whether a run that handled n rows is followed by a pause: a
// cleanup job's full run, through a backlog.
func (j Job) pauses(n int64) bool { return j.Cleanup && n >= batchRows }

// Jobs are the gateway's maintenance jobs over st; m, when set, records each
// job's rows and failures, lease rescues and the queue depth.
func Jobs(st Store, set Settings, m *metrics.Metrics) []Job {
	jobs := []Job{
		{Name: "rescue expired leases", Interval: max(set.Lease/2, time.Second), Run: func(ctx context.Context) (int64, error) {
			n, err := st.RescueExpiredLeases(ctx, batchRows)
			m.LeaseRescues(n)
			return n, err
		}},
		{Name: "fold expired quota leases", Interval: max(set.Lease/2, time.Second), Run: func(ctx context.Context) (int64, error) {
			return st.FoldExpiredQuotaLeases(ctx, batchRows)
		}},
		{Name: "sample queue depth", Interval: queueDepthInterval, Run: spaced(scanSpacing, func(ctx context.Context) (int64, error) {
			n, err := st.QueueDepth(ctx)
			if err == nil {
				m.QueueDepth(n)
			}
			return 0, err
		})},
		{Name: "expire batches", Interval: time.Second, Run: func(ctx context.Context) (int64, error) { return st.ExpireBatches(ctx, batchRows) }},
		{Name: "finish stranded batches", Interval: HousekeepingInterval, Run: spaced(scanSpacing, func(ctx context.Context) (int64, error) {
			return st.FinishStrandedBatches(ctx, batchRows)
		})},
		{Name: "delete old batches", Interval: HousekeepingInterval, Cleanup: true, Run: func(ctx context.Context) (int64, error) {
			return st.DeleteOldBatches(ctx, time.Now().Add(-set.BatchRetention), batchRows)
		}},
		{Name: "expire idempotency keys", Interval: HousekeepingInterval, Run: func(ctx context.Context) (int64, error) {
			return st.ExpireIdempotencyKeys(ctx, time.Now().Add(-set.BatchWindow), batchRows)
		}},
		{Name: "reconcile settlements", Interval: ReconcileInterval, Run: func(ctx context.Context) (int64, error) { return st.ReconcileSettlements(ctx, batchRows) }},
		{Name: "delete old rate windows", Interval: HousekeepingInterval, Cleanup: true, Run: func(ctx context.Context) (int64, error) {
			return st.DeleteOldRateWindows(ctx, time.Now().Add(-rateWindowKeep))
		}},
		{Name: "delete expired evidence", Interval: HousekeepingInterval, Cleanup: true, Run: func(ctx context.Context) (int64, error) { return st.DeleteExpiredEvidence(ctx, batchRows) }},
		{Name: "fold usage minutes", Interval: HousekeepingInterval, Cleanup: true, Run: func(ctx context.Context) (int64, error) {
			return st.FoldUsageMinutes(ctx, time.Now().Add(-usageFoldAfter), batchRows)
		}},
	}
	if set.RequestRetention > 0 {
		jobs = append(jobs, Job{Name: "fold old usage", Interval: HousekeepingInterval, Cleanup: true, Run: func(ctx context.Context) (int64, error) {
			return st.FoldOldUsage(ctx, time.Now().Add(-set.RequestRetention), batchRows)
		}})
	}
	for i := range jobs {
		name := jobs[i].Name
		m.MaintenanceJob(name)
		jobs[i].Record = func(rows int64, err error) { m.MaintenanceRun(name, rows, err) }
	}
	return jobs
}

// spaced returns run, made to skip its turns until spacing times as long as
// its last successful run took has passed since that run began: a job whose
// cost grows with the data then takes at most 1/spacing of the time. A failed
// run (the database away, a timeout) tells nothing of that cost: the next
// turn runs.
func spaced(spacing int, run func(ctx context.Context) (int64, error)) func(ctx context.Context) (int64, error) {
	var next time.Time
	return func(ctx context.Context) (int64, error) {
		start := time.Now()
		if start.Before(next) {
			return 0, nil
		}
		n, err := run(ctx)
		if err == nil {
			next = start.Add(time.Duration(spacing) * time.Since(start))
		}
		return n, err
	}
}

// Run runs every job on its own schedule until ctx ends, under the job's lock
// (a replica that finds it taken skips that run). A replica runs one job at a
// time, so maintenance holds at most two database connections (the lock's and
// the job's). A run that handled a full batch is repeated at once, or, for a
// cleanup job, after backlogShare-1 times as long as it took, a rest the
// other replicas keep too (they find the job resting and wait for their
// next interval); intervals carry up to 20% jitter so replicas spread out.
func Run(ctx context.Context, st Store, jobs []Job, logger *slog.Logger) {
	var wg sync.WaitGroup
	var oneAtATime sync.Mutex
	for _, job := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			failures := retrylog.New(logger, slog.LevelError, "maintenance job failed", "maintenance job runs again")
			for {
				var n int64
				oneAtATime.Lock()
				start := time.Now()
				runCtx, cancel := context.WithTimeout(ctx, cmp.Or(job.Timeout, DefaultRunTimeout))
				_, err := st.WithJobLock(runCtx, job.Name, func() (rest int, err error) {
					n, err = job.Run(runCtx)
					if err == nil && job.pauses(n) {
						rest = backlogShare - 1
					}
					return rest, err
				})
				cancel()
				took := time.Since(start)
				oneAtATime.Unlock()
				if job.Record != nil && !errors.Is(err, context.Canceled) {
					job.Record(n, err)
				}
				switch {
				case err != nil && ctx.Err() == nil:
					failures.Failed(err, "job", job.Name)
				case err == nil:
					failures.Succeeded("job", job.Name)
				}
				if err == nil && n > 0 && job.Interval > ReconcileInterval {
					logger.Info("maintenance job done", "job", job.Name, "rows", n)
				}
				wait := job.Interval + time.Duration(rand.Int64N(int64(job.Interval)/5+1))
				switch {
				case job.pauses(n):
					wait = (backlogShare - 1) * took
				case n >= batchRows:
					wait = 0
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
			}
		}()
	}
	wg.Wait()
}
