package pglocal_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/pglocal"
)

// TestStopLeftover: a server left running in a cluster's folder (its process
// killed before it could stop it) is stopped, and a cluster starts there
// again, on its port; where none runs, nothing is stopped.
func TestStopLeftover(t *testing.T) {
	t.Parallel()
	ctx, dir := context.Background(), clusterDir(t)

	stopped, err := pglocal.StopLeftover(ctx, dir)
	require.NoError(t, err)
	require.False(t, stopped, "no cluster yet")

	left, err := pglocal.Start(ctx, pglocal.Options{Dir: dir})
	require.NoError(t, err)
	stopped, err = pglocal.StopLeftover(ctx, dir)
	require.NoError(t, err)
	require.True(t, stopped, "the server left running")

	again, err := pglocal.Start(ctx, pglocal.Options{Dir: dir, Port: left.Port()})
	require.NoError(t, err, "the folder and the port are free again")
	require.NoError(t, again.Stop())
	stopped, err = pglocal.StopLeftover(ctx, dir)
	require.NoError(t, err)
	require.False(t, stopped, "none runs")
}

// TestDataOfAnotherVersionIsNamed: a cluster whose data another major
// version of PostgreSQL made, whose binaries this machine lacks, is not
// started: the error names the folder, the version and what to do, instead
// of pg_ctl's "could not start server" and a log to read.
func TestDataOfAnotherVersionIsNamed(t *testing.T) {
	t.Parallel()
	ctx, dir := context.Background(), clusterDir(t)
	c, err := pglocal.Start(ctx, pglocal.Options{Dir: dir})
	require.NoError(t, err)
	require.NoError(t, c.Stop())
	data := filepath.Join(dir, "data")
	require.NoError(t, os.WriteFile(filepath.Join(data, "PG_VERSION"), []byte("99\n"), 0o600))

	_, err = pglocal.Start(ctx, pglocal.Options{Dir: dir})
	require.ErrorIs(t, err, pglocal.ErrOtherVersion)
	require.Contains(t, err.Error(), data+" was made by PostgreSQL 99")
	require.Contains(t, err.Error(), "install PostgreSQL 99, or remove the folder")
	_, err = pglocal.StopLeftover(ctx, dir)
	require.ErrorIs(t, err, pglocal.ErrOtherVersion)
}

// clusterDir is a folder for a test's cluster, in its temporary folder; the
// test is skipped where no PostgreSQL binaries are found.
func clusterDir(t *testing.T) string {
	t.Helper()
	if _, err := pglocal.FindBinaries(); err != nil {
		t.Skip(err)
	}
	tmp := t.TempDir()
	// As root, the server runs as postgres, which must reach the folder.
	require.NoError(t, os.Chmod(tmp, 0o755))
	require.NoError(t, os.Chmod(filepath.Dir(tmp), 0o755))
	return filepath.Join(tmp, "pg")
}
