package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/testcert"
)

// TestServingOverTLS: with GATEWAY_TLS_CERT and GATEWAY_TLS_KEY the API is
// served over TLS alone, to HTTP/1.1 and HTTP/2 clients (ALPN), responses
// and streams; a stream that outlives the moment streams are detached
// leaves its connection to the client's next request, and its call ends when
// its client leaves; a plain HTTP request is refused and logged as a
// warning, a connection closed before its handshake is not; `gateway probe
// --insecure` checks the replica's readiness without its certificate's
// authority. A renewed certificate (its files replaced, of another
// authority) is served from the next connection on, without a restart, and
// the metrics and the log tell the end of the certificate the files hold;
// files that do not read as a pair are logged, and the certificate read
// before stays.
func TestServingOverTLS(t *testing.T) {
	t.Parallel()
	b := setup(t)
	one, two := testcert.NewAuthority(t, "gateway test authority one"), testcert.NewAuthority(t, "gateway test authority two")
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	place := func(c testcert.Credentials) {
		require.NoError(t, os.WriteFile(certFile, c.Cert, 0o600))
		require.NoError(t, os.WriteFile(keyFile, c.Key, 0o600))
	}
	loopback := net.IPv4(127, 0, 0, 1)
	month, quarter := time.Now().Add(30*24*time.Hour), time.Now().Add(90*24*time.Hour)
	place(one.IssueUntil(t, "localhost", loopback, month))
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_TLS_CERT": certFile, "GATEWAY_TLS_KEY": keyFile})
	expiry := func() int64 {
		return int64(metricValue(t, g.scrape(), "gateway_tls_certificate_expiry_timestamp_seconds"))
	}
	require.Equal(t, month.Unix(), expiry())
	require.Eventually(t, func() bool {
		return strings.Contains(g.stderr.String(), `"tls":true,"upstream":"`+b.fake.BaseURL()+`","certificate_names":["localhost","127.0.0.1"],"certificate_not_after":"`+month.UTC().Format(time.RFC3339)+`"`)
	}, 10*time.Second, 10*time.Millisecond, "the start names the certificate served")

	for _, major := range []int{1, 2} {
		g.client = tlsClient(t, one, major)
		r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "over TLS"})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		require.Equal(t, major, r.proto)
		r, s := g.stream(b.key, map[string]any{"prompt": "streamed over TLS"})
		require.Equal(t, major, r.proto)
		require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	}

	// Past DetachAfter, an HTTP/1.1 stream's connection is taken over; once
	// the stream ends it goes back to the server, for the next request.
	b.fake.SetSlow("slowly over TLS", 500*time.Millisecond)
	g.client = tlsClient(t, one, 1)
	_, s := g.stream(b.key, map[string]any{"prompt": "slowly over TLS"})
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	var reused bool
	trace := &httptrace.ClientTrace{GotConn: func(c httptrace.GotConnInfo) { reused = c.Reused }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), http.MethodGet, g.base+"/healthz", nil)
	require.NoError(t, err)
	resp, err := g.client.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, reused, "on the detached stream's connection")

	// A client that leaves a detached stream: its upstream call is ended.
	b.fake.SetSlow("left over TLS", time.Hour)
	ctx, leave := context.WithCancel(t.Context())
	req, err = http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/api/v1/responses", strings.NewReader(`{"prompt": "left over TLS", "stream": true}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err = g.client.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Eventually(t, func() bool { return b.fake.InFlight() == 1 }, 10*time.Second, 10*time.Millisecond)
	time.Sleep(300 * time.Millisecond) // past DetachAfter
	leave()
	_ = resp.Body.Close()
	require.Eventually(t, func() bool { return b.fake.InFlight() == 0 }, 10*time.Second, 10*time.Millisecond,
		"the call of a stream whose client left is ended")

	// A TCP check that closes without a handshake writes no line; plain
	// HTTP is refused, and logged once as what it is.
	check, err := net.Dial("tcp", strings.TrimPrefix(g.base, "https://"))
	require.NoError(t, err)
	require.NoError(t, check.Close())
	resp, err = http.Get(strings.Replace(g.base, "https://", "http://", 1) + "/healthz")
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "plain HTTP is refused")
	require.Eventually(t, func() bool {
		return strings.Contains(g.stderr.String(), `"level":"WARN","msg":"a client sent plain HTTP to the TLS listener (answered 400)"`)
	}, 10*time.Second, 10*time.Millisecond)
	require.NotContains(t, g.stderr.String(), "TLS handshake error", "net/http's own line")
	require.Eventually(t, func() bool {
		return metricValue(t, g.scrape(), `gateway_tls_handshake_failures_total{kind="closed"}`) >= 1
	}, 10*time.Second, 10*time.Millisecond, "the TCP check is counted")
	require.Equal(t, 1, strings.Count(g.stderr.String(), `"remote":"127.0.0.1:`), "and not logged: the plain HTTP request alone is")

	// A container's health check: the replica's own address, which a
	// certificate need not name.
	_, err = cliWith(t, map[string]string{}, "probe", g.base+"/readyz")
	require.ErrorContains(t, err, "certificate", "checked unless told not to")
	_, err = cliWith(t, map[string]string{}, "probe", "--insecure", g.base+"/readyz")
	require.NoError(t, err)

	// The renewal: the metrics tell its end without a handshake, and the
	// next connection gets the new certificate.
	place(two.IssueUntil(t, "localhost", loopback, quarter))
	require.Equal(t, quarter.Unix(), expiry())
	require.Eventually(t, func() bool {
		return strings.Contains(g.stderr.String(), `"msg":"the TLS certificate's files changed: the new certificate is served from the next connection","certificate_names":["localhost","127.0.0.1"],"certificate_not_after":"`+quarter.UTC().Format(time.RFC3339)+`"`)
	}, 10*time.Second, 10*time.Millisecond, "the renewal is logged")
	g.client = tlsClient(t, two, 1)
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "after the renewal"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	_, err = tlsClient(t, one, 1).Get(g.base + "/healthz")
	var unknown x509.UnknownAuthorityError
	require.ErrorAs(t, err, &unknown, "the certificate before is served no more")

	// Files that do not read: the certificate before stays.
	require.NoError(t, os.WriteFile(certFile, []byte("not a certificate"), 0o600))
	g.client = tlsClient(t, two, 1)
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "during a broken renewal"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	logged := func() bool {
		return strings.Contains(g.stderr.String(), "the TLS certificate's files changed and were not read")
	}
	require.Eventually(t, logged, 10*time.Second, 10*time.Millisecond)
}

// tlsClient is a client that trusts a alone and speaks HTTP/major.
func tlsClient(t *testing.T, a testcert.Authority, major int) *http.Client {
	t.Helper()
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(a.Cert))
	transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, Protocols: new(http.Protocols)}
	transport.Protocols.SetHTTP1(major == 1)
	transport.Protocols.SetHTTP2(major == 2)
	t.Cleanup(transport.CloseIdleConnections)
	return &http.Client{Transport: transport}
}

// TestAnUnreadableCertificateStopsTheStart: files that do not read as a
// certificate and its key stop `gateway serve` before it connects to a
// database, with the variables named.
func TestAnUnreadableCertificateStopsTheStart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	require.NoError(t, os.WriteFile(certFile, []byte("not a certificate"), 0o600))
	require.NoError(t, os.WriteFile(keyFile, []byte("not a key"), 0o600))
	_, err := cliWith(t, map[string]string{
		"DATABASE_URL": "postgres://nobody@127.0.0.1:1/none", "GATEWAY_TLS_CERT": certFile, "GATEWAY_TLS_KEY": keyFile,
	}, "serve")
	require.ErrorContains(t, err, "GATEWAY_TLS_CERT/GATEWAY_TLS_KEY: error reading the certificate and its key")
}

// TestDevOverTLS: `gateway dev` serves over TLS too, and its banner's
// addresses say https.
func TestDevOverTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	issued := testcert.NewAuthority(t, "gateway test authority").Issue(t, "localhost", net.IPv4(127, 0, 0, 1))
	require.NoError(t, os.WriteFile(certFile, issued.Cert, 0o600))
	require.NoError(t, os.WriteFile(keyFile, issued.Key, 0o600))
	g := start(t, map[string]string{"GATEWAY_TLS_CERT": certFile, "GATEWAY_TLS_KEY": keyFile},
		"dev", "--data", filepath.Join(reachableTempDir(t), ".gateway"), "--pg-port", "0")
	line := waitForLine(t, g.stdout, "Gateway ready on")
	require.Contains(t, line, g.base, "the banner names the address it serves, https")
	require.True(t, strings.HasPrefix(g.base, "https://"))
	require.Contains(t, waitForLine(t, g.stdout, "OpenAPI document:"), g.base+"/openapi.json")
}
