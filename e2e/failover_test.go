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

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/pglocal"
)

// TestFailoverToAStandby: a DATABASE_URL naming a primary and its standby,
// with target_session_attrs=read-write, as for a cluster without one address
// for its primary. The replica serves from the primary; when the primary
// stops, it answers 503 SERVICE_UNAVAILABLE (the standby takes no writes)
// until the standby is promoted, then serves from it without a restart,
// hears its notifications there, and the usage view holds what was sent,
// once.
func TestFailoverToAStandby(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, standby := primaryAndStandby(t)

	dbURL := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/gw?sslmode=disable&target_session_attrs=read-write",
		primary.Port(), standby.Port())
	key := strings.TrimSpace(mustCLI(t, dbURL, "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	g := serve(t, dbURL, fake.BaseURL(), nil)
	served := int64(0)
	respond := func(prompt string) reply {
		r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": prompt})
		require.Contains(t, []int{http.StatusOK, http.StatusServiceUnavailable}, r.status, string(r.body))
		if r.status == http.StatusOK {
			served++
		}
		return r
	}
	require.Equal(t, http.StatusOK, respond("from the primary").status)

	// What the primary committed is on the standby before it stops.
	replayed(t, primary)
	require.NoError(t, primary.Stop())
	r := respond("while no server takes writes")
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "SERVICE_UNAVAILABLE", r.code(t))

	require.NoError(t, standby.Promote(ctx))
	require.Eventually(t, func() bool { return respond("from the promoted standby").status == http.StatusOK },
		30*time.Second, 100*time.Millisecond)
	require.Eventually(t, func() bool { return strings.Contains(g.scrape(), `gateway_notifications_listening{listener="keys"} 1`) },
		10*time.Second, 100*time.Millisecond, "the replica listens on the new primary")
	var v api.UsageView
	require.Eventually(t, func() bool {
		v = g.usage(key)
		return v.Totals.Requests == served
	}, 10*time.Second, 100*time.Millisecond)
	require.Equal(t, served, v.Totals.Requests, "billed is what was sent, once")
}

// primaryAndStandby starts an ownCluster and a standby of it, stopped with
// the test.
func primaryAndStandby(t *testing.T) (primary, standby *pglocal.Cluster) {
	t.Helper()
	primary, _ = ownCluster(t, false)
	parent, err := os.MkdirTemp("", "gateway-pg-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(parent) })
	require.NoError(t, os.Chmod(parent, 0o755)) // the postgres user enters it when the tests run as root
	standby, err = primary.Standby(context.Background(), pglocal.Options{Dir: filepath.Join(parent, "pg")})
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Stop() })
	return primary, standby
}

// replayed waits until the standbys of primary have replayed every record it
// had inserted in its log when called. Inserted, not written: the tests'
// clusters commit asynchronously, so a commit's record may wait in the log's
// buffers for the WAL writer (up to 200 ms) after the commit has returned,
// past the position written (pg_current_wal_lsn), and a standby that has
// replayed that position may not have the commit yet.
func replayed(t *testing.T, primary *pglocal.Cluster) {
	t.Helper()
	admin := adminConn(t, primary)
	var inserted string
	require.NoError(t, admin.QueryRow(context.Background(), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&inserted))
	require.Eventually(t, func() bool {
		var caughtUp bool
		require.NoError(t, admin.QueryRow(context.Background(), `SELECT coalesce(bool_and(replay_lsn >= $1::pg_lsn), false)
			FROM pg_stat_replication`, inserted).Scan(&caughtUp))
		return caughtUp
	}, 10*time.Second, 20*time.Millisecond, "the standby replays what the primary wrote")
}

// TestConnectionsToAStandbyAreReplaced: the database's address (a proxy
// here, as a name a failover moves) leads for a while to a standby, and the
// replica's connections made then land there: its writes are refused (503,
// not 500) and it is not ready. Once the address leads to the primary
// again, the replica serves without a restart: its connections on the
// standby were replaced (each closed at its first refused write, and the
// listeners close those they cannot listen on), the new ones reaching the
// primary.
func TestConnectionsToAStandbyAreReplaced(t *testing.T) {
	t.Parallel()
	primary, standby := primaryAndStandby(t)
	address, err := tcpproxy.Start(fmt.Sprintf("127.0.0.1:%d", primary.Port()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = address.Close() })
	dbURL := fmt.Sprintf("postgres://postgres@%s/gw?sslmode=disable", address.Addr())
	key := strings.TrimSpace(mustCLI(t, dbURL, "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	g := serve(t, dbURL, fake.BaseURL(), nil)
	call := func() reply {
		return g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "hello"})
	}
	require.Equal(t, http.StatusOK, call().status)
	// The standby has replayed the key before the address leads there:
	// what it refuses is the writes, not a key it has not caught up with.
	replayed(t, primary)

	address.Retarget(fmt.Sprintf("127.0.0.1:%d", standby.Port()))
	address.Cut()
	address.Drop() // the connections to the primary end: those made next reach the standby
	require.Eventually(t, func() bool { return g.call(http.MethodGet, "/readyz", "", nil).status == http.StatusServiceUnavailable },
		10*time.Second, 50*time.Millisecond, "a replica on a standby is not ready")
	r := call()
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "SERVICE_UNAVAILABLE", r.code(t))

	address.Retarget(fmt.Sprintf("127.0.0.1:%d", primary.Port()))
	require.Eventually(t, func() bool { return call().status == http.StatusOK }, 20*time.Second, 100*time.Millisecond,
		"the connections the standby refused writes on are replaced")
}
