package http1_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rungworks/gateway/upstream/http1"
)

// goodReply is what the fuzzed upstream answers to every call but the first.
const goodReply = "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood"

// FuzzReply answers a call with arbitrary bytes on a connection the upstream
// keeps open, and the next call (on that connection or another) with a
// well-formed reply. The client never panics, returns within its context,
// and the next call reads exactly the well-formed reply: nothing left of an
// arbitrary one is read as the answer to another call.
func FuzzReply(f *testing.F) {
	for _, seed := range []string{
		goodReply,
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nokay\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
		// Past the read buffer: what follows the reply is still in the socket.
		"HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + strings.Repeat("x", 3000) + "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 200 OK\r\n\r\nuntil the connection closes",
		"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
		"HTTP/1.1 101 Switching Protocols\r\n\r\n", "HTTP/1.0 200 OK\r\n\r\nold", "\r\n\r\n", "",
	} {
		f.Add([]byte(seed))
	}
	var current atomic.Pointer[[]byte]
	url := serveRaw(f, func(c net.Conn, req *http.Request) bool {
		reply := []byte(goodReply)
		if req.Header.Get("X-Fuzzed") != "" {
			reply = *current.Load()
		}
		_, err := c.Write(reply)
		return err == nil
	}) + "/v1/chat/completions"
	call := func(client *http1.Client, fuzzed bool, timeout time.Duration) (*http.Response, []byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader("{}"))
		if err != nil {
			return nil, nil, err
		}
		if fuzzed {
			req.Header.Set("X-Fuzzed", "1")
		}
		resp, err := client.Do(req, nil)
		if err != nil {
			return nil, nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return resp, body, err
	}
	f.Fuzz(func(t *testing.T, reply []byte) {
		current.Store(&reply)
		client := http1.New(http1.Config{MaxHeaderBytes: 64 << 10})
		defer client.CloseIdleConnections()
		// Whatever it makes of the reply, within its context: many arbitrary
		// replies promise more than they send.
		_, _, _ = call(client, true, 5*time.Millisecond)
		resp, body, err := call(client, false, time.Minute)
		if err != nil {
			t.Fatalf("the well-formed reply that followed: %v", err)
		}
		if resp.StatusCode != http.StatusOK || string(body) != "good" {
			t.Fatalf("the next call read %d %q, not the well-formed reply", resp.StatusCode, body)
		}
	})
}
