package lostpeer_test

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/blackhole"
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

// TestABriefPartitionLosesNothing drops every packet to a client for 5 s
// while a reply is sent to it, then delivers again: the reply arrives (the
// kernel sends again what was lost) and the connection lives on, its bounds
// (25 s) untouched by a partition shorter than they are.
func TestABriefPartitionLosesNothing(t *testing.T) {
	t.Parallel()
	hole := blackhole.New(t)
	l, err := lostpeer.Listen(context.Background(), "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	client, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(hole.Addr())}}).Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() })
	server, err := l.Accept()
	require.NoError(t, err)
	t.Cleanup(func() { _ = server.Close() })

	hole.Drop()
	_, err = server.Write([]byte("the reply"))
	require.NoError(t, err)
	time.Sleep(5 * time.Second)
	hole.Restore()
	got := make([]byte, len("the reply"))
	_, err = io.ReadFull(client, got)
	require.NoError(t, err)
	require.Equal(t, "the reply", string(got))
	_, err = client.Write([]byte("!"))
	require.NoError(t, err)
	_, err = io.ReadFull(server, got[:1])
	require.NoError(t, err, "the connection lives on")
}

// TestUnixSocketsAreLeftAsTheyAre: the dialer reaches a Unix socket (a
// database's, say) as a plain one does; TCP's settings are not for it.
func TestUnixSocketsAreLeftAsTheyAre(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	c, err := lostpeer.Dialer(time.Second).Dial("unix", l.Addr().String())
	require.NoError(t, err)
	require.NoError(t, c.Close())
}
