package drainer

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// TestStoppedBatches: a stopped batch is remembered while items of it are
// held, or for a claim's time after it was heard of (its items may still be
// on their way from a claim); then the next word forgets it.
func TestStoppedBatches(t *testing.T) {
	t.Parallel()
	var s stoppedBatches
	held, recent, gone := uuid.New(), uuid.New(), uuid.New()
	start := time.Now()
	s.add(held, start, nil)
	s.add(gone, start, nil)
	s.add(recent, start.Add(claimTimeout), map[uuid.UUID]bool{held: true})
	require.True(t, s.has(held))
	require.True(t, s.has(gone), "heard of a claim's time ago at most")

	s.add(uuid.New(), start.Add(claimTimeout+time.Millisecond), map[uuid.UUID]bool{held: true})
	require.True(t, s.has(held), "items of it are held")
	require.True(t, s.has(recent), "heard of within a claim's time")
	require.False(t, s.has(gone))
	require.Len(t, s.ids, 3)
}
