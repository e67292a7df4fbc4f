package proccpu_test

import (
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/proccpu"
)

// TestOfCountsThisProcessesWork: the process's CPU time grows while it works,
// tick by tick.
func TestOfCountsThisProcessesWork(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	before, err := proccpu.Of(os.Getpid())
	require.NoError(t, err)
	used := time.Duration(0)
	for deadline := time.Now().Add(10 * time.Second); used < 30*time.Millisecond && time.Now().Before(deadline); {
		for start := time.Now(); time.Since(start) < time.Millisecond; { // work
		}
		now, err := proccpu.Of(os.Getpid())
		require.NoError(t, err)
		used = now - before
	}
	require.GreaterOrEqual(t, used, 30*time.Millisecond, "the work shows")
	require.Zero(t, used%(10*time.Millisecond), "in clock ticks")

	_, err = proccpu.Of(-1)
	require.Error(t, err)
}
