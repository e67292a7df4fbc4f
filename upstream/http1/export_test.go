package http1

import (
	"context"
	"net"
	"time"
)

// SetClock makes c age its idle connections by now instead of time.Now.
func SetClock(c *Client, now func() time.Time) { c.now = now }

// Dial connects to addr as c does for a call.
func Dial(c *Client, ctx context.Context, addr string) (net.Conn, error) { return c.dial(ctx, addr) }
