//go:build unix

package http1

import (
	"errors"
	"net"
	"syscall"
)

// peerSilent reports whether nothing can be read from an idle connection
// without waiting: a closed connection reads its end (or a reset), and an
// upstream that sent bytes nobody asked for is not to be trusted with the
// next call. One non-blocking read; a byte it takes belongs to a connection
// that is discarded anyway.
func peerSilent(nc net.Conn) bool {
	silent := false
	raw, err := readRaw(nc, func(fd uintptr) bool {
		var b [1]byte
		_, rerr := syscall.Read(int(fd), b[:])
		silent = wouldBlock(rerr)
		return true
	})
	return !raw || err == nil && silent
}

// waitReadable waits, without a buffer, until the upstream has sent something
// (or closed the connection, or the connection's deadline passed): a call
// waiting minutes for a stream's first token holds no read buffer.
func waitReadable(nc net.Conn) error {
	_, err := readRaw(nc, func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK)
		return !wouldBlock(rerr)
	})
	return err
}

// readRaw runs f on nc's descriptor as syscall.RawConn.Read does: again each
// time the poller says it is readable, until f returns true. raw is false for
// a connection without a descriptor, which f is not run on.
func readRaw(nc net.Conn, f func(fd uintptr) bool) (raw bool, err error) {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false, nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true, err
	}
	return true, rc.Read(f)
}

func wouldBlock(err error) bool {
	return errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EWOULDBLOCK)
}
