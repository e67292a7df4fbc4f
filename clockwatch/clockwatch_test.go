package clockwatch_test

import (
	"context"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/clockwatch"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type testBundle struct {
	store *store.Store
	logs  *syncbuf.Buffer
	m     *metrics.Metrics
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	return &testBundle{store: store.New(testdb.New(t)), logs: &syncbuf.Buffer{}, m: metrics.New()}
}

// counted reads the database's clock, counting the readings.
type counted struct {
	clockwatch.Store
	reads atomic.Int64
}

func (c *counted) DatabaseTime(ctx context.Context) (time.Time, error) {
	defer c.reads.Add(1)
	return c.Store.DatabaseTime(ctx)
}

// run runs the watch with local as the replica's clock until it has compared
// the clocks a few times, and returns the offset it recorded last.
func (b *testBundle) run(t *testing.T, local func() time.Time) time.Duration {
	t.Helper()
	st := &counted{Store: b.store}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		clockwatch.Run(ctx, st, clockwatch.Config{
			Interval: 10 * time.Millisecond, Local: local, Logger: slog.New(slog.NewJSONHandler(b.logs, nil)), Metrics: b.m,
		})
	}()
	require.Eventually(t, func() bool { return st.reads.Load() >= 3 }, 10*time.Second, 5*time.Millisecond)
	cancel()
	<-done
	match := regexp.MustCompile(`(?m)^gateway_clock_offset_seconds (\S+)$`).FindStringSubmatch(metricstest.Scrape(b.m))
	require.NotNil(t, match)
	secs, err := strconv.ParseFloat(match[1], 64)
	require.NoError(t, err)
	return time.Duration(secs * float64(time.Second))
}

// stepping is a clock that reads start, then two seconds later at each
// reading: whatever the time between readings, each round trip takes 2 s.
func stepping(start time.Time) func() time.Time {
	var readings atomic.Int64
	return func() time.Time { return start.Add(time.Duration(readings.Add(1)-1) * 2 * time.Second) }
}

// TestOffsetIsTheDatabaseClockLessTheReplicas: the offset is the database's
// time less the replica's, so a replica whose clock runs an hour ahead reads
// an hour behind; the database's reading is taken for halfway through the
// round trip.
func TestOffsetIsTheDatabaseClockLessTheReplicas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	offset, roundTrip, err := clockwatch.Offset(context.Background(), b.store, time.Now)
	require.NoError(t, err)
	require.Positive(t, roundTrip)
	require.Less(t, offset.Abs(), time.Second, "one machine, one clock")
	offset, _, err = clockwatch.Offset(context.Background(), b.store, func() time.Time { return time.Now().Add(time.Hour) })
	require.NoError(t, err)
	require.InDelta(t, -time.Hour.Seconds(), offset.Seconds(), 1)

	// A clock read before and after the database's, two seconds apart: the
	// database's time is taken for halfway between.
	offset, roundTrip, err = clockwatch.Offset(context.Background(), b.store, stepping(time.Now()))
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, roundTrip)
	require.InDelta(t, -time.Second.Seconds(), offset.Seconds(), 0.5)
}

// TestRunWarnsOfAClockThatIsOff: the offset is recorded at each comparison,
// and logged while it is past the tolerance either way, not otherwise; a
// comparison whose round trip took longer than the tolerance is skipped.
func TestRunWarnsOfAClockThatIsOff(t *testing.T) {
	t.Parallel()
	t.Run("right", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.Less(t, b.run(t, time.Now).Abs(), time.Second)
		require.Empty(t, b.logs.String())
	})
	t.Run("a minute behind", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.InDelta(t, time.Minute.Seconds(), b.run(t, func() time.Time { return time.Now().Add(-time.Minute) }).Seconds(), 1)
		require.True(t, strings.Contains(b.logs.String(), `"msg":"this replica's clock is off from the database's`), b.logs.String())
	})
	t.Run("read too slowly to tell", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.Zero(t, b.run(t, stepping(time.Now().Add(time.Hour))), "a round trip past the tolerance is not a reading")
		require.Empty(t, b.logs.String())
	})
	t.Run("a minute ahead", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.InDelta(t, -time.Minute.Seconds(), b.run(t, func() time.Time { return time.Now().Add(time.Minute) }).Seconds(), 1)
		require.True(t, strings.Contains(b.logs.String(), `"msg":"this replica's clock is off from the database's`), b.logs.String())
	})
}
