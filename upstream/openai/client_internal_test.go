package openai

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/upstream"
)

// TestNewFillsItsDefaults: what the configuration leaves zero takes its
// default, over either transport; what it sets is kept.
func TestNewFillsItsDefaults(t *testing.T) {
	t.Parallel()
	for _, base := range []string{"http://127.0.0.1:1/v1", "https://127.0.0.1:1/v1"} {
		c := New(Config{BaseURL: base})
		require.Equal(t, []time.Duration{120 * time.Second, defaultStreamLimit, defaultPingAfter},
			[]time.Duration{c.cfg.Timeout, c.cfg.StreamLimit, c.cfg.PingAfter}, base)
		c = New(Config{BaseURL: base, Timeout: time.Second, StreamLimit: time.Minute, PingAfter: 2 * time.Second})
		require.Equal(t, []time.Duration{time.Second, time.Minute, 2 * time.Second},
			[]time.Duration{c.cfg.Timeout, c.cfg.StreamLimit, c.cfg.PingAfter}, base)
	}
}

// TestReadReplyHoldsItsBound: a reply as long as its bound is read whole; a
// byte more fails, whether the first part or the rest holds it.
func TestReadReplyHoldsItsBound(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		first, rest string
		err         bool
	}{
		{first: "0123", rest: "456789"},
		{first: "0123", rest: "4567890", err: true},
		{first: "0123456789"},
		{first: "0123456789a", err: true},
	} {
		got, err := readReply([]byte(tc.first), strings.NewReader(tc.rest), 4, 10)
		if tc.err {
			require.ErrorIs(t, err, upstream.ErrTooLong, tc)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, tc.first+tc.rest, string(got))
	}
}
