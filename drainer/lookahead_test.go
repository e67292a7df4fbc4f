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

	t.Run("ItemsFasterThanClaims", func(t *testing.T) {
		t.Parallel()
		var l lookahead
		l.observeClaim(4 * time.Millisecond)
		l.observeItem(time.Millisecond)
		require.Equal(t, 32, l.items(32), "at most one more per worker")
	})

	t.Run("ItemsAsLongAsTwoClaims", func(t *testing.T) {
		t.Parallel()
		var l lookahead
		l.observeClaim(4 * time.Millisecond)
		l.observeItem(8 * time.Millisecond)
		require.Equal(t, 16, l.items(32), "what the workers finish during one claim")
	})

	t.Run("SlowItems", func(t *testing.T) {
		t.Parallel()
		var l lookahead
		l.observeClaim(4 * time.Millisecond)
		l.observeItem(5 * time.Second)
		require.Zero(t, l.items(32), "not one finished during a claim")
	})

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
