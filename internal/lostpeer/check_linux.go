package lostpeer

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Check reports whether c's socket is set up as the package says: an error
// names what is not.
func Check(c net.Conn) error {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return fmt.Errorf("lostpeer: a %T has no socket", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return fmt.Errorf("error reaching the socket: %w", err)
	}
	var got struct {
		keepAlive   net.KeepAliveConfig
		userTimeout time.Duration
	}
	var errs []error
	get := func(fd uintptr, level, opt int) int {
		v, err := unix.GetsockoptInt(int(fd), level, opt)
		errs = append(errs, err)
		return v
	}
	err = raw.Control(func(fd uintptr) {
		got.keepAlive.Enable = get(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE) != 0
		got.keepAlive.Idle = time.Duration(get(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)) * time.Second
		got.keepAlive.Interval = time.Duration(get(fd, unix.IPPROTO_TCP, unix.TCP_KEEPINTVL)) * time.Second
		got.keepAlive.Count = get(fd, unix.IPPROTO_TCP, unix.TCP_KEEPCNT)
		got.userTimeout = time.Duration(get(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)) * time.Millisecond
	})
	if err = errors.Join(append(errs, err)...); err != nil {
		return fmt.Errorf("error reading the socket's options: %w", err)
	}
	if got.keepAlive != KeepAlive || got.userTimeout != UserTimeout {
		return fmt.Errorf("lostpeer: the socket has keep-alive %+v and user timeout %s, not %+v and %s", got.keepAlive, got.userTimeout, KeepAlive, UserTimeout)
	}
	return nil
}
