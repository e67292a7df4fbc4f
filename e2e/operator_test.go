package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// reachableTempDir is a temporary folder the postgres user can enter, for
// tests run as root.
func reachableTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gateway-operator-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}

// TestOperatorFirstHour walks a newcomer's first operator steps: the dev
// banner names the database, keys and limits find it from the same folder,
// limits name what is missing, and a port in use is named with what moves it.
func TestOperatorFirstHour(t *testing.T) {
	t.Parallel()
	dir := reachableTempDir(t)
	g := start(t, map[string]string{"GATEWAY_SIM_TOKEN_LATENCY": "0s"}, "dev", "--data", filepath.Join(dir, ".gateway"), "--pg-port", "0")
	line := waitForLine(t, g.stdout, "Database:")
	url := strings.TrimSpace(strings.TrimPrefix(line, "Database:"))
	require.True(t, strings.HasPrefix(url, "postgres://"), line)

	key, stderr, err := cliIn(t, dir, nil, "keys", "create", "--account", "second")
	require.NoError(t, err, stderr)
	require.Regexp(t, `^igw_`, key)
	require.Contains(t, stderr, "using the dev database")

	_, stderr, err = cliIn(t, dir, nil, "limits", "set", "--account", "second", "--project", "nosuch", "--budget-rungs", "5")
	require.Error(t, err)
	require.Contains(t, stderr, `no such project "nosuch" in account "second"`)
	_, stderr, err = cliIn(t, dir, nil, "limits", "set", "--account", "nosuch", "--daily-rungs", "5")
	require.Error(t, err)
	require.Contains(t, stderr, `no such account "nosuch"`)
	_, stderr, err = cliIn(t, dir, nil, "limits", "set", "--account", "second", "--budget-rungs", "5")
	require.NoError(t, err, stderr)

	_, stderr, err = cliIn(t, t.TempDir(), nil, "keys", "create", "--account", "x")
	require.Error(t, err)
	require.Contains(t, stderr, "DATABASE_URL is required")
	help, _, err := cliIn(t, dir, nil, "limits", "set", "--help")
	require.NoError(t, err)
	require.Contains(t, help, "DATABASE_URL")

	// A second checkout on the same ports: each clash is named with what moves it.
	pgPort := strings.TrimPrefix(url[strings.LastIndex(url, ":"):], ":")
	pgPort = pgPort[:strings.Index(pgPort, "/")]
	_, stderr, err = cliIn(t, reachableTempDir(t), nil, "dev", "--pg-port", pgPort)
	require.Error(t, err)
	require.Contains(t, stderr, "127.0.0.1:"+pgPort)
	require.Contains(t, stderr, "--pg-port")

	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	for variable, env := range map[string]map[string]string{
		"GATEWAY_LISTEN":         {"DATABASE_URL": url, "GATEWAY_LISTEN": l.Addr().String(), "GATEWAY_METRICS_LISTEN": "off"},
		"GATEWAY_METRICS_LISTEN": {"DATABASE_URL": url, "GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_METRICS_LISTEN": l.Addr().String()},
	} {
		_, stderr, err = cliIn(t, dir, env, "serve")
		require.Error(t, err, variable)
		require.Contains(t, stderr, l.Addr().String(), variable)
		require.Contains(t, stderr, variable)
	}

	require.NoError(t, g.cmd.Process.Signal(syscall.SIGINT))
	require.NoError(t, <-g.done, fmt.Sprint(g.stderr.String()))
	g.done <- nil
	_, stderr, err = cliIn(t, dir, nil, "keys", "create", "--account", "third")
	require.Error(t, err)
	require.Contains(t, stderr, "is gateway dev (make run) running?")
}
