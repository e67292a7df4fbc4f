package http1

import (
	"bufio"
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
