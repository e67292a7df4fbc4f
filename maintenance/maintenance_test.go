package maintenance_test

import (
	"context"
	"log/slog"
	"strings"
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
// timeout and is logged, and every job keeps its turns, instead of all of
// them waiting behind it for as long as the database does not answer.
func TestARunTheDatabaseDoesNotAnswerFails(t *testing.T) {
	t.Parallel()
	st := store.New(testdb.Connect(t, testdb.Unanswering(t)))
	logs := &syncbuf.Buffer{}
	jobs := make([]maintenance.Job, 2)
	for i := range jobs {
		jobs[i] = maintenance.Job{Name: "job " + string(rune('a'+i)), Interval: 10 * time.Millisecond, Timeout: 100 * time.Millisecond, Run: func(ctx context.Context) (int64, error) {
			_, err := st.QueueDepth(ctx)
			return 0, err
		}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); maintenance.Run(ctx, st, jobs, slog.New(slog.NewJSONHandler(logs, nil))) }()
	require.Eventually(t, func() bool {
		for _, job := range jobs {
			if strings.Count(logs.String(), `"msg":"maintenance job failed","job":"`+job.Name+`"`) < 2 {
				return false
			}
		}
		return true
	}, 10*time.Second, 10*time.Millisecond, "every job fails at its timeout, and runs again")
	cancel()
	<-done
}
