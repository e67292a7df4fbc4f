package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/pglocal"
)

// TestTheDatabaseOverTLS: with a DATABASE_URL that asks for TLS, the
// server's certificate checked against sslrootcert's authority with its name
// (sslmode=verify-full) or without (verify-ca), and that logs in with a
// client certificate, the only login the server takes over TLS, the
// operator commands and `gateway serve` work and every session of the
// replica is encrypted under that certificate. When the server (restarted)
// trusts another authority alone, and presents a certificate of that
// authority, the replica, its logins refused, answers 503
// SERVICE_UNAVAILABLE; once the client certificate's files and the
// sslrootcert file are replaced by that authority's, the connections it
// makes use them: it serves again without a restart.
func TestTheDatabaseOverTLS(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"verify-full", "verify-ca"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testTheDatabaseOverTLS(t, mode)
		})
	}
}

func testTheDatabaseOverTLS(t *testing.T, sslmode string) {
	cluster, dir := ownCluster(t, false)
	one, two := newAuthority(t, "gateway test authority one"), newAuthority(t, "gateway test authority two")
	server, serverTwo := one.issue(t, "localhost", net.IPv4(127, 0, 0, 1)), two.issue(t, "localhost", net.IPv4(127, 0, 0, 1))
	first, second := one.issue(t, "postgres", nil), two.issue(t, "postgres", nil)

	// The server: its certificate, the client authority it trusts, and
	// certificate logins over TLS from 127.0.0.1 (plain connections, the
	// test's own, stay trusted).
	serverFile := func(name string, content []byte) string {
		path := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(path, content, 0o600))
		require.NoError(t, cluster.Chown())
		return path
	}
	settings := map[string]string{
		"ssl":           "on",
		"ssl_cert_file": serverFile("server.crt", server.cert),
		"ssl_key_file":  serverFile("server.key", server.key),
		"ssl_ca_file":   serverFile("clients.crt", one.cert),
	}
	hba := filepath.Join(dir, "data", "pg_hba.conf")
	was, err := os.ReadFile(hba)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(hba, append([]byte("hostssl all all 127.0.0.1/32 cert\n"), was...), 0o600))
	admin := adminConn(t, cluster)
	for name, value := range settings {
		_, err := admin.Exec(context.Background(), fmt.Sprintf("ALTER SYSTEM SET %s = '%s'", name, value))
		require.NoError(t, err)
	}
	_, err = admin.Exec(context.Background(), "SELECT pg_reload_conf()")
	require.NoError(t, err)

	// The client's files, where a rotation replaces them.
	clientDir := t.TempDir()
	certFile, keyFile, rootFile := filepath.Join(clientDir, "client.crt"), filepath.Join(clientDir, "client.key"), filepath.Join(clientDir, "root.crt")
	require.NoError(t, os.WriteFile(rootFile, one.cert, 0o600))
	place := func(c credentials) {
		require.NoError(t, os.WriteFile(certFile, c.cert, 0o600))
		require.NoError(t, os.WriteFile(keyFile, c.key, 0o600))
	}
	place(first)
	dbURL := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/gw?sslmode=%s&sslrootcert=%s&sslcert=%s&sslkey=%s",
		cluster.Port(), sslmode, rootFile, certFile, keyFile)
	require.Eventually(t, func() bool { // the reload is the server's, at its pace
		_, err := cli(t, dbURL, "migrate")
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	key := strings.TrimSpace(mustCLI(t, dbURL, "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	g := serve(t, dbURL, fake.BaseURL(), nil)
	r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "over TLS"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	requireSessionsUnder(t, admin, "authority one")

	// The rotation: the server restarted under the new authority alone, so
	// that every connection is new, before the client's files are replaced.
	// A database that refuses the replica's logins, or that the replica
	// cannot trust, is away (503), not a fault of the gateway's (500).
	serverFile("clients.crt", two.cert)
	serverFile("server.crt", serverTwo.cert)
	serverFile("server.key", serverTwo.key)
	require.NoError(t, cluster.Stop())
	_, err = pglocal.Start(context.Background(), pglocal.Options{Dir: dir, Port: cluster.Port()}) // stopped with the test (ownCluster)
	require.NoError(t, err)
	conn, err := pgx.Connect(context.Background(), dbURL)
	if err == nil {
		_ = conn.Close(context.Background())
	}
	require.Error(t, err, "the old certificate is refused")
	r = g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "refused"})
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "SERVICE_UNAVAILABLE", r.code(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))
	place(second)
	require.NoError(t, os.WriteFile(rootFile, two.cert, 0o600))
	require.Eventually(t, func() bool {
		r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "after the rotation"})
		return r.status == http.StatusOK
	}, 30*time.Second, 100*time.Millisecond, "the replica connects with the new files")
	requireSessionsUnder(t, adminConn(t, cluster), "authority two")
}

// requireSessionsUnder fails t unless the sessions of database gw are all
// encrypted and logged in with a certificate its authority issued.
func requireSessionsUnder(t *testing.T, admin *pgx.Conn, authority string) {
	t.Helper()
	var sessions int
	var all bool
	require.NoError(t, admin.QueryRow(context.Background(), `SELECT count(*), coalesce(bool_and(s.ssl AND coalesce(s.issuer_dn, '') LIKE '%' || $1), false)
		FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.datname = 'gw' AND a.backend_type = 'client backend'`,
		authority).Scan(&sessions, &all))
	require.Positive(t, sessions)
	require.True(t, all, "every session encrypted under a certificate of %s", authority)
}

// adminConn is a plain connection to the cluster's database postgres,
// closed with the test.
func adminConn(t *testing.T, cluster *pglocal.Cluster) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), cluster.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// credentials are a certificate and its key, PEM-encoded.
type credentials struct{ cert, key []byte }

// authority issues certificates for a test.
type authority struct {
	credentials
	template *x509.Certificate
	signer   *ecdsa.PrivateKey
}

func newAuthority(t *testing.T, name string) authority {
	t.Helper()
	template := certificateTemplate(name)
	template.IsCA, template.BasicConstraintsValid = true, true
	template.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	a := authority{template: template}
	a.credentials, a.signer = sign(t, template, template, nil)
	return a
}

// issue returns a certificate for name (a client's user, or a server's host
// with its address ip) signed by a.
func (a authority) issue(t *testing.T, name string, ip net.IP) credentials {
	t.Helper()
	template := certificateTemplate(name)
	template.KeyUsage = x509.KeyUsageDigitalSignature
	template.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	if ip != nil {
		template.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		template.DNSNames, template.IPAddresses = []string{name}, []net.IP{ip}
	}
	c, _ := sign(t, template, a.template, a.signer)
	return c
}

func certificateTemplate(name string) *x509.Certificate {
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62)) // crypto/rand does not fail
	return &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
	}
}

// sign makes a key for template and signs it with parent's signer (its own
// when signer is nil).
func sign(t *testing.T, template, parent *x509.Certificate, signer *ecdsa.PrivateKey) (credentials, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	if signer == nil {
		signer = key
	}
	der, err := x509.CreateCertificate(rand.Reader, template, parent, &key.PublicKey, signer)
	require.NoError(t, err)
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return credentials{
		cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		key:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}),
	}, key
}
