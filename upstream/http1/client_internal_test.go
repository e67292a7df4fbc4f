package http1

import (
	"bufio"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestNewFillsItsDefaults: what the configuration leaves zero takes its
// default; what it sets is kept, and used.
func TestNewFillsItsDefaults(t *testing.T) {
	t.Parallel()
	c := New(Config{})
	require.Equal(t, Config{DialTimeout: 5 * time.Second, MaxIdlePerHost: 512, IdleTimeout: 4 * time.Second, MaxHeaderBytes: 1 << 20, BufferSize: 1 << 10}, c.cfg)
	require.Equal(t, 5*time.Second, c.dialer.Timeout)
	set := Config{DialTimeout: time.Second, MaxIdlePerHost: 2, IdleTimeout: time.Minute, MaxHeaderBytes: 100, BufferSize: 64}
	c = New(set)
	require.Equal(t, set, c.cfg)
	require.Equal(t, time.Second, c.dialer.Timeout)
	require.Equal(t, 64, c.readers.Get().(*bufio.Reader).Size())
}

// TestTheSweepStopsWithTheLastIdleConnection: once the sweep has closed the
// last idle connection, it is not scheduled again: a client with no idle
// connection runs no timer.
func TestTheSweepStopsWithTheLastIdleConnection(t *testing.T) {
	t.Parallel()
	c := New(Config{})
	nc, peer := net.Pipe()
	t.Cleanup(func() { _ = peer.Close() })
	c.put("upstream:80", &conn{nc: nc, readers: &c.readers, headLeft: -1}, time.Millisecond)
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.idle) == 0 && !c.reaping
	}, 5*time.Second, time.Millisecond)
}
