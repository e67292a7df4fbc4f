package drainer

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// TestAccountWaits: an account is held until the latest time it was given
// (an earlier one does not shorten its hold), and forgotten once that
// passes.
func TestAccountWaits(t *testing.T) {
	t.Parallel()
	var w accountWaits
	require.Nil(t, w.active(time.Now()))
	long, short := uuid.New(), uuid.New()
	now := time.Now()
	w.add(long, now.Add(10*time.Second))
	w.add(long, now.Add(time.Second))
	w.add(short, now.Add(time.Second))
	require.ElementsMatch(t, []uuid.UUID{long, short}, w.active(now))
	require.Equal(t, []uuid.UUID{long}, w.active(now.Add(5*time.Second)))
	require.Len(t, w.until, 1, "the hold that ended is forgotten")
	require.Nil(t, w.active(now.Add(10*time.Second)))
	require.Empty(t, w.until)
}
