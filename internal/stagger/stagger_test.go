package stagger_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/stagger"
)

// TestLeadsAreSpreadOverTheFirstHalf: the leads of many ids fall in (lead/2,
// lead], from near one end to near the other; an id's lead is the same at
// each call.
func TestLeadsAreSpreadOverTheFirstHalf(t *testing.T) {
	t.Parallel()
	const lead = 5 * time.Minute
	var least, most time.Duration = lead, 0
	for range 1000 {
		id := uuid.Must(uuid.NewV7())
		d := stagger.Lead(id, lead)
		require.Greater(t, d, lead/2)
		require.LessOrEqual(t, d, lead)
		require.Equal(t, d, stagger.Lead(id, lead))
		least, most = min(least, d), max(most, d)
	}
	require.Less(t, least, lead*51/100)
	require.Greater(t, most, lead*99/100)
}

// TestALeadOfNothing: a lead too short to halve is the lead itself.
func TestALeadOfNothing(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7())
	require.Equal(t, time.Duration(1), stagger.Lead(id, 1))
	require.Equal(t, time.Duration(0), stagger.Lead(id, 0))
}
