// Package inflight lets the callers that need what one call in flight brings
// wait for it and share its failure. A lease asked of a database that does
// not answer fails once for all who wait on it, instead of once for each in
// turn, each waiting for the failures of those before it.
package inflight

import (
	"context"
	"iter"
	"sync"
)

// Call is one call in flight. Start it, publish it where others find it
// (under their lock), and End it once, with its outcome.
type Call struct {
	done chan struct{}
	err  error
}

// Start returns a call in flight.
func Start() *Call {
	return &Call{done: make(chan struct{})}
}

// End ends c with err, the outcome its waiters share.
func (c *Call) End(err error) {
	c.err = err
	close(c.done)
}

// Wait waits until c ends, and returns its error, or until ctx ends, and
// returns ctx's.
func (c *Call) Wait(ctx context.Context) error {
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Await waits until the calls in flight of holders have ended, or ctx has:
// call reads a holder's call (nil when none), with mu held while they are
// read; those started after are not waited for.
func Await[T any](ctx context.Context, mu sync.Locker, holders iter.Seq[T], call func(T) *Call) {
	mu.Lock()
	var calls []*Call
	for h := range holders {
		if c := call(h); c != nil {
			calls = append(calls, c)
		}
	}
	mu.Unlock()
	for _, c := range calls {
		_ = c.Wait(ctx) // the outcome is its callers'
	}
}
