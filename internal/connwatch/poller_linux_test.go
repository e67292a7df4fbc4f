package connwatch

import (
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPollerThatCannotBeRead: once its instance can no longer be read, a
// poller's pending watches are read by goroutines, and it takes no more
// (Watch then uses goroutines).
func TestPollerThatCannotBeRead(t *testing.T) {
	t.Parallel()
	p, err := newPoller()
	require.NoError(t, err)
	add := func(c net.Conn, done Done) (func(), bool) {
		rc, err := c.(syscall.Conn).SyscallConn()
		require.NoError(t, err)
		return p.add(c, rc, done)
	}
	c, peer := pair(t)
	results := make(chan result, 1)
	stop, ok := add(c, record(results))
	require.True(t, ok)

	require.NoError(t, p.file.Close())
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.dead
	}, 5*time.Second, time.Millisecond)
	_, err = peer.Write([]byte("a"))
	require.NoError(t, err)
	select {
	case r := <-results:
		require.Equal(t, result{n: 1, b: 'a'}, r)
	case <-time.After(5 * time.Second):
		t.Fatal("the pending watch was never read")
	}
	stop()

	other, _ := pair(t)
	_, ok = add(other, record(results))
	require.False(t, ok, "a dead poller takes no more")
}
