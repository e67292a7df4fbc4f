package inflight

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
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

func TestAwaitWaitsForTheCallsInFlight(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	calls := []*Call{Start(), nil, Start()}
	var last atomic.Bool
	returned := make(chan bool)
	go func() {
		Await(context.Background(), &mu, slices.Values(calls), func(c *Call) *Call { return c })
		returned <- last.Load()
	}()
	calls[0].End(nil)
	last.Store(true)
	calls[2].End(errors.New("database away"))
	require.True(t, <-returned, "returned once the last call had ended")

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	Await(ctx, &mu, slices.Values([]*Call{Start()}), func(c *Call) *Call { return c }) // returns with ctx
}
