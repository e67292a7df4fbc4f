package inference

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSettlementOutcome: a settlement's span names how it ended, from a fixed
// set; an outcome that may be stored is never called refused.
func TestSettlementOutcome(t *testing.T) {
	t.Parallel()
	away := errors.New("connection refused")
	unavailable := func(err error) bool { return errors.Is(err, away) }
	require.Empty(t, settlementOutcome(nil, false, unavailable))
	require.Equal(t, "unconfirmed", settlementOutcome(away, true, unavailable))
	require.Equal(t, "unavailable", settlementOutcome(away, false, unavailable))
	require.Equal(t, "refused", settlementOutcome(errors.New("check violation"), false, unavailable))
}
