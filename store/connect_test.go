package store_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/blackhole"
	"github.com/rungworks/gateway/internal/lostpeer"
	"github.com/rungworks/gateway/internal/testcert"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/internal/txpooler"
	"github.com/rungworks/gateway/store"
)

func TestUUIDsRoundTrip(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t) // connected by store.Connect
	ctx := context.Background()
	one, two := uuid.Must(uuid.NewV7()), uuid.New()
	var (
		gotOne  uuid.UUID
		gotMany []uuid.UUID
		gotNil  *uuid.UUID
		gotPtr  *uuid.UUID
		text    string
	)
	err := pool.QueryRow(ctx, "SELECT $1::uuid, $2::uuid[], $3::uuid, $4::uuid, $1::uuid::text",
		one, []uuid.UUID{one, two}, (*uuid.UUID)(nil), &two).Scan(&gotOne, &gotMany, &gotNil, &gotPtr, &text)
	require.NoError(t, err)
	require.Equal(t, one, gotOne)
	require.Equal(t, []uuid.UUID{one, two}, gotMany)
	require.Nil(t, gotNil)
	require.Equal(t, &two, gotPtr)
	require.Equal(t, one.String(), text, "PostgreSQL received the same uuid")

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	plan := conn.Conn().TypeMap().PlanEncode(pgtype.UUIDOID, pgtype.BinaryFormatCode, one)
	require.Equal(t, "*store.uuidEncodePlan", fmt.Sprintf("%T", plan), "encoded directly, not through its text")
}

// TestNewConnectionsReadTheFilesAgain: each new connection of the pool
// takes the passfile's password and sslrootcert's authorities as they are
// then; a file missing or empty while a rotation replaces it leaves what was
// read last. TestARotatedPassword and TestTheDatabaseOverTLS (e2e) show
// logins with what a rotation placed.
func TestNewConnectionsReadTheFilesAgain(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	passfile, rootFile := filepath.Join(dir, "pgpass"), filepath.Join(dir, "root.crt")
	authorities := map[string]testcert.Authority{"one": testcert.NewAuthority(t, "one"), "two": testcert.NewAuthority(t, "two")}
	authority, leaf := map[string][]byte{}, map[string][]byte{} // each authority's certificate, and one it issued (DER)
	for name, a := range authorities {
		authority[name] = a.Cert
		block, _ := pem.Decode(a.Issue(t, "db", net.ParseIP("127.0.0.1")).Cert)
		leaf[name] = block.Bytes
	}
	place := func(path string, content []byte) { require.NoError(t, os.WriteFile(path, content, 0o600)) }
	place(passfile, []byte("*:*:gw:gateway:first\n"))
	place(rootFile, authority["one"])
	cfg, err := store.PoolConfig("postgres://gateway@127.0.0.1:5432,127.0.0.1:5433/gw?sslmode=verify-ca&passfile="+passfile+"&sslrootcert="+rootFile, t.Name(), 0)
	require.NoError(t, err)
	requireNext := func(password, authorityName string) {
		t.Helper()
		c := cfg.ConnConfig.Copy()
		require.NoError(t, cfg.BeforeConnect(context.Background(), c))
		require.Equal(t, password, c.Password)
		want := x509.NewCertPool()
		require.True(t, want.AppendCertsFromPEM(authority[authorityName]))
		other := map[string]string{"one": "two", "two": "one"}[authorityName]
		for _, tlsConfig := range []*tls.Config{c.TLSConfig, c.Fallbacks[0].TLSConfig} {
			require.True(t, tlsConfig.RootCAs.Equal(want), "the authority of %s", authorityName)
			// verify-ca checks the server's certificate itself, with the authorities read now.
			require.NoError(t, tlsConfig.VerifyPeerCertificate([][]byte{leaf[authorityName]}, nil), "a certificate of %s", authorityName)
			require.Error(t, tlsConfig.VerifyPeerCertificate([][]byte{leaf[other]}, nil), "a certificate of %s", other)
		}
	}
	requireNext("first", "one")

	place(passfile, []byte("*:*:gw:gateway:second\n"))
	place(rootFile, authority["two"])
	requireNext("second", "two")

	place(passfile, nil)
	requireNext("second", "two")
	require.NoError(t, os.Remove(passfile))
	requireNext("second", "two")
	place(rootFile, nil)
	requireNext("second", "two")
	require.NoError(t, os.Remove(rootFile))
	requireNext("second", "two")

	place(passfile, []byte("*:*:gw:gateway:third\n"))
	place(rootFile, authority["one"])
	requireNext("third", "one")
}

// TestAPoolerThatSharesSessionsIsNamed: through a pooler that pools by
// transaction (its clients share one server session here), the second
// connection finds the statement the first prepared in the session, and the
// error names the likely cause.
func TestAPoolerThatSharesSessionsIsNamed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pooler, err := txpooler.Start(ctx, testdb.URL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pooler.Close() })
	pool, err := store.Connect(ctx, "postgres://postgres@"+pooler.Addr()+"/gw?sslmode=disable", t.Name(), 2)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	first, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer first.Release()
	require.NoError(t, first.Ping(ctx))

	_, err = pool.Acquire(ctx)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "42P05", pgErr.Code)
	require.ErrorContains(t, err, "pooler that pools by transaction")
	require.False(t, store.Transient(err), "a misconfiguration, not an outage")
}

// TestSessionsBoundWhatALostClientHolds: each session the store opens has the
// server end it when its client is lost (a transaction idle past
// IdleTransactionTimeout, keepalives unanswered), and the database URL's own
// settings are kept; the gateway's end is set up as lostpeer says. TestTheServerClosesASessionTheNetworkLost shows the
// keepalives' effect, TestATransactionTheNetworkLostReleasesItsLocks the
// idle bound's.
func TestSessionsBoundWhatALostClientHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	show := func(pool *pgxpool.Pool) (settings [5]string) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout'),
			current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), current_setting('tcp_keepalives_count'),
			current_setting('tcp_user_timeout')`).
			Scan(&settings[0], &settings[1], &settings[2], &settings[3], &settings[4]))
		return settings
	}
	url := testdb.URL(t)
	pool := testdb.Connect(t, url)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	if err := lostpeer.Check(conn.Conn().PgConn().Conn()); !errors.Is(err, errors.ErrUnsupported) {
		require.NoError(t, err, "the gateway's end finds a lost server too")
	}
	require.Equal(t, [5]string{"10s", "10", "5", "3", "25000"}, show(pool))
	require.Equal(t, [5]string{"1min", "20", "5", "3", "60000"},
		show(testdb.Connect(t, url+"&idle_in_transaction_session_timeout=60000&tcp_keepalives_idle=20&tcp_user_timeout=60000")))
}

// TestSessionsAreNamed: the pool's sessions carry the name Connect is
// given, as pg_stat_activity shows them, unless the URL names them.
func TestSessionsAreNamed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.URL(t)
	named := func(url string) string {
		pool, err := store.Connect(ctx, url, "gateway serve", 1)
		require.NoError(t, err)
		defer pool.Close()
		var name string
		require.NoError(t, pool.QueryRow(ctx, "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(&name))
		return name
	}
	require.Equal(t, "gateway serve", named(url))
	require.Equal(t, "billing-replica-2", named(url+"&application_name=billing-replica-2"))
}

// TestThePoolsBoundsKeepTheURLs: the pool's size and the probe of an idle
// connection are the gateway's unless the database URL sets them.
func TestThePoolsBoundsKeepTheURLs(t *testing.T) {
	t.Parallel()
	const url = "postgres://gateway@127.0.0.1/gw?sslmode=disable"
	cfg, err := store.PoolConfig(url, t.Name(), 0)
	require.NoError(t, err)
	require.Equal(t, store.PingTimeout, cfg.PingTimeout)
	cfg, err = store.PoolConfig(url, t.Name(), 7)
	require.NoError(t, err)
	require.Equal(t, int32(7), cfg.MaxConns)
	cfg, err = store.PoolConfig(url+"&pool_ping_timeout=5s&pool_max_conns=3", t.Name(), 0)
	require.NoError(t, err)
	require.Equal(t, 5*time.Second, cfg.PingTimeout)
	require.Equal(t, int32(3), cfg.MaxConns)
}

// TestAConnectionIsKeptAfterAnError: a connection that received an error is
// kept, unless the error ended its session (pgx's own rule) or refused a
// write as read-only (the connection is on a standby).
func TestAConnectionIsKeptAfterAnError(t *testing.T) {
	t.Parallel()
	cfg, err := store.PoolConfig("postgres://gateway@127.0.0.1/gw?sslmode=disable", t.Name(), 0)
	require.NoError(t, err)
	kept := func(severity, code string) bool {
		return cfg.ConnConfig.OnPgError(nil, &pgconn.PgError{Severity: severity, Code: code})
	}
	require.True(t, kept("ERROR", "23505"), "a unique violation")
	require.True(t, kept("ERROR", "40001"), "a serialization failure")
	require.False(t, kept("FATAL", "57P01"), "the session was terminated")
	require.False(t, kept("ERROR", "25006"), "a write refused as read-only")
}

// TestPoolStatsSayWhatThePoolHolds: the pool's figures for the metrics are
// its own: a connection held is acquired, then idle once given back; its
// bound; its acquires, one that waited while none was free, one at once,
// and two given up.
func TestPoolStatsSayWhatThePoolHolds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.poolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 }))
	conn, err := st.Pool().Acquire(b.ctx)
	require.NoError(t, err)
	held := st.PoolStats()
	require.Equal(t, int32(1), held.Acquired)
	require.Equal(t, int32(0), held.Idle)
	require.Equal(t, int32(1), held.Max)

	for range 2 {
		ctx, cancel := context.WithTimeout(b.ctx, 50*time.Millisecond)
		_, err = st.Pool().Acquire(ctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "none was free")
	}
	waited := make(chan error, 1)
	go func() {
		c, err := st.Pool().Acquire(b.ctx)
		if err == nil {
			c.Release()
		}
		waited <- err
	}()
	time.Sleep(20 * time.Millisecond)
	conn.Release()
	require.NoError(t, <-waited)
	conn, err = st.Pool().Acquire(b.ctx) // at once: one is idle
	require.NoError(t, err)
	conn.Release()

	after := st.PoolStats()
	require.Equal(t, int32(0), after.Acquired)
	require.Equal(t, int32(1), after.Idle)
	require.Equal(t, held.Acquires+2, after.Acquires, "the one that waited, the one at once")
	require.Equal(t, held.Waited+1, after.Waited)
	require.Positive(t, after.Wait)
	require.Equal(t, held.Canceled+2, after.Canceled)
}

// TestTheServerClosesASessionTheNetworkLost loses the network to a client
// (every packet the server sends it dropped, probes included) while its
// session waits for its next statement, and while the server sends it a
// notification: the server closes the session some 25 s later (the
// keepalives each session sets, and its tcp_user_timeout for what it sent),
// instead of keeping it, counted against max_connections, for the two hours
// and more of the kernel's defaults (15 minutes with a notification in
// flight, which keepalives do not probe).
func TestTheServerClosesASessionTheNetworkLost(t *testing.T) {
	t.Parallel()
	for _, sending := range []bool{false, true} {
		t.Run(map[bool]string{false: "waiting", true: "sending"}[sending], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			hole := blackhole.New(t)
			url := testdb.URL(t)
			cfg, err := store.PoolConfig(url, t.Name(), 1)
			require.NoError(t, err)
			// The client's keepalives, which a lost network would drop too,
			// would reach the server and spare the session its probes: off.
			cfg.ConnConfig.DialFunc = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(hole.Addr())}, KeepAlive: -1}).DialContext
			lost, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(lost.Close) // after the route's removal (cleanups run last first): the server's refusal ends it at once
			var pid int32
			require.NoError(t, lost.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
			_, err = lost.Exec(ctx, "LISTEN lost")
			require.NoError(t, err)
			watcher := testdb.Connect(t, url)
			// What the server sent is acknowledged by now (loopback answers
			// in microseconds), so the waiting session has nothing in flight.
			time.Sleep(time.Second)

			hole.Drop()
			if sending {
				_, err = watcher.Exec(ctx, "NOTIFY lost")
				require.NoError(t, err)
			}
			require.Eventually(t, func() bool {
				var open bool
				require.NoError(t, watcher.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)", pid).Scan(&open))
				return !open
			}, 90*time.Second, 100*time.Millisecond, "the server closes the session")
		})
	}
}

// BenchmarkEncodeUUID: a uuid.UUID sent in binary, as pgx finds it on its own
// (through driver.Valuer and text) and as RegisterUUID teaches it.
func BenchmarkEncodeUUID(b *testing.B) {
	u := uuid.Must(uuid.NewV7())
	for _, registered := range []bool{false, true} {
		name := "valuer"
		if registered {
			name = "registered"
		}
		b.Run(name, func(b *testing.B) {
			m := pgtype.NewMap()
			if registered {
				store.RegisterUUID(m)
			}
			buf := make([]byte, 0, 64)
			b.ReportAllocs()
			for b.Loop() {
				out, err := m.Encode(pgtype.UUIDOID, pgx.BinaryFormatCode, u, buf[:0])
				if err != nil || len(out) != 16 {
					b.Fatalf("encoded %d bytes: %v", len(out), err)
				}
			}
		})
	}
}
