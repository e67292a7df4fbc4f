package e2e

import (
	"context"
	"fmt"
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
	"github.com/rungworks/gateway/internal/testcert"
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
	one, two := testcert.NewAuthority(t, "gateway test authority one"), testcert.NewAuthority(t, "gateway test authority two")
	server, serverTwo := one.Issue(t, "localhost", net.IPv4(127, 0, 0, 1)), two.Issue(t, "localhost", net.IPv4(127, 0, 0, 1))
	first, second := one.Issue(t, "postgres", nil), two.Issue(t, "postgres", nil)

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
		"ssl_cert_file": serverFile("server.crt", server.Cert),
		"ssl_key_file":  serverFile("server.key", server.Key),
		"ssl_ca_file":   serverFile("clients.crt", one.Cert),
	}
	loginRuleFirst(t, dir, "hostssl all all 127.0.0.1/32 cert")
	admin := adminConn(t, cluster)
	for name, value := range settings {
		_, err := admin.Exec(context.Background(), fmt.Sprintf("ALTER SYSTEM SET %s = '%s'", name, value))
		require.NoError(t, err)
	}
	_, err := admin.Exec(context.Background(), "SELECT pg_reload_conf()")
	require.NoError(t, err)

	// The client's files, where a rotation replaces them.
	clientDir := t.TempDir()
	certFile, keyFile, rootFile := filepath.Join(clientDir, "client.crt"), filepath.Join(clientDir, "client.key"), filepath.Join(clientDir, "root.crt")
	require.NoError(t, os.WriteFile(rootFile, one.Cert, 0o600))
	place := func(c testcert.Credentials) {
		require.NoError(t, os.WriteFile(certFile, c.Cert, 0o600))
		require.NoError(t, os.WriteFile(keyFile, c.Key, 0o600))
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
	serverFile("clients.crt", two.Cert)
	serverFile("server.crt", serverTwo.Cert)
	serverFile("server.key", serverTwo.Key)
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
	require.NoError(t, os.WriteFile(rootFile, two.Cert, 0o600))
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

// loginRuleFirst puts rule ahead of the login rules (pg_hba.conf) of the
// cluster in dir, in force from the server's next reload.
func loginRuleFirst(t *testing.T, dir, rule string) {
	t.Helper()
	hba := filepath.Join(dir, "data", "pg_hba.conf")
	was, err := os.ReadFile(hba)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(hba, append([]byte(rule+"\n"), was...), 0o600))
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
