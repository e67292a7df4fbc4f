package server

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestHandedConnWaitsLikeAnIdleConnection: on a connection handed back after
// a stream, the HTTP server's header timeout does not run while the client
// has not begun its next request; it runs from the request's first byte.
func TestHandedConnWaitsLikeAnIdleConnection(t *testing.T) {
	t.Parallel()
	server, client := pipe(t)
	h := handBack(server, nil)
	require.WithinDuration(t, time.Now().Add(IdleTimeout), h.idleUntil, time.Second, "it waits as long as an idle connection")
	const header = 100 * time.Millisecond
	require.NoError(t, h.SetReadDeadline(time.Now().Add(header)), "as net/http does on a new connection")

	go func() {
		time.Sleep(3 * header) // past the header timeout, within the idle one
		_, _ = client.Write([]byte("G"))
	}()
	buf := make([]byte, 8)
	n, err := h.Read(buf)
	require.NoError(t, err, "the idle wait outlasts the header timeout")
	require.Equal(t, "G", string(buf[:n]))

	// From the first byte the header timeout runs: a client that stalls
	// mid-request is cut, long before an idle connection would be.
	requireCut := func(msg string) {
		t.Helper()
		err := doneWithin(t, IdleTimeout/2, msg, func() error {
			_, err := h.Read(buf)
			return err
		})
		require.True(t, errors.Is(err, os.ErrDeadlineExceeded), "got %v", err)
	}
	requireCut("a client stalled mid-request waits as long as an idle one")
	// From then on the deadlines asked for are the connection's own.
	require.NoError(t, h.SetReadDeadline(time.Now()))
	requireCut("a deadline asked for once the request began is not the idle one")
}

// TestHandedConnReturnsTheBytesReadAhead: the next request's bytes read while
// the stream ran come first, then the connection's.
func TestHandedConnReturnsTheBytesReadAhead(t *testing.T) {
	t.Parallel()
	server, client := pipe(t)
	h := handBack(server, []byte("GET"))
	require.False(t, h.idle, "a request has begun")
	require.Same(t, h, handBack(h, nil), "a connection handed back again keeps its wrapper")
	go func() { _, _ = client.Write([]byte(" /healthz")) }()
	got := make([]byte, 12)
	_, err := io.ReadFull(h, got)
	require.NoError(t, err)
	require.Equal(t, "GET /healthz", string(got))
}

// TestHandedConnSetsBothDeadlines: SetDeadline, as net/http calls it when
// it hands a connection over (a second stream detached on it), bounds its
// writes too, not only its reads.
func TestHandedConnSetsBothDeadlines(t *testing.T) {
	t.Parallel()
	server, _ := pipe(t) // nobody reads the client's end: a write waits for its deadline
	h := handBack(server, []byte("G"))
	require.NoError(t, h.SetDeadline(time.Now()))
	err := doneWithin(t, 5*time.Second, "the write waits past its deadline", func() error {
		_, err := h.Write([]byte("HTTP/1.1 200 OK\r\n"))
		return err
	})
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, doneWithin(t, 5*time.Second, "the bytes read ahead wait for no deadline", func() error {
		_, err := io.ReadFull(h, make([]byte, 1))
		return err
	}))
	err = doneWithin(t, 5*time.Second, "the read waits past its deadline", func() error {
		_, err := h.Read(make([]byte, 1))
		return err
	})
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
}

// TestHandedConnCountsTheHeaderTimeoutFromTheFirstByte: the header timeout
// runs from the next request's first byte, not from each: a client that
// sends its head a byte at a time, each within the timeout, is cut once the
// timeout has run from the first.
func TestHandedConnCountsTheHeaderTimeoutFromTheFirstByte(t *testing.T) {
	t.Parallel()
	server, client := pipe(t)
	h := handBack(server, nil)
	const header, bytes = 100 * time.Millisecond, 20
	require.NoError(t, h.SetReadDeadline(time.Now().Add(header)))
	go func() {
		for range bytes { // one each quarter of the timeout: five timeouts in all
			if _, err := client.Write([]byte("G")); err != nil {
				return
			}
			time.Sleep(header / 4)
		}
	}()
	read := 0
	err := doneWithin(t, IdleTimeout/2, "a client dripping its head waits as long as an idle one", func() error {
		buf := make([]byte, 1)
		for {
			n, err := h.Read(buf)
			read += n
			if err != nil {
				return err
			}
		}
	})
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, read, bytes, "cut before the head was all sent")
}

// TestHandedConnWithoutAHeaderTimeoutWaits: with no header timeout asked for
// (a server without one), the next request's head may come in pieces.
func TestHandedConnWithoutAHeaderTimeoutWaits(t *testing.T) {
	t.Parallel()
	server, client := pipe(t)
	h := handBack(server, nil)
	require.NoError(t, h.SetReadDeadline(time.Time{}), "as net/http does with no header timeout")
	go func() {
		for _, piece := range []string{"G", "ET"} {
			if _, err := client.Write([]byte(piece)); err != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	got := make([]byte, 3)
	require.NoError(t, doneWithin(t, 5*time.Second, "the head's pieces are read", func() error {
		_, err := io.ReadFull(h, got)
		return err
	}))
	require.Equal(t, "GET", string(got))
}

// pipe is an in-memory connection's two ends, closed when the test ends.
func pipe(t *testing.T) (server, client net.Conn) {
	t.Helper()
	server, client = net.Pipe()
	t.Cleanup(func() { server.Close(); client.Close() })
	return server, client
}

// doneWithin runs op on a goroutine of its own and returns its error; it
// fails the test, saying msg, if op takes longer than wait.
func doneWithin(t *testing.T, wait time.Duration, msg string, op func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- op() }()
	select {
	case err := <-done:
		return err
	case <-time.After(wait):
		require.Fail(t, msg)
		return nil
	}
}

// TestRelistener: it accepts new connections and those given back; once
// closed, it accepts nothing and closes what is given back, and what it
// accepted that no one took.
func TestRelistener(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &Server{}
	l := s.Listener(ln)

	dialed, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer dialed.Close()
	fresh, err := l.Accept()
	require.NoError(t, err)
	require.Equal(t, dialed.LocalAddr().String(), fresh.RemoteAddr().String())

	back := handBack(fresh, nil)
	go s.relisten.Load().give(back)
	again, err := l.Accept()
	require.NoError(t, err)
	require.Same(t, back, again)

	// A connection accepted that no one took when the listener closes is
	// closed, not left open.
	late, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer late.Close()
	time.Sleep(100 * time.Millisecond) // accepted, and waiting to be taken
	require.NoError(t, l.Close())
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = late.Read(make([]byte, 1))
	// (Reset, had it been still in the listener's backlog.)
	require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET), "a connection accepted as the listener closed is closed: %v", err)
	_, err = l.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
	s.relisten.Load().give(again)
	_ = dialed.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = dialed.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "a connection given back after the close is closed")
}

// TestHandedConnGivesItsDescriptorOnceTheBytesReadAheadAreRead: the watch on
// a detached stream's client may wait on the descriptor only when nothing
// read ahead is pending (it would come first).
func TestHandedConnGivesItsDescriptorOnceTheBytesReadAheadAreRead(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	dialed, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer dialed.Close()
	accepted, err := ln.Accept()
	require.NoError(t, err)
	h := handBack(accepted, []byte("G"))
	defer h.Close()

	_, err = h.SyscallConn()
	require.ErrorIs(t, err, errReadAhead)
	_, err = h.Read(make([]byte, 1))
	require.NoError(t, err)
	rc, err := h.SyscallConn()
	require.NoError(t, err)
	require.NotNil(t, rc)

	inMemory, _ := pipe(t)
	_, err = handBack(inMemory, nil).SyscallConn()
	require.ErrorIs(t, err, errors.ErrUnsupported, "a connection without a descriptor")
}

// TestAChunkedSinkKeepsNoLargeBuffer: a flushed chunk's buffer is kept for
// the next (no allocation an event), unless it grew past 4 KiB: a waiting
// stream holds no large buffer.
func TestAChunkedSinkKeepsNoLargeBuffer(t *testing.T) {
	t.Parallel()
	server, client := pipe(t)
	go func() { _, _ = io.Copy(io.Discard, client) }()
	c := &chunkedSink{conn: server}
	_, err := c.Write([]byte("event: small"))
	require.NoError(t, err)
	require.NoError(t, c.Flush())
	require.Empty(t, c.buf)
	require.NotZero(t, cap(c.buf), "kept for the next chunk")
	_, err = c.Write(make([]byte, 8<<10))
	require.NoError(t, err)
	require.NoError(t, c.Flush())
	require.Nil(t, c.buf, "let go")
}
