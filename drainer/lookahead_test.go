package drainer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLookahead(t *testing.T) {
	t.Parallel()

	t.Run("NothingTimedYet", func(t *testing.T) {
		t.Parallel()
		var l lookahead
		require.Zero(t, l.items(32))
		l.observeClaim(4 * time.Millisecond)
		require.Zero(t, l.items(32), "no item timed")
	})

	for _, tc := range []struct {
		name        string
		claim, item time.Duration
		want        int
	}{
		{"ItemsFasterThanClaims", 4 * time.Millisecond, time.Millisecond, 32},      // at most one more per worker
		{"ItemsAsLongAsTwoClaims", 4 * time.Millisecond, 8 * time.Millisecond, 16}, // what the workers finish during one claim
		{"SlowItems", 4 * time.Millisecond, 5 * time.Second, 0},                    // not one finished during a claim
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var l lookahead
			l.observeClaim(tc.claim)
			l.observeItem(tc.item)
			require.Equal(t, tc.want, l.items(32))
		})
	}

	t.Run("MovingAverages", func(t *testing.T) {
		t.Parallel()
		var l lookahead
		l.observeClaim(4 * time.Millisecond)
		l.observeItem(5 * time.Second)
		for range 100 {
			l.observeItem(time.Millisecond)
		}
		require.Equal(t, 32, l.items(32), "items became fast")
		for range 100 {
			l.observeItem(10 * time.Second)
		}
		require.Zero(t, l.items(32), "and slow again")
	})
}
