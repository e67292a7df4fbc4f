package filestamp

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestAStampChangesWithItsFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	one, two := filepath.Join(dir, "one"), filepath.Join(dir, "two")
	require.NoError(t, os.WriteFile(one, []byte("first"), 0o600))
	before := Of(one, two)
	require.True(t, before.Equal(Of(one, two)), "nothing changed")

	require.NoError(t, os.WriteFile(two, []byte("there now"), 0o600))
	now := Of(one, two)
	require.False(t, now.Equal(before), "a file come")

	// Rewritten with as many bytes, later.
	require.NoError(t, os.WriteFile(one, []byte("again"), 0o600))
	later := time.Now().Add(time.Second)
	require.NoError(t, os.Chtimes(one, later, later))
	require.False(t, Of(one, two).Equal(now), "a file rewritten")
	now = Of(one, two)

	require.NoError(t, os.Remove(two))
	require.False(t, Of(one, two).Equal(now), "a file gone")
	require.False(t, Of(one).Equal(now), "other files")
}
