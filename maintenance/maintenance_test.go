package maintenance_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/maintenance"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// TestRunFitsASmallPool: jobs hold a lock connection while their work takes
// another; run together they would exhaust a small pool and stall. Every job
// must keep running on a pool of two connections.
func TestRunFitsASmallPool(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testdb.URL(t))
	require.NoError(t, err)
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool)

	runs := make([]atomic.Int64, 5)
	jobs := make([]maintenance.Job, len(runs))
	for i := range jobs {
		jobs[i] = maintenance.Job{Name: "job " + string(rune('a'+i)), Interval: 10 * time.Millisecond, Run: func(ctx context.Context) (int64, error) {
			runs[i].Add(1)
			_, err := st.QueueDepth(ctx)
			return 0, err
		}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); maintenance.Run(ctx, st, jobs, slog.New(slog.DiscardHandler)) }()
	require.Eventually(t, func() bool {
		for i := range runs {
			if runs[i].Load() < 3 {
				return false
			}
		}
		return true
	}, 10*time.Second, 10*time.Millisecond, "every job keeps running")
	cancel()
	<-done
}

// TestARunTheDatabaseDoesNotAnswerFails: a run whose database does not
// answer (frozen, or behind a network that drops its packets) fails at its
// timeout and is recorded (for the failures' metric) and logged, once for
// the run of failures, and every job keeps its turns, instead of all of
// them waiting behind it for as long as the database does not answer.
func TestARunTheDatabaseDoesNotAnswerFails(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.Connect(t, testdb.Unanswering(t)))
	logs := &syncbuf.Buffer{}
	jobs := make([]maintenance.Job, 2)
	failures := make([]atomic.Int32, len(jobs))
	for i := range jobs {
		jobs[i] = maintenance.Job{Name: "job " + string(rune('a'+i)), Interval: 10 * time.Millisecond, Timeout: 100 * time.Millisecond, Run: func(ctx context.Context) (int64, error) {
			_, err := st.QueueDepth(ctx)
			return 0, err
		}, Record: func(_ int64, err error) {
			if err != nil {
				failures[i].Add(1)
			}
		}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); maintenance.Run(ctx, st, jobs, slog.New(slog.NewJSONHandler(logs, nil))) }()
	require.Eventually(t, func() bool {
		for i := range jobs {
			if failures[i].Load() < 3 {
				return false
			}
		}
		return true
	}, 10*time.Second, 10*time.Millisecond, "every job fails at its timeout (its lock's, before it runs), is recorded, and runs again")
	cancel()
	<-done
	for _, job := range jobs {
		require.Equal(t, 1, strings.Count(logs.String(), `"msg":"maintenance job failed","job":"`+job.Name+`"`),
			"a run of failures is logged when it begins (and each retrylog.Remind)")
	}
}

// freeLocks is a Store whose job locks are always free; the jobs of the
// tests that use it call nothing else.
type freeLocks struct{ maintenance.Store }

func (freeLocks) WithJobLock(_ context.Context, _ string, fn func() (int, error)) (bool, error) {
	_, err := fn()
	return true, err
}

// TestACleanupJobPausesThroughABacklog: a cleanup job whose runs keep
// finding a full batch waits nine times as long as each run took before the
// next, leaving the database to the requests, where another job runs again
// at once (both wait an hour between runs that find nothing left).
func TestACleanupJobPausesThroughABacklog(t *testing.T) {
	t.Parallel()
	// The other job's runs take longer, so that its next starting sooner
	// than nine times as long says it did not pause, however busy the
	// machine.
	for cleanup, took := range map[bool]time.Duration{true: 20 * time.Millisecond, false: 200 * time.Millisecond} {
		runs := backlogRuns(t, freeLocks{}, 1, maintenance.Job{Name: "job", Interval: time.Hour, Cleanup: cleanup}, took)
		requirePaused(t, runs, cleanup)
	}
}

// TestACleanupJobRestsOnEveryReplica: while the replica that ran a cleanup
// job through a backlog pauses, the job rests on the others too, though they
// look for it every 10 ms: over two replicas it takes a tenth of the time,
// not a tenth of each replica's. Alone, the replica takes the job up again
// as its pause ends, not an interval (an hour) later. A job that is no
// cleanup rests on no replica.
func TestACleanupJobRestsOnEveryReplica(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.Connect(t, testdb.URL(t)))
	for _, c := range []struct {
		cleanup  bool
		replicas int
		interval time.Duration
		took     time.Duration // longer where no pause is expected, as in TestACleanupJobPausesThroughABacklog
	}{
		{cleanup: true, replicas: 1, interval: time.Hour, took: 20 * time.Millisecond},
		{cleanup: true, replicas: 2, interval: 10 * time.Millisecond, took: 20 * time.Millisecond},
		{cleanup: false, replicas: 2, interval: 10 * time.Millisecond, took: 200 * time.Millisecond},
	} {
		job := maintenance.Job{Name: fmt.Sprintf("job (cleanup %t) on %d replicas", c.cleanup, c.replicas), Interval: c.interval, Cleanup: c.cleanup}
		requirePaused(t, backlogRuns(t, st, c.replicas, job, c.took), c.cleanup)
	}
}

// span is when one run of a job started and ended.
type span struct{ start, end time.Time }

// backlogRuns runs job on replicas replicas sharing st, its runs each taking
// took and finding a full batch, and returns the first four runs, in order.
func backlogRuns(t *testing.T, st maintenance.Store, replicas int, job maintenance.Job, took time.Duration) []span {
	t.Helper()
	var mu sync.Mutex
	var runs []span
	ctx, cancel := context.WithCancel(context.Background())
	job.Run = func(context.Context) (int64, error) {
		start := time.Now()
		time.Sleep(took)
		mu.Lock()
		defer mu.Unlock()
		if runs = append(runs, span{start, time.Now()}); len(runs) == 4 {
			cancel() // a run again at once may still start
		}
		return maintenance.BatchRows, nil // a full batch: more is left
	}
	var wg sync.WaitGroup
	for range replicas {
		wg.Go(func() { maintenance.Run(ctx, st, []maintenance.Job{job}, slog.New(slog.DiscardHandler)) })
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		wg.Wait()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cancel()
		<-done
	}
	require.GreaterOrEqual(t, len(runs), 4, "cleanup %t, %d replicas: runs before the next interval", job.Cleanup, replicas)
	slices.SortFunc(runs, func(a, b span) int { return a.start.Compare(b.start) })
	return runs[:4]
}

// requirePaused requires each run after the first to start nine times as
// long as the one before took after its end, or, unless paused, sooner.
func requirePaused(t *testing.T, runs []span, paused bool) {
	t.Helper()
	for i := 1; i < len(runs); i++ {
		took, waited := runs[i-1].end.Sub(runs[i-1].start), runs[i].start.Sub(runs[i-1].end)
		if paused {
			require.GreaterOrEqual(t, waited, 9*took, "run %d took %s", i, took)
		} else {
			require.Less(t, waited, 9*took, "run %d took %s", i, took)
		}
	}
}

// TestWhichJobsAreCleanups: the jobs that remove or compact old rows pause
// through a backlog; those that requests and batches wait for do not, the
// expiry of idempotency keys among them (a key is forgotten after the
// completion window: a create with it then makes a new batch).
func TestWhichJobsAreCleanups(t *testing.T) {
	t.Parallel()
	var cleanups []string
	for _, job := range maintenance.Jobs(nil, maintenance.Settings{BatchWindow: time.Hour, BatchRetention: time.Hour, Lease: time.Second, RequestRetention: 24 * time.Hour}, nil) {
		if job.Cleanup {
			cleanups = append(cleanups, job.Name)
		}
	}
	require.ElementsMatch(t, []string{"delete old batches", "delete old rate windows", "delete expired evidence",
		"fold usage minutes", "fold old usage"}, cleanups)
}

// TestRunTellsTheLogWhatItDid: a failed run is logged, and so is the run
// after it that succeeds; a run that handled rows is logged with their
// number, unless it handled none or its job runs every ReconcileInterval
// (the reconciler, whose runs would fill the log).
func TestRunTellsTheLogWhatItDid(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[string]int{}
	job := func(name string, interval time.Duration, results ...int64) maintenance.Job {
		return maintenance.Job{Name: name, Interval: interval, Run: func(context.Context) (int64, error) {
			mu.Lock()
			defer mu.Unlock()
			i := min(runs[name], len(results)-1)
			runs[name]++
			if results[i] < 0 {
				return 0, errors.New("the database is away")
			}
			return results[i], nil
		}}
	}
	jobs := []maintenance.Job{
		job("flaky", maintenance.ReconcileInterval+10*time.Millisecond, -1, 5, 0),
		job("idle", maintenance.ReconcileInterval+10*time.Millisecond, 0),
		job("reconciler", maintenance.ReconcileInterval, 3),
	}
	logs := &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		maintenance.Run(ctx, freeLocks{}, jobs, slog.New(slog.NewJSONHandler(logs, nil)))
	}()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return runs["flaky"] >= 3 && runs["idle"] >= 2 && runs["reconciler"] >= 2
	}, 10*time.Second, 10*time.Millisecond)
	cancel()
	<-done

	var told []string
	for line := range strings.Lines(logs.String()) {
		var entry struct {
			Msg  string `json:"msg"`
			Job  string `json:"job"`
			Rows *int64 `json:"rows"`
		}
		require.NoError(t, json.Unmarshal([]byte(line), &entry), line)
		if entry.Rows != nil {
			entry.Msg += fmt.Sprintf(" (%d rows)", *entry.Rows)
		}
		told = append(told, entry.Job+": "+entry.Msg)
	}
	require.Equal(t, []string{"flaky: maintenance job failed", "flaky: maintenance job runs again", "flaky: maintenance job done (5 rows)"}, told)
}
