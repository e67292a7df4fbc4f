package maintenance

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestSpacedBoundsTheShareOfTime: a job that takes 20 ms, spaced by 10, runs
// at most once per 200 ms however often its turn comes; the skipped turns do
// nothing.
func TestSpacedBoundsTheShareOfTime(t *testing.T) {
	t.Parallel()
	runs := 0
	job := spaced(10, func(context.Context) (int64, error) {
		runs++
		time.Sleep(20 * time.Millisecond)
		return 1, nil
	})
	start := time.Now()
	var rows int64
	for time.Since(start) < 500*time.Millisecond {
		n, err := job(context.Background())
		require.NoError(t, err)
		rows += n
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	require.GreaterOrEqual(t, runs, 2, "it still runs")
	require.LessOrEqual(t, runs, 1+int(elapsed/(200*time.Millisecond)), "once per 200 ms at most")
	require.Equal(t, int64(runs), rows, "a skipped turn reports nothing done")
}

// TestSpacedRetriesAFailure: a failed run does not space the next one.
func TestSpacedRetriesAFailure(t *testing.T) {
	t.Parallel()
	runs := 0
	job := spaced(1000, func(context.Context) (int64, error) {
		runs++
		time.Sleep(10 * time.Millisecond)
		return 0, errors.New("database away")
	})
	for range 3 {
		_, err := job(context.Background())
		require.Error(t, err)
	}
	require.Equal(t, 3, runs, "every turn runs while the job fails")
}
