// Package testdb gives each test a fresh, migrated database on a real
// PostgreSQL server: TEST_DATABASE_URL or DATABASE_URL when set, otherwise a
// testcontainers PostgreSQL when a Docker engine answers, otherwise one
// throwaway cluster per test process from the machine's own binaries. Databases
// are cloned from a migrated template (pgtestdb), so tests run in parallel.
package testdb

import (
	"context"
	"fmt"
	"net"
	neturl "net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver pgtestdb uses
	"github.com/peterldowns/pgtestdb"
	"github.com/peterldowns/pgtestdb/migrators/goosemigrator"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/migrations"
	"github.com/rungworks/gateway/pglocal"
	"github.com/rungworks/gateway/store"
)

var (
	once     sync.Once
	base     pgtestdb.Config
	stop     func()
	setupErr error
)

// Main runs a package's tests, stops the server it started, if any, and exits
// with the tests' code. Call it from TestMain.
func Main(m *testing.M) {
	os.Exit(Run(m))
}

// Run runs a package's tests, stops the server it started, if any, and
// returns the tests' code: for a TestMain with its own cleanup to do before
// it exits.
func Run(m *testing.M) int {
	code := m.Run()
	if stop != nil {
		stop()
	}
	return code
}

// URL returns the connection string of a fresh migrated database, dropped when
// the test ends.
func URL(t testing.TB) string {
	t.Helper()
	return create(t, goosemigrator.New(".", goosemigrator.WithFS(migrations.FS)))
}

// EmptyURL returns the connection string of a fresh database with no schema.
func EmptyURL(t testing.TB) string {
	t.Helper()
	return create(t, pgtestdb.NoopMigrator{})
}

func create(t testing.TB, migrator pgtestdb.Migrator) string {
	t.Helper()
	once.Do(func() { base, stop, setupErr = startServer() })
	if setupErr != nil {
		t.Fatalf("no PostgreSQL for tests: %v", setupErr)
	}
	time.Sleep(untilTheDayTurns(time.Now()))
	return pgtestdb.Custom(t, base, migrator).URL()
}

// untilTheDayTurns is how long a test starting at now waits so as not to
// straddle two UTC days: the gateway meters by UTC day (the usage view's
// default period, the daily ceiling), so a test that sent requests in a
// day's last seconds and read its usage in the next day's first would find
// none. Within a day's last minute, it waits until a second past its end.
func untilTheDayTurns(now time.Time) time.Duration {
	left := now.UTC().Truncate(24 * time.Hour).Add(24 * time.Hour).Sub(now)
	if left > time.Minute {
		return 0
	}
	return left + time.Second
}

// AsAdmin returns url (a database from URL) with the credentials the server
// was reached with, for what a database's own role may not do (such as
// loading auto_explain).
func AsAdmin(t testing.TB, url string) string {
	t.Helper()
	pc, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatalf("error parsing test database URL: %v", err)
	}
	return fmt.Sprintf("postgres://%s:%s@%s:%d/%s?sslmode=disable", neturl.PathEscape(base.User), neturl.PathEscape(base.Password),
		pc.Host, pc.Port, neturl.PathEscape(pc.Database))
}

// New returns a pool on a fresh migrated database, closed when the test ends.
func New(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return Connect(t, URL(t))
}

// Connect returns a pool on url, closed when the test ends.
func Connect(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := store.Connect(context.Background(), url, "gateway test "+t.Name(), 0)
	if err != nil {
		t.Fatalf("error connecting to test database: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Cuttable returns a pool on url whose connections pass through a proxy the
// test can cut, as a network that loses the connections open at a moment
// without closing them does (see tcpproxy). Both close when the test ends.
func Cuttable(t testing.TB, url string) (*pgxpool.Pool, *tcpproxy.Proxy) {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatalf("error parsing database URL: %v", err)
	}
	p, err := tcpproxy.Start(u.Host)
	if err != nil {
		t.Fatalf("error starting proxy: %v", err)
	}
	u.Host = p.Addr()
	q := u.Query()
	q.Set("pool_max_conns", "8") // the gateway's default (GATEWAY_DB_MAX_CONNS)
	u.RawQuery = q.Encode()
	pool := Connect(t, u.String())
	// Before the pool closes: a lost connection's close waits for the
	// server's, up to 15 s, unless the proxy ends it.
	t.Cleanup(func() { _ = p.Close() })
	return pool, p
}

// Unanswering returns the connection string of a server that accepts
// connections and never answers, as a frozen database, or one behind a
// network that drops its packets, does: every call on it lasts until its
// context ends.
func Unanswering(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("error listening: %v", err)
	}
	var mu sync.Mutex
	var held []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	})
	return fmt.Sprintf("postgres://postgres@%s/gateway?sslmode=disable", l.Addr())
}

func startServer() (pgtestdb.Config, func(), error) {
	for _, name := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if url := os.Getenv(name); url != "" {
			cfg, err := configFromURL(url)
			return cfg, nil, err
		}
	}
	if dockerAvailable() {
		return startContainer()
	}
	return startLocal()
}

func configFromURL(url string) (pgtestdb.Config, error) {
	pc, err := pgx.ParseConfig(url)
	if err != nil {
		return pgtestdb.Config{}, fmt.Errorf("error parsing database URL: %w", err)
	}
	return pgtestdb.Config{
		DriverName: "pgx",
		Host:       pc.Host,
		Port:       strconv.Itoa(int(pc.Port)),
		User:       pc.User,
		Password:   pc.Password,
		Database:   pc.Database,
		Options:    "sslmode=disable",
	}, nil
}

// dockerAvailable reports whether a Docker engine answers, without waiting long
// where there plainly is none.
func dockerAvailable() bool {
	if os.Getenv("DOCKER_HOST") == "" {
		if _, err := os.Stat("/var/run/docker.sock"); err != nil {
			return false
		}
	}
	provider, err := testcontainers.NewDockerProvider()
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return provider.Health(ctx) == nil
}

func startContainer() (pgtestdb.Config, func(), error) {
	ctx := context.Background()
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("postgres"), tcpostgres.WithUsername("postgres"), tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies())
	if err != nil {
		return pgtestdb.Config{}, nil, fmt.Errorf("error starting PostgreSQL container: %w", err)
	}
	url, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(c)
		return pgtestdb.Config{}, nil, err
	}
	cfg, err := configFromURL(url)
	return cfg, func() { _ = testcontainers.TerminateContainer(c) }, err
}

func startLocal() (pgtestdb.Config, func(), error) {
	dir, err := os.MkdirTemp("", "gateway-testpg-")
	if err == nil {
		err = os.Chmod(dir, 0o755) // the server's user must reach its folder inside
	}
	if err != nil {
		return pgtestdb.Config{}, nil, err
	}
	cluster, err := pglocal.Start(context.Background(), pglocal.Options{Dir: filepath.Join(dir, "pg")})
	if err != nil {
		_ = os.RemoveAll(dir)
		return pgtestdb.Config{}, nil, err
	}
	cfg := pgtestdb.Config{
		DriverName: "pgx",
		Host:       "127.0.0.1",
		Port:       strconv.Itoa(cluster.Port()),
		User:       "postgres",
		Database:   "postgres",
		Options:    "sslmode=disable",
	}
	return cfg, func() {
		_ = cluster.Stop()
		_ = os.RemoveAll(dir)
	}, nil
}
