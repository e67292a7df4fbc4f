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
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return true
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	silent := false
	err = raw.Read(func(fd uintptr) bool {
		var b [1]byte
		_, rerr := syscall.Read(int(fd), b[:])
		silent = errors.Is(rerr, syscall.EAGAIN) || errors.Is(rerr, syscall.EWOULDBLOCK)
		return true
	})
	return err == nil && silent
}

// waitReadable waits, without a buffer, until the upstream has sent something
// (or closed the connection, or the connection's deadline passed): a call
// waiting minutes for a stream's first token holds no read buffer.
func waitReadable(nc net.Conn) error {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	return raw.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK)
		return !errors.Is(rerr, syscall.EAGAIN) && !errors.Is(rerr, syscall.EWOULDBLOCK)
	})
}
