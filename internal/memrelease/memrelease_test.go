package memrelease

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestReleasesAfterAPeak(t *testing.T) {
	t.Parallel()
	n, frees := 0, 0
	at := time.Unix(0, 0)
	r := &Releaser{MinPeak: 1000, MinGap: time.Minute, count: func() int { return n }, free: func() { frees++ }, now: func() time.Time { return at }}
	for _, step := range []struct {
		after      time.Duration // since the previous step
		goroutines int
		released   bool
	}{
		{time.Second, 50, false},
		{time.Second, 900, false},  // a peak too small to act on
		{time.Second, 300, false},  //
		{time.Second, 5000, false}, // a peak
		{time.Second, 3000, false}, // not yet half
		{time.Second, 2400, true},  // half: released, and the peak starts over from here
		{time.Second, 2000, false}, // a peak of 2,400 has not halved
		{time.Second, 1100, false}, // it has, but the last release was a second ago
		{time.Minute, 1100, true},  // a minute on
		{time.Minute, 40, true},    // 1,100 was still a peak worth acting on
		{time.Minute, 20, false},   // 40 is not
		{time.Minute, 9000, false}, // a new peak
		{time.Second, 100, true},
	} {
		at = at.Add(step.after)
		n = step.goroutines
		require.Equal(t, step.released, r.check(), "at %d goroutines", n)
	}
	require.Equal(t, 4, frees)
}
