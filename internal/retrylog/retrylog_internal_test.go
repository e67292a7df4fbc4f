package retrylog

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/logsample"
)

type testBundle struct {
	failure *Failure
	logs    *bytes.Buffer
	now     time.Time
}

// setup returns a Failure on a clock the test moves, logging JSON.
func setup(t *testing.T) *testBundle {
	t.Helper()
	b := &testBundle{logs: &bytes.Buffer{}, now: time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)}
	b.failure = New(slog.New(slog.NewJSONHandler(b.logs, nil)), slog.LevelWarn, "the work failed", "the work is done again")
	b.failure.now = func() time.Time { return b.now }
	return b
}

// lines returns the lines logged since the last call, decoded.
func (b *testBundle) lines(t *testing.T) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(b.logs.String()), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m))
		delete(m, "time")
		lines = append(lines, m)
	}
	b.logs.Reset()
	return lines
}

// TestARunOfFailures: the first failure is logged, the next ones only a
// Remind after the last line (the latest error, how long, how many), and the
// success that ends the run once; successes outside a run log nothing. The
// second failure of a run is logged too when its error differs from the
// first's.
func TestARunOfFailures(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.failure.Succeeded("job", "a")
	require.Empty(t, b.lines(t), "no run to end")

	b.failure.Failed(errors.New("connection refused"), "job", "a")
	require.Equal(t, []map[string]any{{"level": "WARN", "msg": "the work failed", "job": "a", "error": "connection refused"}}, b.lines(t))
	for range 59 {
		b.now = b.now.Add(time.Second)
		b.failure.Failed(errors.New("connection refused"), "job", "a")
	}
	require.Empty(t, b.lines(t), "within a Remind of the first")

	b.now = b.now.Add(time.Second)
	b.failure.Failed(errors.New("the database system is starting up"), "job", "a")
	require.Equal(t, []map[string]any{{
		"level": "WARN", "msg": "the work failed", "job": "a", "error": "the database system is starting up",
		"failing_for": "1m0s", "attempts": float64(61),
	}}, b.lines(t))
	b.now = b.now.Add(Remind - time.Second)
	b.failure.Failed(errors.New("connection refused"), "job", "a")
	require.Empty(t, b.lines(t), "a Remind after the reminder")

	b.now = b.now.Add(1500 * time.Millisecond)
	b.failure.Succeeded("job", "a")
	require.Equal(t, []map[string]any{{
		"level": "INFO", "msg": "the work is done again", "job": "a", "failed_for": "2m0.5s", "attempts": float64(62),
	}}, b.lines(t))
	b.failure.Succeeded("job", "a")
	require.Empty(t, b.lines(t), "the run ended once")

	b.failure.Failed(errors.New("conn closed"), "job", "a")
	require.Equal(t, []map[string]any{{"level": "WARN", "msg": "the work failed", "job": "a", "error": "conn closed"}}, b.lines(t),
		"a new run is logged at once")
	b.now = b.now.Add(time.Second)
	b.failure.Failed(errors.New("password authentication failed"), "job", "a")
	require.Equal(t, []map[string]any{{
		"level": "WARN", "msg": "the work failed", "job": "a", "error": "password authentication failed",
		"failing_for": "1s", "attempts": float64(2),
	}}, b.lines(t), "why the connection cannot be made again")
	b.now = b.now.Add(time.Second)
	b.failure.Failed(errors.New("the database system is starting up"), "job", "a")
	require.Empty(t, b.lines(t), "past the second, a Remind after the last line")
}

// TestEveryLoopsRunIsWritten: the runs of many loops beginning together, as
// an outage makes them, are all written through a sampling handler, whose
// burst would have cut them.
func TestEveryLoopsRunIsWritten(t *testing.T) {
	t.Parallel()
	logs := &bytes.Buffer{}
	sampling := logsample.New(slog.NewJSONHandler(logs, nil))
	logger := slog.New(sampling)
	jobs := 2 * logsample.Burst
	for i := range jobs {
		New(logger, slog.LevelError, "maintenance job failed", "maintenance job runs again").Failed(errors.New("connection refused"), "job", i)
	}
	require.Equal(t, jobs, strings.Count(logs.String(), `"msg":"maintenance job failed"`))
	sampling.Flush()
	require.NotContains(t, logs.String(), logsample.SuppressedKey)
}
