package logsample

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/syncbuf"
)

// decoded returns each line written to out, decoded.
func decoded(t *testing.T, out *syncbuf.Buffer) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		lines = append(lines, m)
	}
	return lines
}

// count returns how many lines have msg, and the suppressed counts of those that have one.
func count(t *testing.T, written []map[string]any, msg string) (n int, suppressed []float64) {
	t.Helper()
	for _, m := range written {
		if m["msg"] != msg {
			continue
		}
		n++
		if s, ok := m[SuppressedKey]; ok {
			suppressed = append(suppressed, s.(float64))
		}
	}
	return n, suppressed
}

type testBundle struct {
	out     *syncbuf.Buffer
	handler *Handler
	logger  *slog.Logger
}

func setup() *testBundle {
	out := &syncbuf.Buffer{}
	h := New(slog.NewJSONHandler(out, nil))
	return &testBundle{out: out, handler: h, logger: slog.New(h)}
}

func TestAFloodIsKeptToItsBurstAndACount(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		for i := range 1000 {
			b.logger.Error("request failed", "i", i)
			time.Sleep(time.Millisecond)
		}
		// 1 s in: the first Burst are written, the rest wait for the window's end.
		n, suppressed := count(t, decoded(t, b.out), "request failed")
		require.Equal(t, Burst, n)
		require.Empty(t, suppressed)

		time.Sleep(Window)
		synctest.Wait()
		written := decoded(t, b.out)
		n, suppressed = count(t, written, "request failed")
		require.Equal(t, Burst+1, n)
		require.Equal(t, []float64{1000 - Burst}, suppressed)
		last := written[len(written)-1]
		require.InDelta(t, 999, last["i"], 0, "the count comes with the last record left out")
	})
}

func TestEachKindIsCountedApart(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		for range 3 * Burst {
			b.logger.Error("request failed")
			b.logger.Warn("request failed")
			b.logger.Error("maintenance job failed", "job", "rescuer")
		}
		time.Sleep(Window)
		synctest.Wait()
		written := decoded(t, b.out)
		var errors, warnings int
		for _, m := range written {
			if m["msg"] == "request failed" && m["level"] == "ERROR" {
				errors++
			}
			if m["msg"] == "request failed" && m["level"] == "WARN" {
				warnings++
			}
		}
		require.Equal(t, Burst+1, errors)
		require.Equal(t, Burst+1, warnings)
		n, suppressed := count(t, written, "maintenance job failed")
		require.Equal(t, Burst+1, n)
		require.Equal(t, []float64{2 * Burst}, suppressed)
	})
}

func TestInfoAndEachAreAllWritten(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		each := Each(context.Background())
		for range 5 * Burst {
			b.logger.Info("request")
			b.logger.ErrorContext(each, "its usage may be missing")
		}
		written := decoded(t, b.out)
		n, _ := count(t, written, "request")
		require.Equal(t, 5*Burst, n)
		n, _ = count(t, written, "its usage may be missing")
		require.Equal(t, 5*Burst, n)
		time.Sleep(Window)
		synctest.Wait()
		require.Len(t, decoded(t, b.out), 10*Burst, "nothing was left out to count")
	})
}

func TestAWindowEndsAndTheNextBegins(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		for range 2 * Burst {
			b.logger.Error("request failed")
		}
		// A record after the window's end, before its count is written by
		// the timer, writes the count first and begins a new window.
		time.Sleep(Window)
		b.logger.Error("request failed", "window", 2)
		synctest.Wait()
		written := decoded(t, b.out)
		n, suppressed := count(t, written, "request failed")
		require.Equal(t, Burst+2, n)
		require.Equal(t, []float64{Burst}, suppressed)
		require.InDelta(t, 2, written[len(written)-1]["window"], 0, "the count is written before the new window's first line")

		// Quiet for a window: the next flood gets its burst again.
		time.Sleep(2 * Window)
		for range 2 * Burst {
			b.logger.Error("request failed")
		}
		n, _ = count(t, decoded(t, b.out), "request failed")
		require.Equal(t, 2*Burst+2, n, "a new flood gets its burst again")
	})
}

func TestFlushWritesTheOpenWindowsCounts(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		for range Burst + 3 {
			b.logger.Warn("upstream usage clamped")
		}
		b.handler.Flush()
		n, suppressed := count(t, decoded(t, b.out), "upstream usage clamped")
		require.Equal(t, Burst+1, n)
		require.Equal(t, []float64{3}, suppressed)
		time.Sleep(Window)
		synctest.Wait()
		n, _ = count(t, decoded(t, b.out), "upstream usage clamped")
		require.Equal(t, Burst+1, n, "a count flushed is not written again")
	})
}

func TestDerivedLoggersShareTheirCounts(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := setup()
		a, c := b.logger.With("component", "a"), b.logger.With("component", "c")
		for range Burst {
			a.Error("request failed")
			c.Error("request failed")
		}
		time.Sleep(Window)
		synctest.Wait()
		written := decoded(t, b.out)
		n, suppressed := count(t, written, "request failed")
		require.Equal(t, Burst+1, n)
		require.Equal(t, []float64{Burst}, suppressed)
		last := written[len(written)-1]
		require.Equal(t, "c", last["component"], "the count is written through the logger of its record")
	})
}
