package benchenv

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPaceMeasuresEachPart(t *testing.T) {
	t.Parallel()
	rt, err := wakeRoundTrip(100)
	require.NoError(t, err)
	require.Positive(t, rt, "a round trip takes time")
	require.Positive(t, syscallTime())
	require.Positive(t, hashTime())
	sync, err := syncTime(t.TempDir(), 3)
	require.NoError(t, err)
	require.Positive(t, sync, "a durable write takes time")
	_, err = syncTime(filepath.Join(t.TempDir(), "absent"), 3)
	require.ErrorContains(t, err, "error creating the file to sync")
	line := Pace("now")
	require.Regexp(t, `^machine pace now: 64 MiB hashed in \d+ ms, a system call [\d.]+ µs, a wake-up round trip between two threads [\d.]+ µs, an 8 KiB write and fsync \d+ µs \(median\)$`, line)
}
