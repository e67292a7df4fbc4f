package store

import (
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// TestSuccessor: the id after another, in the order PostgreSQL sorts uuids,
// carries into the bytes before its last, up to the first; the id after
// the last is the first (a pass starts over).
func TestSuccessor(t *testing.T) {
	t.Parallel()
	for id, want := range map[string]string{
		"00000000-0000-0000-0000-000000000000": "00000000-0000-0000-0000-000000000001",
		"00000000-0000-0000-0000-0000000001ff": "00000000-0000-0000-0000-000000000200",
		"00000000-0000-0000-00ff-ffffffffffff": "00000000-0000-0000-0100-000000000000",
		"00ffffff-ffff-ffff-ffff-ffffffffffff": "01000000-0000-0000-0000-000000000000",
		"ffffffff-ffff-ffff-ffff-ffffffffffff": "00000000-0000-0000-0000-000000000000",
	} {
		require.Equal(t, uuid.MustParse(want), successor(uuid.MustParse(id)), id)
	}
}

// TestResumeMark: a run reads from where the last one stopped, less the
// skew; a run that fails moves nothing and says so.
func TestResumeMark(t *testing.T) {
	t.Parallel()
	var m resumeMark
	stopped := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	var from []time.Time
	step := func(err error) func(time.Time) (int64, time.Time, error) {
		return func(f time.Time) (int64, time.Time, error) {
			from = append(from, f)
			return 3, stopped, err
		}
	}
	n, err := m.run(step(nil))
	require.NoError(t, err)
	require.Equal(t, int64(3), n)
	failed := errors.New("database away")
	_, err = m.run(step(failed))
	require.ErrorIs(t, err, failed)
	stopped = stopped.Add(time.Hour)
	_, err = m.run(step(nil))
	require.NoError(t, err)
	require.Equal(t, []time.Time{{}, stopped.Add(-time.Hour - markSkew), stopped.Add(-time.Hour - markSkew)}, from,
		"from the start, then from the first stop less the skew, twice: the failed run moved nothing")
	_, err = m.run(step(nil))
	require.NoError(t, err)
	require.Equal(t, stopped.Add(-markSkew), from[3])
}
