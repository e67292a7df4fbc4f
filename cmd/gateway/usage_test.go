package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/store"
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

// TestPrintUsage: the report's table, `gateway usage` without --csv, has the
// CSV's columns in capitals, a line a row, and last the sums of every row,
// named total, each under its column.
func TestPrintUsage(t *testing.T) {
	t.Parallel()
	day := time.Date(2026, 11, 3, 0, 0, 0, 0, time.UTC)
	var out bytes.Buffer
	printUsage(&out, []store.UsageLine{
		{Account: "acme", Project: "web", Day: day, Model: "instant", EntryPoint: "responses", Requests: 3, InputRungs: 30, OutputRungs: 12, TotalRungs: 42},
		{Account: "acme", Project: "web", Day: day.AddDate(0, 0, 1), Model: "reasoning", EntryPoint: "batch", Requests: 100, InputRungs: 1000, OutputRungs: 2500, TotalRungs: 3500},
	})
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	var rows [][]string
	for _, line := range lines {
		rows = append(rows, strings.Fields(line))
	}
	require.Equal(t, [][]string{
		{"ACCOUNT", "PROJECT", "DAY", "MODEL", "ENTRY_POINT", "REQUESTS", "INPUT_RUNGS", "OUTPUT_RUNGS", "TOTAL_RUNGS"},
		{"acme", "web", "2026-11-03", "instant", "responses", "3", "30", "12", "42"},
		{"acme", "web", "2026-11-04", "reasoning", "batch", "100", "1000", "2500", "3500"},
		{"total", "103", "1030", "2512", "3542"},
	}, rows)
	header, total := lines[0], lines[3]
	for column, sum := range map[string]string{"REQUESTS": "103", "INPUT_RUNGS": "1030", "OUTPUT_RUNGS": "2512", "TOTAL_RUNGS": "3542"} {
		require.Equal(t, strings.Index(header, column), strings.Index(total, " "+sum)+1, "the sum of %s under it", column)
	}
}
