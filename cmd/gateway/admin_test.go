package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestParseExpiry: --expires takes a time from now or a time.
func TestParseExpiry(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	for v, want := range map[string]time.Time{
		"90d":                  now.AddDate(0, 0, 90),
		"12h":                  now.Add(12 * time.Hour),
		"30m":                  now.Add(30 * time.Minute),
		"2027-01-31":           time.Date(2027, 1, 31, 0, 0, 0, 0, time.UTC),
		"2027-01-31T12:00:00Z": time.Date(2027, 1, 31, 12, 0, 0, 0, time.UTC),
	} {
		got, err := parseExpiry(v, now)
		require.NoError(t, err, v)
		require.True(t, want.Equal(got), "%s: %v, want %v", v, got, want)
	}
	for _, v := range []string{"", "soon", "0d", "-3d", "-1h", "99999999d", "31/01/2027"} {
		_, err := parseExpiry(v, now)
		require.ErrorContains(t, err, "want a time from now", v)
	}
}

// TestParseSpan: --grace takes days or a duration, zero included.
func TestParseSpan(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]time.Duration{"7d": 7 * 24 * time.Hour, "0d": 0, "12h": 12 * time.Hour, "0s": 0, "90m": 90 * time.Minute} {
		got, err := parseSpan(v)
		require.NoError(t, err, v)
		require.Equal(t, want, got, v)
	}
	for _, v := range []string{"", "-1d", "-1h", "1.5d", "36501d", "a week"} {
		_, err := parseSpan(v)
		require.ErrorContains(t, err, "want days (7d) or a duration", v)
	}
}
