package benchenv

import (
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
	line := Pace("now")
	require.Regexp(t, `^machine pace now: 64 MiB hashed in \d+ ms, a system call [\d.]+ µs, a wake-up round trip between two threads [\d.]+ µs$`, line)
}
