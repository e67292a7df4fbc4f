package sockopt

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
)

// KeepAlive returns the TCP keep-alive of c's socket.
func KeepAlive(c net.Conn) (net.KeepAliveConfig, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return net.KeepAliveConfig{}, fmt.Errorf("sockopt: a %T has no socket", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return net.KeepAliveConfig{}, fmt.Errorf("error reaching the socket: %w", err)
	}
	var cfg net.KeepAliveConfig
	var errs []error
	get := func(fd uintptr, level, opt int) int {
		v, err := syscall.GetsockoptInt(int(fd), level, opt)
		errs = append(errs, err)
		return v
	}
	err = raw.Control(func(fd uintptr) {
		cfg.Enable = get(fd, syscall.SOL_SOCKET, syscall.SO_KEEPALIVE) != 0
		cfg.Idle = time.Duration(get(fd, syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)) * time.Second
		cfg.Interval = time.Duration(get(fd, syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL)) * time.Second
		cfg.Count = get(fd, syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT)
	})
	if err = errors.Join(append(errs, err)...); err != nil {
		return net.KeepAliveConfig{}, fmt.Errorf("error reading the keep-alive: %w", err)
	}
	return cfg, nil
}
