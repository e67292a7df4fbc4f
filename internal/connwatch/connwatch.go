// Package connwatch reads the first byte sent on connections that nobody
// else reads for a while (a stream being written on them), or notices their
// end. On Linux one epoll instance, read through the runtime's poller,
// watches all of them: a watched connection costs no goroutine until its peer
// sends or goes away. Elsewhere, and for a connection without a file
// descriptor, a goroutine blocked in a one-byte read watches each.
package connwatch

import (
	"net"
	"time"
)

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
