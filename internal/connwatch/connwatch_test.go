package connwatch

import (
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/testcert"
)

// result is what a watch's read returned.
type result struct {
	n   int
	b   byte
	err error
}

// pair is a TCP connection's two ends: the one watched and its peer.
func pair(t *testing.T) (watched, peer net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	peer, err = net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	watched, err = ln.Accept()
	require.NoError(t, err)
	t.Cleanup(func() {
		peer.Close()
		watched.Close()
	})
	return watched, peer
}

// eachWatcher runs test, in parallel, with each way a connection is watched:
// Watch (the poller, on Linux) and a goroutine each.
func eachWatcher(t *testing.T, test func(t *testing.T, watch func(net.Conn, Done) func())) {
	t.Parallel()
	for name, watch := range map[string]func(net.Conn, Done) func(){"Watch": Watch, "Goroutine": watchByGoroutine} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, watch)
		})
	}
}

// record sends what a watch read to results.
func record(results chan<- result) Done {
	return func(n int, b byte, err error) { results <- result{n, b, err} }
}

func TestWatchReadsTheFirstByte(t *testing.T) {
	eachWatcher(t, func(t *testing.T, watch func(net.Conn, Done) func()) {
		c, peer := pair(t)
		results := make(chan result, 1)
		stop := watch(c, record(results))
		_, err := peer.Write([]byte("GET"))
		require.NoError(t, err)
		got := <-results
		require.Equal(t, result{n: 1, b: 'G'}, got)
		stop()
		// The rest is the caller's to read.
		rest := make([]byte, 2)
		_, err = io.ReadFull(c, rest)
		require.NoError(t, err)
		require.Equal(t, "ET", string(rest))
	})
}

func TestWatchSeesThePeerGo(t *testing.T) {
	eachWatcher(t, func(t *testing.T, watch func(net.Conn, Done) func()) {
		c, peer := pair(t)
		results := make(chan result, 1)
		stop := watch(c, record(results))
		require.NoError(t, peer.Close())
		got := <-results
		require.Zero(t, got.n)
		require.ErrorIs(t, got.err, io.EOF)
		stop()
	})
}

// TestStopBeforeAnything: a watch stopped before the peer sends reads
// nothing; the connection can be read, and watched again.
func TestStopBeforeAnything(t *testing.T) {
	eachWatcher(t, func(t *testing.T, watch func(net.Conn, Done) func()) {
		c, peer := pair(t)
		results := make(chan result, 2)
		stop := watch(c, record(results))
		time.Sleep(10 * time.Millisecond)
		stop()
		select {
		case r := <-results:
			// A goroutine's read cut by stop tells so.
			require.Zero(t, r.n)
			require.Error(t, r.err)
		default:
		}
		_, err := peer.Write([]byte("x"))
		require.NoError(t, err)
		b := make([]byte, 1)
		_, err = io.ReadFull(c, b)
		require.NoError(t, err, "the read deadline is unset")
		require.Equal(t, "x", string(b))

		stop = watch(c, record(results))
		_, err = peer.Write([]byte("y"))
		require.NoError(t, err)
		require.Equal(t, result{n: 1, b: 'y'}, <-results)
		stop()
	})
}

// TestStopAfterClose: a connection closed while watched (a server cutting
// its streams) still stops, having read nothing.
func TestStopAfterClose(t *testing.T) {
	eachWatcher(t, func(t *testing.T, watch func(net.Conn, Done) func()) {
		c, _ := pair(t)
		results := make(chan result, 1)
		stop := watch(c, record(results))
		require.NoError(t, c.Close())
		stop()
		select {
		case r := <-results:
			require.Zero(t, r.n)
			require.ErrorIs(t, r.err, net.ErrClosed)
		default:
		}
	})
}

// TestWatchWithoutDescriptor: a connection without a file descriptor is
// watched by a goroutine.
func TestWatchWithoutDescriptor(t *testing.T) {
	t.Parallel()
	c, peer := net.Pipe()
	defer c.Close()
	defer peer.Close()
	results := make(chan result, 1)
	stop := Watch(c, record(results))
	go func() { _, _ = peer.Write([]byte("z")) }()
	require.Equal(t, result{n: 1, b: 'z'}, <-results)
	stop()
}

// TestWatchedConnectionsCostNoGoroutine: on Linux, connections waiting in
// the poller hold no goroutine; those whose peer sends are read, the others
// stay watched.
func TestWatchedConnectionsCostNoGoroutine(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the poller is epoll's")
	}
	// Not parallel: it counts the process's goroutines.
	const n = 200
	conns, peers := make([]net.Conn, n), make([]net.Conn, n)
	for i := range n {
		conns[i], peers[i] = pair(t)
	}
	// The poller's own goroutine starts with the first watch.
	Watch(conns[0], func(int, byte, error) {})()
	before := runtime.NumGoroutine()
	results := make(chan result, n)
	stops := make([]func(), n)
	for i, c := range conns {
		stops[i] = Watch(c, record(results))
	}
	require.LessOrEqual(t, runtime.NumGoroutine(), before, "no goroutine a watched connection")
	for i := 0; i < n; i += 2 {
		_, err := peers[i].Write([]byte{byte(i)})
		require.NoError(t, err)
	}
	got, want := map[byte]bool{}, map[byte]bool{}
	for i := 0; i < n; i += 2 {
		r := <-results
		require.Equal(t, 1, r.n)
		got[r.b], want[byte(i)] = true, true
	}
	require.Equal(t, want, got, "each connection whose peer sent was read once")
	for _, stop := range stops {
		stop()
	}
	select {
	case r := <-results:
		t.Fatalf("a connection whose peer sent nothing was read: %+v", r)
	default:
	}
}

// tlsPair is pair's two ends over TLS, the handshake done.
func tlsPair(t *testing.T) (watched, peer *tls.Conn) {
	t.Helper()
	c, p := pair(t)
	issued := testcert.NewAuthority(t, "connwatch test").Issue(t, "localhost", net.IPv4(127, 0, 0, 1))
	cert, err := tls.X509KeyPair(issued.Cert, issued.Key)
	require.NoError(t, err)
	watched = tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
	peer = tls.Client(p, &tls.Config{InsecureSkipVerify: true}) // the test's own certificate
	handshake := make(chan error, 1)
	go func() { handshake <- peer.Handshake() }()
	require.NoError(t, watched.Handshake())
	require.NoError(t, <-handshake)
	return watched, peer
}

// TestATLSConnectionWaitsInThePoller: on Linux, a TLS connection is watched
// through its descriptor (no goroutine while its peer is silent), and what
// its peer sends is read through TLS: the first byte of what it wrote, or
// its end.
func TestATLSConnectionWaitsInThePoller(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the poller is epoll's")
	}
	// Not parallel: it counts the process's goroutines.
	first, firstPeer := tlsPair(t)
	second, secondPeer := tlsPair(t)
	Watch(first, func(int, byte, error) {})() // the poller's own goroutine starts with the first watch
	before := runtime.NumGoroutine()
	results := make(chan result, 2)
	stopFirst, stopSecond := Watch(first, record(results)), Watch(second, record(results))
	require.LessOrEqual(t, runtime.NumGoroutine(), before, "no goroutine a watched connection")

	_, err := firstPeer.Write([]byte("GET"))
	require.NoError(t, err)
	require.Equal(t, result{n: 1, b: 'G'}, <-results, "the plaintext's first byte")
	stopFirst()
	require.NoError(t, secondPeer.Close())
	r := <-results
	require.Zero(t, r.n)
	require.ErrorIs(t, r.err, io.EOF, "the peer's end")
	stopSecond()
}
