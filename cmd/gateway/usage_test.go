package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestReportDays: the report covers whole UTC days, both ends included; by
// default from the first of the month to today.
func TestReportDays(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 25, 23, 30, 0, 0, time.FixedZone("UTC-2", -2*3600)) // 2026-11-26 01:30 UTC
	day := func(m time.Month, d int) time.Time { return time.Date(2026, m, d, 0, 0, 0, 0, time.UTC) }
	for _, tc := range []struct {
		from, to   string
		start, end time.Time
		err        string
	}{
		{start: day(11, 1), end: day(11, 27)},
		{from: "2026-10-15", start: day(10, 15), end: day(11, 27)},
		{from: "2026-11-03", to: "2026-11-03", start: day(11, 3), end: day(11, 4)},
		{from: "2026-11-04", to: "2026-11-03", err: "--to is before --from"},
		{from: "11/03/2026", err: `--from: want a day as YYYY-MM-DD, got "11/03/2026"`},
		{to: "yesterday", err: `--to: want a day as YYYY-MM-DD, got "yesterday"`},
	} {
		start, end, err := reportDays(tc.from, tc.to, now)
		if tc.err != "" {
			require.EqualError(t, err, tc.err)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, tc.start, start, "from %q", tc.from)
		require.Equal(t, tc.end, end, "to %q", tc.to)
	}
}
