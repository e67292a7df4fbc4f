package pglocal

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBinariesOfTheDataVersion: of several PostgreSQL versions installed, a
// cluster's data runs on the binaries of the version that made it (found by
// pg_ctl --version where the folder's name does not say); data not made
// yet on the first found; data of a version not installed is refused,
// naming those found. Not parallel: it puts a PostgreSQL 99 first on PATH.
func TestBinariesOfTheDataVersion(t *testing.T) {
	installed, err := FindBinaries()
	if err != nil {
		t.Skip(err)
	}
	fake := filepath.Join(t.TempDir(), "pg", "bin")
	require.NoError(t, os.MkdirAll(fake, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(fake, "pg_ctl"), []byte("#!/bin/sh\necho 'pg_ctl (PostgreSQL) 99.1'\n"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(fake, "initdb"), []byte("#!/bin/sh\n"), 0o755))
	t.Setenv("PATH", fake+string(os.PathListSeparator)+os.Getenv("PATH"))

	dir, err := binariesFor("data", 99)
	require.NoError(t, err)
	require.Equal(t, fake, dir)
	dir, err = binariesFor("data", binaryVersion(installed))
	require.NoError(t, err)
	require.Equal(t, installed, dir)
	dir, err = binariesFor("data", 0)
	require.NoError(t, err)
	require.Equal(t, fake, dir, "PATH's first")
	_, err = binariesFor("data", 98)
	require.ErrorIs(t, err, ErrOtherVersion)
	require.Contains(t, err.Error(), "the binaries found are of 99, ")
}
