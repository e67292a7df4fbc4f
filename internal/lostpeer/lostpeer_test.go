package lostpeer_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/lostpeer"
)

// TestConnectionsAreSetUp checks both ends: a connection dialled and one
// accepted (which takes the listener's TCP_USER_TIMEOUT); a connection of a
// plain dialer fails the check.
func TestConnectionsAreSetUp(t *testing.T) {
	t.Parallel()
	l, err := lostpeer.Listen(context.Background(), "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	accepted := make(chan net.Conn, 2)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
			accepted <- c
		}
	}()
	dialled, err := lostpeer.Dialer(time.Second).Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = dialled.Close() })
	if err := lostpeer.Check(dialled); errors.Is(err, errors.ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, lostpeer.Check(dialled))
	require.NoError(t, lostpeer.Check(<-accepted))

	plain, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = plain.Close() })
	require.ErrorContains(t, lostpeer.Check(plain), "not {Enable:true Idle:10s Interval:5s Count:3} and 25s")
}
