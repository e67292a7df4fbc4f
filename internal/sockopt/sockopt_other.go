//go:build !linux

package sockopt

import (
	"errors"
	"net"
)

// KeepAlive returns the TCP keep-alive of c's socket: on Linux only.
func KeepAlive(net.Conn) (net.KeepAliveConfig, error) {
	return net.KeepAliveConfig{}, errors.ErrUnsupported
}
