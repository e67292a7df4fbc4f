package openai

import (
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSendOnceKeepsOnlySafeAttempts pins when net/http's transport may have
// a call's body for another attempt: over HTTP/1.1 until a reply starts (it
// asks only when not a byte reached the connection), over HTTP/2 until an
// attempt was written whole.
func TestSendOnceKeepsOnlySafeAttempts(t *testing.T) {
	t.Parallel()
	conn, peer := net.Pipe()
	t.Cleanup(func() { _ = conn.Close(); _ = peer.Close() })

	for _, tc := range []struct {
		name     string
		h2c      bool
		wrote    error // the attempt's write: nil when written whole
		answered bool  // a reply started
		again    bool
	}{
		{name: "HTTP/1.1 written whole", wrote: nil, again: true},
		{name: "HTTP/1.1 answered", wrote: nil, answered: true, again: false},
		{name: "h2c not written whole", h2c: true, wrote: net.ErrClosed, again: true},
		{name: "h2c written whole", h2c: true, wrote: nil, again: false},
		{name: "h2c answered", h2c: true, wrote: net.ErrClosed, answered: true, again: false},
	} {
		o := &sendOnce{h2c: tc.h2c}
		connected := false
		trace := o.trace(func() { connected = true })
		trace.GotConn(httptrace.GotConnInfo{Conn: conn})
		trace.WroteRequest(httptrace.WroteRequestInfo{Err: tc.wrote})
		if tc.answered {
			trace.GotFirstResponseByte()
		}
		require.True(t, connected, tc.name)
		body, err := o.body([]byte("{}"))()
		if !tc.again {
			require.ErrorIs(t, err, errSentOnce, tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		require.NoError(t, body.Close())
	}

	// Over TLS, the protocol the connection negotiated decides.
	server := httptest.NewUnstartedServer(http.NotFoundHandler())
	server.EnableHTTP2 = true
	server.StartTLS()
	t.Cleanup(server.Close)
	for proto, want := range map[string]bool{"h2": true, "http/1.1": false} {
		cfg := server.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
		cfg.NextProtos = []string{proto}
		tlsConn, err := tls.Dial("tcp", server.Listener.Addr().String(), cfg)
		require.NoError(t, err)
		require.Equal(t, want, negotiatedHTTP2(tlsConn), proto)
		require.NoError(t, tlsConn.Close())
	}
	require.False(t, negotiatedHTTP2(conn), "a connection without TLS")
}
