package ratelimit

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestUntilAdmitted(t *testing.T) {
	t.Parallel()
	minute := time.Date(2026, 11, 29, 5, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		name                     string
		at                       time.Duration // into the minute
		limit, previous, current int
		next                     int // leased ahead
		want                     time.Duration
	}{
		// 6 counted this minute: the next admits one once they weigh 5.
		{"a burst early in a minute", 2 * time.Second, 6, 0, 6, 0, 58*time.Second + 10*time.Second},
		{"a burst late in a minute", 59*time.Second + 700*time.Millisecond, 6, 0, 6, 0, 300*time.Millisecond + 10*time.Second},
		// 6 in the minute before and 1 in this one: 4 of room once 6 weigh 4.
		{"the minute before weighs", 10 * time.Second, 6, 6, 1, 0, 10 * time.Second},
		{"both weigh", 30 * time.Second, 60, 60, 60, 0, 30*time.Second + time.Second},
		{"a limit of one", 15 * time.Second, 1, 0, 1, 0, 45*time.Second + 60*time.Second},
		{"admissible by now: a second, the least Retry-After says", 50 * time.Second, 6, 6, 1, 0, time.Second},
		// 4 this minute and 2 of the next leased ahead: none before the next
		// minute, where the 4 must weigh 3.
		{"the next minute leased ahead", 55 * time.Second, 6, 0, 4, 2, 5*time.Second + 15*time.Second},
		// 3 leased ahead of the next minute leave it room once 4 weigh 2.
		{"more of the next minute leased ahead", 55 * time.Second, 6, 0, 4, 3, 5*time.Second + 30*time.Second},
		// 3 this minute and 2 leased ahead leave this minute room for one, at
		// the bound, once the 6 of the minute before weigh 2.
		{"the next minute leased ahead to the bound", 10 * time.Second, 6, 6, 3, 2, 30 * time.Second},
		// 6 leased ahead fill the next minute: in the one after, once they
		// weigh 5.
		{"the next minute full", 58 * time.Second, 6, 0, 0, 6, 2*time.Second + time.Minute + 10*time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tt.want, untilAdmitted(minute.Add(tt.at), tt.limit, tt.previous, tt.current, tt.next))
		})
	}
}
