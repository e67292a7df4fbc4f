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

// lane is one account's places: a slot in the channel is a place held. Its
// channel's queue of blocked senders keeps waiters in order.
type lane struct {
	places chan struct{}
	// users counts holders and waiters; the lane is dropped when it is 0.
	users int
}

// New returns a gate of places places per account (at least 1).
func New(places int) *Gate {
	return &Gate{places: max(places, 1), lanes: map[uuid.UUID]*lane{}}
}

// Places is the number of places per account.
func (g *Gate) Places() int { return g.places }

// Enter takes one of account's places: a free one, even when ctx has ended,
// or else the first to come free, unless ctx ends first, which it then returns
// the cause of. The returned leave frees the place; calling it again does
// nothing.
func (g *Gate) Enter(ctx context.Context, account uuid.UUID) (leave func(), err error) {
	l := g.join(account)
	select {
	case l.places <- struct{}{}:
	default:
		select {
		case l.places <- struct{}{}:
		case <-ctx.Done():
			g.quit(account, l)
			return nil, context.Cause(ctx)
		}
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			<-l.places
			g.quit(account, l)
		})
	}, nil
}

// join counts a user into account's lane, making the lane when it has none.
func (g *Gate) join(account uuid.UUID) *lane {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.lanes[account]
	if !ok {
		l = &lane{places: make(chan struct{}, g.places)}
		g.lanes[account] = l
	}
	l.users++
	return l
}

// quit counts a user out of account's lane, dropping the lane with its last.
func (g *Gate) quit(account uuid.UUID, l *lane) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l.users--; l.users == 0 {
		delete(g.lanes, account)
	}
}
