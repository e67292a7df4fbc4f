package http1

import "time"

// SetClock makes c age its idle connections by now instead of time.Now.
func SetClock(c *Client, now func() time.Time) { c.now = now }
