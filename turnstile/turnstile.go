// Package turnstile lets an account's costly requests into a replica a few at
// a time. A batch creation of 100 long prompts takes a core for up to a
// second to decode and price; a key sending them at its rate limit would
// otherwise keep every core of a replica busy and stall every other
// account's requests behind its own. Held to a few places, an account's
// requests take no more than their share of the CPU, and the ones waiting for
// a place cost a parked goroutine each, not a body in memory.
package turnstile

import (
	"context"
	"slices"
	"sync"

	"github.com/google/uuid"
)

// Gate admits, per account, at most a fixed number of holders at once; the
// others wait for a place in the order they came.
type Gate struct {
	places int
	mu     sync.Mutex
	lanes  map[uuid.UUID]*lane
}

// lane is one account's places: held counts the places taken, waiters the
// requests waiting for one, in the order they came (there are some only
// while every place is taken). A place freed goes to the first waiter; the
// lane is dropped when it has neither holders nor waiters.
type lane struct {
	held    int
	waiters []chan struct{}
}

// New returns a gate of places places per account (at least 1).
func New(places int) *Gate {
	return &Gate{places: max(places, 1), lanes: map[uuid.UUID]*lane{}}
}

// Places is the number of places per account.
func (g *Gate) Places() int { return g.places }

// Enter takes one of account's places: a free one, even when ctx has ended,
// or else the first to come free after those of the requests waiting before
// it, unless ctx ends first, which it then returns the cause of (a place
// handed to it as ctx ended goes to the next). The returned leave frees the
// place; calling it again does nothing.
func (g *Gate) Enter(ctx context.Context, account uuid.UUID) (leave func(), err error) {
	g.mu.Lock()
	l := g.lanes[account]
	if l == nil {
		l = &lane{}
		g.lanes[account] = l
	}
	if l.held < g.places {
		l.held++
		g.mu.Unlock()
		return g.leaver(account, l), nil
	}
	turn := make(chan struct{})
	l.waiters = append(l.waiters, turn)
	g.mu.Unlock()

	select {
	case <-turn:
		return g.leaver(account, l), nil
	case <-ctx.Done():
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if i := slices.Index(l.waiters, turn); i >= 0 {
		l.waiters = slices.Delete(l.waiters, i, i+1)
	} else {
		g.freeLocked(account, l) // handed over as ctx ended
	}
	return nil, context.Cause(ctx)
}

// leaver is the leave func of a place of account's lane l.
func (g *Gate) leaver(account uuid.UUID, l *lane) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.freeLocked(account, l)
		})
	}
}

// freeLocked frees one of the places held in account's lane l: it goes to
// the first waiter, if any; the lane goes with its last holder. g.mu is held.
func (g *Gate) freeLocked(account uuid.UUID, l *lane) {
	if len(l.waiters) > 0 {
		close(l.waiters[0])
		l.waiters = slices.Delete(l.waiters, 0, 1)
		return
	}
	if l.held--; l.held == 0 {
		delete(g.lanes, account)
	}
}
