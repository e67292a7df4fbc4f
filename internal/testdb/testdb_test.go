package testdb

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestUntilTheDayTurns(t *testing.T) {
	t.Parallel()
	at := func(clock string) time.Time {
		tm, err := time.Parse(time.RFC3339Nano, "2026-11-24T"+clock+"Z")
		require.NoError(t, err)
		return tm
	}
	require.Zero(t, untilTheDayTurns(at("12:00:00")))
	require.Zero(t, untilTheDayTurns(at("00:00:00")))
	require.Zero(t, untilTheDayTurns(at("23:58:59.5")))
	require.Equal(t, 61*time.Second, untilTheDayTurns(at("23:59:00")))
	require.Equal(t, 1500*time.Millisecond, untilTheDayTurns(at("23:59:59.5")))
	paris := at("23:59:30").In(time.FixedZone("CET", 3600))
	require.Equal(t, 31*time.Second, untilTheDayTurns(paris), "the UTC day, whatever the zone")
}
