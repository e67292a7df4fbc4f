package logsplit

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRecordsGoByTheirLevel(t *testing.T) {
	t.Parallel()
	var low, high bytes.Buffer
	logger := slog.New(New(slog.LevelError,
		slog.NewTextHandler(&low, &slog.HandlerOptions{Level: slog.LevelInfo}),
		slog.NewTextHandler(&high, nil)))

	logger.Debug("below the low handler's level")
	logger.Info("served")
	logger.Warn("slow")
	logger.Error("lost")
	logger.Log(context.Background(), slog.LevelError+4, "above error")

	require.NotContains(t, low.String(), "below the low handler's level", "each handler's own level holds")
	require.Contains(t, low.String(), "msg=served")
	require.Contains(t, low.String(), "msg=slow")
	require.NotContains(t, low.String(), "lost")
	require.Contains(t, high.String(), "msg=lost")
	require.Contains(t, high.String(), `msg="above error"`)
	require.NotContains(t, high.String(), "served")
	require.NotContains(t, high.String(), "slow")

	require.False(t, logger.Enabled(context.Background(), slog.LevelDebug))
	require.True(t, logger.Enabled(context.Background(), slog.LevelError))
}

func TestAttrsAndGroupsReachBothHandlers(t *testing.T) {
	t.Parallel()
	var low, high bytes.Buffer
	logger := slog.New(New(slog.LevelError, slog.NewTextHandler(&low, nil), slog.NewTextHandler(&high, nil))).
		With("replica", "a").WithGroup("req").With("id", 7)

	logger.Info("served", "status", 200)
	logger.Error("lost", "rungs", 9)

	require.Contains(t, low.String(), "replica=a req.id=7 req.status=200")
	require.Contains(t, high.String(), "replica=a req.id=7 req.rungs=9")
}
