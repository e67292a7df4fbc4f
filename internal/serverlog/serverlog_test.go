package serverlog_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/serverlog"
	"github.com/rungworks/gateway/internal/testcert"
)

// record is what a test keeps of a slog record.
type record struct {
	level slog.Level
	msg   string
	attrs map[string]string
}

// recorder is a slog.Handler that keeps every record, whatever its level.
type recorder struct {
	mu      sync.Mutex
	records []record
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *recorder) WithGroup(string) slog.Handler            { return r }

func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	attrs := map[string]string{}
	rec.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, record{level: rec.Level, msg: rec.Message, attrs: attrs})
	return nil
}

// find returns the first record whose message starts with prefix.
func (r *recorder) find(prefix string) (record, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.records {
		if strings.HasPrefix(rec.msg, prefix) {
			return rec, true
		}
	}
	return record{}, false
}

type testBundle struct {
	addr      string
	authority testcert.Authority
	logs      *recorder
	mu        sync.Mutex
	kinds     []string
}

// counted returns the kinds counted so far.
func (b *testBundle) counted() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.kinds...)
}

// await waits for a record whose message starts with prefix.
func (b *testBundle) await(t *testing.T, prefix string) record {
	t.Helper()
	var rec record
	require.Eventually(t, func() bool {
		var ok bool
		rec, ok = b.logs.find(prefix)
		return ok
	}, 10*time.Second, 5*time.Millisecond, "a record %q", prefix)
	return rec
}

// setup serves over TLS, with a handler that writes its header twice on
// /twice and panics on /panic, net/http's lines going to New.
func setup(t *testing.T) *testBundle {
	t.Helper()
	b := &testBundle{authority: testcert.NewAuthority(t, "serverlog test authority"), logs: &recorder{}}
	issued := b.authority.Issue(t, "localhost", net.IPv4(127, 0, 0, 1))
	pair, err := tls.X509KeyPair(issued.Cert, issued.Key)
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.HandleFunc("/twice", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.WriteHeader(http.StatusTeapot)
	})
	mux.HandleFunc("/panic", func(http.ResponseWriter, *http.Request) { panic("a handler's bug") })
	srv := &http.Server{
		Handler:     mux,
		TLSConfig:   &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12},
		ErrorLog:    serverlog.New(slog.New(b.logs), func(kind string) { b.mu.Lock(); b.kinds = append(b.kinds, kind); b.mu.Unlock() }),
		ReadTimeout: 10 * time.Second,
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	b.addr = ln.Addr().String()
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { _ = srv.Close() })
	return b
}

// client trusts roots (the system's when nil) and speaks TLS up to maxVersion.
func client(t *testing.T, roots *x509.CertPool, maxVersion uint16) *http.Client {
	t.Helper()
	config := &tls.Config{RootCAs: roots, MaxVersion: maxVersion}
	if maxVersion != 0 {
		config.MinVersion = tls.VersionTLS10
	}
	transport := &http.Transport{TLSClientConfig: config}
	t.Cleanup(transport.CloseIdleConnections)
	return &http.Client{Transport: transport}
}

// TestNetHTTPLines: the lines net/http's server writes, as it writes them,
// come out as records of a fixed message each at their level, the failed
// handshakes counted by kind.
func TestNetHTTPLines(t *testing.T) {
	t.Parallel()

	t.Run("AConnectionClosedBeforeItsHandshake", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		conn, err := net.Dial("tcp", b.addr)
		require.NoError(t, err)
		require.NoError(t, conn.Close())
		require.Eventually(t, func() bool { return len(b.counted()) > 0 }, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, []string{serverlog.Closed}, b.counted())
		_, logged := b.logs.find("")
		require.False(t, logged, "counted, not logged")
	})

	t.Run("PlainHTTP", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		resp, err := http.Get("http://" + b.addr + "/")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusBadRequest, resp.StatusCode)
		rec := b.await(t, "a client sent plain HTTP")
		require.Equal(t, slog.LevelWarn, rec.level)
		require.Equal(t, []string{serverlog.PlainHTTP}, b.counted())
	})

	for _, refusal := range []struct {
		name, msg, reason, kind string
		roots                   *x509.CertPool
		maxVersion              uint16
	}{
		{name: "ACertificateTheClientRefuses", roots: x509.NewCertPool(),
			msg: "a client refused the TLS handshake", reason: "remote error: tls: bad certificate", kind: serverlog.Refused},
		{name: "AVersionTheServerRefuses", maxVersion: tls.VersionTLS11,
			msg: "a TLS handshake failed", reason: "unsupported versions", kind: serverlog.Other},
	} {
		t.Run(refusal.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, err := client(t, refusal.roots, refusal.maxVersion).Get("https://" + b.addr + "/")
			require.Error(t, err)
			rec := b.await(t, refusal.msg)
			require.Equal(t, slog.LevelWarn, rec.level)
			require.Contains(t, rec.attrs["reason"], refusal.reason)
			require.Equal(t, []string{refusal.kind}, b.counted())
		})
	}

	t.Run("AHandlersMistakeAndPanic", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		roots := x509.NewCertPool()
		require.True(t, roots.AppendCertsFromPEM(b.authority.Cert))
		c := client(t, roots, 0)
		resp, err := c.Get("https://" + b.addr + "/twice")
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		rec := b.await(t, "the HTTP server reported an error")
		require.Equal(t, slog.LevelWarn, rec.level)
		require.Contains(t, rec.attrs["error"], "superfluous response.WriteHeader call")

		_, err = c.Get("https://" + b.addr + "/panic")
		require.Error(t, err, "the connection is closed")
		rec = b.await(t, "a request's handler panicked")
		require.Equal(t, slog.LevelError, rec.level)
		require.Contains(t, rec.attrs["error"], "a handler's bug")
		require.Empty(t, b.counted(), "no handshake failed")
	})
}
