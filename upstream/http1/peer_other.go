//go:build !unix

package http1

import "net"

// peerSilent cannot look at an idle connection without blocking here; a
// connection the upstream closed fails the call made on it.
func peerSilent(net.Conn) bool { return true }

// waitReadable returns at once here: the read buffer is taken before the
// reply arrives.
func waitReadable(net.Conn) error { return nil }
