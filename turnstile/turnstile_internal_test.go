package turnstile

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

var errWaited = errors.New("waited too long")

// waitBriefly is a context that ends with errWaited: a waiter given it has no
// place to come.
func waitBriefly(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeoutCause(context.Background(), 20*time.Millisecond, errWaited)
	t.Cleanup(cancel)
	return ctx
}

// holdOne returns a gate of one place an account, an account, and the leave
// of the place it holds.
func holdOne(t *testing.T) (*Gate, uuid.UUID, func()) {
	t.Helper()
	g, a := New(1), uuid.New()
	leave, err := g.Enter(context.Background(), a)
	require.NoError(t, err)
	return g, a, leave
}

// users is the number of account's holders and waiters.
func (g *Gate) users(account uuid.UUID) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if l, ok := g.lanes[account]; ok {
		return l.held + len(l.waiters)
	}
	return 0
}

func TestPlacesArePerAccount(t *testing.T) {
	t.Parallel()
	g := New(2)
	a, b := uuid.New(), uuid.New()
	for range 2 {
		_, err := g.Enter(context.Background(), a)
		require.NoError(t, err)
	}
	_, err := g.Enter(waitBriefly(t), a)
	require.ErrorIs(t, err, errWaited, "a third request of a full account must wait")
	leave, err := g.Enter(waitBriefly(t), b)
	require.NoError(t, err, "another account's request must not wait for the full one")
	leave()
	require.Equal(t, 2, g.users(a), "a waiter given up must not stay counted")
	require.Zero(t, g.users(b))
}

func TestWaitersEnterInTheOrderTheyCame(t *testing.T) {
	t.Parallel()
	g, a, leave := holdOne(t)
	entered := make(chan int)
	for i := range 5 {
		go func() {
			leave, err := g.Enter(context.Background(), a)
			if err == nil {
				entered <- i
				leave()
			}
		}()
		// The next waiter comes only once this one waits.
		require.Eventually(t, func() bool { return g.users(a) == i+2 }, 10*time.Second, time.Millisecond)
	}
	leave()
	for i := range 5 {
		require.Equal(t, i, <-entered)
	}
	require.Eventually(t, func() bool { return g.users(a) == 0 }, 10*time.Second, time.Millisecond)
}

func TestLeavingTwiceFreesOnePlace(t *testing.T) {
	t.Parallel()
	g, a, leave := holdOne(t)
	done := make(chan struct{})
	go func() {
		leave()
		leave()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "a second leave blocked")
	}
	_, err := g.Enter(context.Background(), a)
	require.NoError(t, err)
	_, err = g.Enter(waitBriefly(t), a)
	require.ErrorIs(t, err, errWaited, "a second leave must not free a place held by another")
}

func TestAnAccountsLaneGoesWithItsLastUser(t *testing.T) {
	t.Parallel()
	g, a, leave := holdOne(t)
	_, err := g.Enter(waitBriefly(t), a)
	require.ErrorIs(t, err, errWaited)
	leave()
	g.mu.Lock()
	defer g.mu.Unlock()
	require.Empty(t, g.lanes)
}

func TestAFreePlaceIsTakenWhateverTheContext(t *testing.T) {
	t.Parallel()
	g := New(1)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 100 {
		leave, err := g.Enter(ctx, uuid.New())
		require.NoError(t, err)
		leave()
	}
}

func TestAGateHasAPlaceAtLeast(t *testing.T) {
	t.Parallel()
	require.Equal(t, 1, New(0).Places())
	require.Equal(t, 3, New(3).Places())
}

// TestAPlaceIsNeverLostToAWaiterThatGaveUp: a place freed just as its first
// waiter gives up goes to that waiter or to the next, never to no one.
func TestAPlaceIsNeverLostToAWaiterThatGaveUp(t *testing.T) {
	t.Parallel()
	for range 200 {
		g, a, leave := holdOne(t)
		ctx, cancel := context.WithCancel(context.Background())
		first := make(chan func(), 1)
		go func() {
			leave, err := g.Enter(ctx, a)
			if err != nil {
				leave = nil
			}
			first <- leave
		}()
		require.Eventually(t, func() bool { return g.users(a) == 2 }, 10*time.Second, time.Millisecond)
		second := make(chan func(), 1)
		go func() {
			leave, _ := g.Enter(context.Background(), a) // a context that never ends: no error
			second <- leave
		}()
		require.Eventually(t, func() bool { return g.users(a) == 3 }, 10*time.Second, time.Millisecond)
		cancel()
		leave()
		if leaveFirst := <-first; leaveFirst != nil {
			leaveFirst() // it took the place: the second waits for it
		}
		select {
		case leaveSecond := <-second:
			leaveSecond()
		case <-time.After(10 * time.Second):
			require.FailNow(t, "the place was lost: the second waiter never entered")
		}
		require.Zero(t, g.users(a), "every place is back")
	}
}

// TestAPlaceFreedIsOneOfTheAccounts: of two places, one freed lets one more
// request in, not two; one handed to a waiter stays taken.
func TestAPlaceFreedIsOneOfTheAccounts(t *testing.T) {
	t.Parallel()
	t.Run("free", func(t *testing.T) {
		t.Parallel()
		g, a := New(2), uuid.New()
		leave, err := g.Enter(context.Background(), a)
		require.NoError(t, err)
		_, err = g.Enter(context.Background(), a)
		require.NoError(t, err)
		leave()
		_, err = g.Enter(waitBriefly(t), a)
		require.NoError(t, err, "the place freed")
		_, err = g.Enter(waitBriefly(t), a)
		require.ErrorIs(t, err, errWaited, "both places are taken again")
		require.Equal(t, 2, g.users(a))
	})
	t.Run("handed to a waiter", func(t *testing.T) {
		t.Parallel()
		g, a, leave := holdOne(t)
		entered := make(chan struct{})
		go func() {
			_, err := g.Enter(context.Background(), a)
			if err == nil {
				close(entered)
			}
		}()
		require.Eventually(t, func() bool { return g.users(a) == 2 }, 10*time.Second, time.Millisecond)
		leave()
		<-entered
		_, err := g.Enter(waitBriefly(t), a)
		require.ErrorIs(t, err, errWaited, "the waiter holds the place it was handed")
		require.Equal(t, 1, g.users(a))
	})
}
