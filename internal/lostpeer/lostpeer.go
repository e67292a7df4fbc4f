// Package lostpeer sets up the gateway's TCP connections, to providers and
// from clients, to find a peer the network lost without closing the
// connection (a NAT or firewall that forgot it, an address a failover moved,
// a load balancer gone): neither end is told, and the kernel's defaults keep
// such a connection for minutes to hours, with whatever waits on it.
package lostpeer

import (
	"context"
	"net"
	"time"
)

// KeepAlive finds a lost peer on a connection that waits for it: one
// silent for 10 s is probed every 5 s, and closed after 3 probes unanswered.
// Go's default (15 s, then 9 probes 15 s apart) takes 2.5 minutes. The
// peer's kernel answers the probes however busy its program is: they end no
// call that waits for a slow model, nor a client that waits for its reply.
var KeepAlive = net.KeepAliveConfig{Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3}

// UserTimeout finds a lost peer on a connection that sends to it (a call's
// request, a stream's events), which keepalives do not probe: what was sent
// may go unacknowledged this long before the kernel closes the connection
// (TCP_USER_TIMEOUT, on Linux; elsewhere the kernel's retransmissions give
// up after some 15 minutes). It also bounds the probes of KeepAlive.
const UserTimeout = 25 * time.Second

// Dialer returns a dialer that connects within timeout, set up as the
// package says.
func Dialer(timeout time.Duration) *net.Dialer {
	return &net.Dialer{Timeout: timeout, KeepAliveConfig: KeepAlive, Control: control}
}

// Listen listens on address; the connections it accepts are set up as the
// package says.
func Listen(ctx context.Context, address string) (net.Listener, error) {
	lc := net.ListenConfig{KeepAliveConfig: KeepAlive, Control: control}
	return lc.Listen(ctx, "tcp", address)
}
