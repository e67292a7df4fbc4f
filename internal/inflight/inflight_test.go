package inflight

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWaitersShareTheOutcome(t *testing.T) {
	t.Parallel()
	for _, outcome := range []error{nil, errors.New("database away")} {
		c := Start()
		got := make(chan error, 3)
		for range 3 {
			go func() { got <- c.Wait(context.Background()) }()
		}
		c.End(outcome)
		for range 3 {
			require.Equal(t, outcome, <-got)
		}
		require.Equal(t, outcome, c.Wait(context.Background()), "a call that ended answers at once")
	}
}

func TestAWaiterLeavesWithItsContext(t *testing.T) {
	t.Parallel()
	c := Start()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, c.Wait(ctx), context.Canceled)
	c.End(nil)
	require.NoError(t, c.Wait(context.Background()))
}
