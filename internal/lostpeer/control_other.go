//go:build !linux

package lostpeer

import "syscall"

// control leaves the socket as it is: TCP_USER_TIMEOUT is Linux's.
func control(_, _ string, _ syscall.RawConn) error { return nil }
