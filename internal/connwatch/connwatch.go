// Package connwatch reads the first byte sent on connections that nobody
// else reads for a while (a stream being written on them), or notices their
// end. On Linux one epoll instance, read through the runtime's poller,
// watches all of them: a watched connection costs no goroutine until its peer
// sends or goes away. Elsewhere, and for a connection without a file
// descriptor, a goroutine blocked in a one-byte read watches each.
package connwatch

import (
	"crypto/tls"
	"net"
	"syscall"
	"time"
)

// Descriptor is what a watch of c waits on: c's own descriptor, or a TLS
// connection's underneath, whose bytes are not c's (the watch waits there
// for something to read, and reads its byte through TLS). What TLS had read
// from the descriptor already, and holds, is found only with the peer's
// next bytes or its end: a client that sent its next request ahead, in the
// record that ended the request before.
func Descriptor(c net.Conn) (syscall.Conn, bool) {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	return sc, ok
}

// Done is called with what the watching read returned: n is 1 and b the
// byte read, or n is 0 and err says why (the peer closed or reset the
// connection, the connection was closed, or stop cut the read).
type Done func(n int, b byte, err error)

// aLongTimeAgo is a deadline that wakes a blocked read at once.
var aLongTimeAgo = time.Unix(1, 0)

// Watch reads one byte from c once there is something to read and calls
// done, on a goroutine of its own, with the result. The returned stop ends
// the watch: once it returns, no read is under way, done has returned or will
// never be called, and c's read deadline is unset. Call stop, once, before c
// is read again or closed.
func Watch(c net.Conn, done Done) (stop func()) {
	if stop, ok := watchByPoller(c, done); ok {
		return stop
	}
	return watchByGoroutine(c, done)
}

// watchByGoroutine watches c with a goroutine blocked in a one-byte read.
func watchByGoroutine(c net.Conn, done Done) (stop func()) {
	read := make(chan struct{})
	readInBackground(c, done, read)
	return func() { cut(c, read) }
}

// readInBackground reads one byte from c on a goroutine of its own, tells
// done, and then closes read.
func readInBackground(c net.Conn, done Done, read chan<- struct{}) {
	go func() {
		defer close(read)
		var b [1]byte
		n, err := c.Read(b[:])
		done(n, b[0], err)
	}()
}

// cut wakes the read on c, waits until read is closed, and unsets c's read
// deadline.
func cut(c net.Conn, read <-chan struct{}) {
	_ = c.SetReadDeadline(aLongTimeAgo)
	<-read
	_ = c.SetReadDeadline(time.Time{})
}
