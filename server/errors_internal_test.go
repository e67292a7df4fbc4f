package server

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/openapi"
)

// TestErrorCodesMatchTheContract keeps the domain codes, the status table and
// the document's ErrorCode enum the same set.
func TestErrorCodesMatchTheContract(t *testing.T) {
	t.Parallel()
	var doc struct {
		Components struct {
			Schemas struct {
				ErrorCode struct {
					Enum []string `json:"enum"`
				} `json:"ErrorCode"`
			} `json:"schemas"`
		} `json:"components"`
	}
	raw, err := yaml.YAMLToJSON(openapi.YAML())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &doc))

	codes := make([]string, len(gateway.ErrorCodes))
	for i, c := range gateway.ErrorCodes {
		codes[i] = string(c)
		require.Contains(t, statusOf, c, "status of %s", c)
	}
	require.Equal(t, doc.Components.Schemas.ErrorCode.Enum, codes)
	require.Len(t, statusOf, len(codes))
}
