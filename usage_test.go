package gateway_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
)

// TestCheckUsagePeriod: a usage period's ends older than the request
// retention (less its margin) must be whole hours; newer ones, or any with
// requests kept for good, may be anything.
func TestCheckUsagePeriod(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 3, 12, 0, 30, 0, time.UTC)
	retention := 90 * 24 * time.Hour
	old := now.Add(-retention).Truncate(time.Hour) // past the retention, on an hour
	recent := now.Add(-retention + gateway.RetentionMargin + time.Second)
	for name, c := range map[string]struct {
		start, end time.Time
		retention  time.Duration
		problem    string
	}{
		"whole hours":              {start: old.Add(-time.Hour), end: old, retention: retention},
		"recent ends":              {start: recent, end: now, retention: retention},
		"start inside an hour":     {start: old.Add(time.Minute), end: now, retention: retention, problem: "start: usage older than 90 days (the request retention) is kept by the hour; give a time on a whole hour"},
		"end inside an hour":       {start: old.Add(-time.Hour), end: old.Add(time.Microsecond), retention: retention, problem: "end: usage older than 90 days"},
		"within the margin":        {start: now.Add(-retention + time.Second), end: now, retention: retention, problem: "start: usage older than 90 days"},
		"hours, not days":          {start: now.Add(-30 * time.Hour), end: now, retention: 25 * time.Hour, problem: "start: usage older than 25h0m0s"},
		"requests kept for good":   {start: old.Add(time.Second), end: old.Add(time.Minute + time.Second)},
		"a period in another zone": {start: old.In(time.FixedZone("", 5*3600+1800)), end: now, retention: retention},
	} {
		err := gateway.CheckUsagePeriod(c.start, c.end, now, c.retention)
		if c.problem == "" {
			require.NoError(t, err, name)
			continue
		}
		require.Equal(t, gateway.EInvalidRequest, gateway.ErrorCodeOf(err), name)
		require.ErrorContains(t, err, c.problem, name)
	}
}
