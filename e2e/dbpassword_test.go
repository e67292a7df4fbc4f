package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/fakeupstream"
)

// TestARotatedPassword: with a DATABASE_URL whose password is in a passfile,
// a password rotated while the replica runs (the role's password changed,
// its sessions ended) is refused until the passfile holds the new one: the
// replica answers 503 SERVICE_UNAVAILABLE, then serves again without a
// restart, its new connections (named gateway serve) logged in with the new
// password.
func TestARotatedPassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster, dir := ownCluster(t, false)
	admin := adminConn(t, cluster)
	_, err := admin.Exec(ctx, "CREATE ROLE gateway LOGIN SUPERUSER PASSWORD 'first'")
	require.NoError(t, err)
	// The role's logins from 127.0.0.1 take its password (the test's own,
	// as postgres, stay trusted).
	loginRuleFirst(t, dir, "host gw gateway 127.0.0.1/32 scram-sha-256")
	_, err = admin.Exec(ctx, "SELECT pg_reload_conf()")
	require.NoError(t, err)

	passfile := filepath.Join(t.TempDir(), "pgpass")
	write := func(password string) {
		entry := fmt.Sprintf("127.0.0.1:%d:gw:gateway:%s\n", cluster.Port(), password)
		require.NoError(t, os.WriteFile(passfile, []byte(entry), 0o600))
	}
	dbURL := fmt.Sprintf("postgres://gateway@127.0.0.1:%d/gw?sslmode=disable&passfile=%s", cluster.Port(), passfile)
	write("wrong")
	require.Eventually(t, func() bool { // the reload is the server's, at its pace
		_, err := cli(t, dbURL, "keys", "list", "--account", "acme")
		return err != nil && strings.Contains(err.Error(), "password authentication failed")
	}, 10*time.Second, 50*time.Millisecond, "the role's logins take its password")
	write("first")
	key := strings.TrimSpace(mustCLI(t, dbURL, "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	g := serve(t, dbURL, fake.BaseURL(), nil)
	call := func() reply {
		return g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "hello"})
	}
	require.Equal(t, http.StatusOK, call().status)

	// The rotation: the password changed and the replica's sessions ended,
	// before the passfile is rewritten.
	_, err = admin.Exec(ctx, "ALTER ROLE gateway PASSWORD 'second'")
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'gateway'")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return g.call(http.MethodGet, "/readyz", "", nil).status == http.StatusServiceUnavailable },
		10*time.Second, 50*time.Millisecond, "a replica whose logins are refused is not ready")
	r := g.call(http.MethodGet, "/api/v1/usage", key, nil)
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "SERVICE_UNAVAILABLE", r.code(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))

	write("second")
	require.Eventually(t, func() bool { return call().status == http.StatusOK }, 20*time.Second, 100*time.Millisecond,
		"the replica logs in with the passfile's new password")
	var sessions int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE usename = 'gateway' AND application_name = 'gateway serve'`).Scan(&sessions))
	require.Positive(t, sessions, "the replica's sessions, named after it")
}
