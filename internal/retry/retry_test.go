package retry

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var (
	errAway    = errors.New("away")
	errRefused = errors.New("refused")
)

func passing(err error) bool { return errors.Is(err, errAway) }

// calls returns fn failing with errs in turn, then succeeding, and the count
// of its calls.
func calls(errs ...error) (func(context.Context) error, *int) {
	n := 0
	return func(context.Context) error {
		n++
		if n <= len(errs) {
			return errs[n-1]
		}
		return nil
	}, &n
}

func TestUntilSucceedsAfterPassingFailures(t *testing.T) {
	t.Parallel()
	fn, n := calls(errAway, errAway)
	require.NoError(t, Until(context.Background(), time.Minute, time.Millisecond, passing, fn))
	require.Equal(t, 3, *n)
}

func TestUntilStopsAtAnotherFailure(t *testing.T) {
	t.Parallel()
	fn, n := calls(errAway, errRefused, errAway)
	require.ErrorIs(t, Until(context.Background(), time.Minute, time.Millisecond, passing, fn), errRefused)
	require.Equal(t, 2, *n)
}

func TestUntilStopsWhenTheWindowWouldPass(t *testing.T) {
	t.Parallel()
	fn, n := calls(errAway, errAway, errAway)
	require.ErrorIs(t, Until(context.Background(), 50*time.Millisecond, time.Second, passing, fn), errAway)
	require.Equal(t, 1, *n, "the first wait, 100 ms, passes the window")
}

func TestUntilStopsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	err := Until(ctx, time.Minute, time.Second, passing, func(context.Context) error {
		n++
		cancel()
		return errAway
	})
	require.ErrorIs(t, err, errAway)
	require.Equal(t, 1, n)
}

// TestUntilTellingTellsEachWaitAndNotTheEnd: each wait is told, with its
// length; the failure that ends the window, which no wait follows, is not.
func TestUntilTellingTellsEachWaitAndNotTheEnd(t *testing.T) {
	t.Parallel()
	var tries int
	var waits []time.Duration
	err := UntilTelling(context.Background(), time.Second, time.Minute, passing, func(err error, wait time.Duration) {
		require.ErrorIs(t, err, errAway)
		waits = append(waits, wait)
	}, func(context.Context) error {
		tries++
		return errAway
	})
	require.ErrorIs(t, err, errAway)
	require.GreaterOrEqual(t, tries, 2, "the first wait, 100 ms, is within the window")
	require.Len(t, waits, tries-1, "the last failure, after which no wait follows, is not told")
	for i, wait := range waits {
		require.Equal(t, firstWait<<i, wait, "the waits told are the waits made")
	}
}

// TestUntilTellingTellsNothingOfAnotherFailure: a failure that is not
// passing ends the calls untold.
func TestUntilTellingTellsNothingOfAnotherFailure(t *testing.T) {
	t.Parallel()
	fn, n := calls(errAway, errRefused)
	told := 0
	err := UntilTelling(context.Background(), time.Minute, time.Millisecond, passing, func(error, time.Duration) { told++ }, fn)
	require.ErrorIs(t, err, errRefused)
	require.Equal(t, 2, *n)
	require.Equal(t, 1, told, "the away failure before it, tried again")
}

// TestCountedCountsTheCallsAfterTheFirst: each call tried again is counted,
// and the first, which is no retry, is not.
func TestCountedCountsTheCallsAfterTheFirst(t *testing.T) {
	t.Parallel()
	fn, n := calls(errAway, errAway)
	retries := 0
	require.NoError(t, Until(context.Background(), time.Minute, time.Millisecond, passing, Counted(func() { retries++ }, fn)))
	require.Equal(t, 3, *n)
	require.Equal(t, 2, retries)

	fn, n = calls()
	require.NoError(t, Until(context.Background(), time.Minute, time.Millisecond, passing, Counted(nil, fn)))
	require.Equal(t, 1, *n, "no count asked for: fn runs alone")
}
