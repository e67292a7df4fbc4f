package apitest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRepliesMayCarryOnlyListedCodes: the document leaves its error codes
// open to clients (x-extensible-enum), but the replies the tests validate
// must carry a listed one.
func TestRepliesMayCarryOnlyListedCodes(t *testing.T) {
	t.Parallel()
	loadOnce.Do(load)
	require.NoError(t, loadErr)
	codes := doc.Components.Schemas["ErrorCode"].Value
	require.NoError(t, codes.VisitJSON("INVALID_REQUEST"))
	require.Error(t, codes.VisitJSON("A_NEWER_CODE"))
}
