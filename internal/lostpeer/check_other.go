//go:build !linux

package lostpeer

import (
	"errors"
	"net"
)

// Check reports whether c's socket is set up as the package says: on Linux
// only (errors.ErrUnsupported elsewhere).
func Check(net.Conn) error { return errors.ErrUnsupported }
