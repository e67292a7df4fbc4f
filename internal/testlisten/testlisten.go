// Package testlisten serves raw TCP connections for tests: a loopback
// listener that hands each connection to the test's own server code.
package testlisten

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// Serve listens on a loopback port until the test ends, hands each
// connection it accepts to serve on a goroutine of its own, closes the
// connection once serve returns, and returns the listener's address
// (host:port).
func Serve(tb testing.TB, serve func(net.Conn)) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				serve(conn)
			}()
		}
	}()
	return ln.Addr().String()
}
