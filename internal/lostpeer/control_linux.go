package lostpeer

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// control sets UserTimeout on a TCP socket before it connects or listens
// (the connections a listener accepts inherit it); other sockets (Unix) are
// left as they are.
func control(network, _ string, c syscall.RawConn) error {
	if network != "tcp" && network != "tcp4" && network != "tcp6" {
		return nil
	}
	var err error
	if cerr := c.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(UserTimeout.Milliseconds()))
	}); cerr != nil {
		return fmt.Errorf("error reaching the socket: %w", cerr)
	}
	if err != nil {
		return fmt.Errorf("error setting TCP_USER_TIMEOUT: %w", err)
	}
	return nil
}
