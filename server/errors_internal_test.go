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
// the document's ErrorCode values (an extensible enum: x-extensible-enum, and
// no enum that a generated client would enforce) the same set.
func TestErrorCodesMatchTheContract(t *testing.T) {
	t.Parallel()
	var doc struct {
		Components struct {
			Schemas struct {
				ErrorCode struct {
					Enum       []string `json:"enum"`
					Extensible []string `json:"x-extensible-enum"`
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
	require.Nil(t, doc.Components.Schemas.ErrorCode.Enum, "a closed enum: a client that validates it would refuse a newer code")
	require.Equal(t, doc.Components.Schemas.ErrorCode.Extensible, codes)
	require.Len(t, statusOf, len(codes))
}
