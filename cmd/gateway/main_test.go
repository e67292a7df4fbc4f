package main

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/logsample"
)

// stalledOutput is a standard error whose reader stopped reading until
// opened.
type stalledOutput struct {
	open chan struct{}
	mu   sync.Mutex
	b    strings.Builder
}

func (s *stalledOutput) Write(p []byte) (int, error) {
	<-s.open
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// TestAServingReplicasErrorsOutlastAStalledLog: while a serving replica's
// standard error blocks, its access lines are dropped past the buffer's
// limit, but an error naming a request whose usage may be missing is kept,
// and goes out once the reader reads again.
func TestAServingReplicasErrorsOutlastAStalledLog(t *testing.T) {
	t.Parallel()
	out := &stalledOutput{open: make(chan struct{})}
	logs, buf := serveLogging(out)
	logger := slog.New(logs)
	// Access lines fill the buffer's limit, then short lines its last bytes:
	// no line of an error's length would fit.
	padding := strings.Repeat("x", 400) // an access line's size
	for i := 0; buf.Dropped() == 0; i++ {
		require.Less(t, i, 1_000_000, "no line was ever dropped")
		logger.Info("request", "route", "/api/v1/responses", "n", i, "padding", padding)
	}
	for buf.Dropped() == 1 {
		logger.Info("short")
	}
	logger.ErrorContext(logsample.Each(context.Background()), "a settlement sent with its usage could not be stored; its usage may be missing", "request_id", "r-1", "total_rungs", 42)
	logger.Info("short", "after", "the error")
	require.EqualValues(t, 3, buf.Dropped(), "the short line after the error was dropped")

	close(out.open)
	logs.Flush()
	require.NoError(t, buf.Close(time.Minute))
	got := out.b.String()
	require.Contains(t, got, `"request_id":"r-1","total_rungs":42`, "the error outlasted the stall")
	require.NotContains(t, got, `"after":"the error"`)
}
