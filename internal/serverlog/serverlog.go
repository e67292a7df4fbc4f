// Package serverlog writes the lines net/http's servers log on their own (a
// failed TLS handshake, an accept error, a handler's panic) as the gateway's
// structured records, at a level by what they tell. Unhandled, they went out
// at INFO one a line: over TLS, a load balancer's TCP check or a port
// scanner, which close their connections without a handshake, wrote a line
// each (now they are counted only), and a client refusing the certificate
// was one more such line.
package serverlog

import (
	"context"
	"log"
	"log/slog"
	"strings"
)

// The kinds of failed TLS handshakes, the label values of their count.
const (
	// Closed: the client closed its connection or sent nothing before the
	// handshake ended (a TCP health check, a scanner, a preconnect left
	// unused). Counted, not logged.
	Closed = "closed"
	// PlainHTTP: the client sent plain HTTP (answered 400 by net/http).
	PlainHTTP = "plain_http"
	// Refused: the client ended the handshake with an alert: it did not
	// trust the certificate, or shares no version or cipher with the server.
	Refused = "refused"
	// Other: any other failure (versions or ciphers the server refused, a
	// first record that is not TLS).
	Other = "other"
)

// New returns the ErrorLog of an http.Server: each line is written to logger,
// a failed TLS handshake as one of the kinds above (counted with
// handshakeFailed, which may be nil; Closed is not written), a handler's
// panic at ERROR, anything else at WARN. Messages are fixed, the details in
// attributes, so that a sampling handler counts a flood of them as one kind.
func New(logger *slog.Logger, handshakeFailed func(kind string)) *log.Logger {
	return log.New(writer{logger: logger, handshakeFailed: handshakeFailed}, "", 0)
}

type writer struct {
	logger          *slog.Logger
	handshakeFailed func(kind string)
}

// handshakePrefix starts net/http's line for a failed TLS handshake:
// "http: TLS handshake error from <address>: <reason>".
const handshakePrefix = "http: TLS handshake error from "

// plainHTTPReason is the reason net/http gives once it has answered plain
// HTTP with its own 400.
const plainHTTPReason = "client sent an HTTP request to an HTTPS server"

func (w writer) Write(p []byte) (int, error) {
	line := strings.TrimSuffix(string(p), "\n")
	ctx := context.Background()
	switch {
	case strings.HasPrefix(line, handshakePrefix):
		remote, reason, _ := strings.Cut(strings.TrimPrefix(line, handshakePrefix), ": ")
		kind := handshakeKind(reason)
		if w.handshakeFailed != nil {
			w.handshakeFailed(kind)
		}
		msg := "a TLS handshake failed"
		switch kind {
		case Closed:
			return len(p), nil
		case PlainHTTP:
			msg = "a client sent plain HTTP to the TLS listener (answered 400)"
		case Refused:
			msg = "a client refused the TLS handshake (the certificate, or no common version or cipher)"
		}
		w.logger.Log(ctx, slog.LevelWarn, msg, "remote", remote, "reason", reason)
	case strings.HasPrefix(line, "http: panic serving"), strings.HasPrefix(line, "http2: panic serving"):
		w.logger.Log(ctx, slog.LevelError, "a request's handler panicked", "error", line)
	default:
		w.logger.Log(ctx, slog.LevelWarn, "the HTTP server reported an error", "error", line)
	}
	return len(p), nil
}

// handshakeKind sorts a failed handshake's reason, as net/http words it.
func handshakeKind(reason string) string {
	switch {
	case reason == plainHTTPReason:
		return PlainHTTP
	case reason == "EOF", strings.HasSuffix(reason, "unexpected EOF"),
		strings.Contains(reason, "connection reset by peer"),
		strings.Contains(reason, "broken pipe"),
		strings.Contains(reason, "i/o timeout"),
		strings.Contains(reason, "context deadline exceeded"):
		return Closed
	case strings.HasPrefix(reason, "remote error: "):
		return Refused
	}
	return Other
}
