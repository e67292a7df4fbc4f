package server

import (
	"encoding/json"
	"strconv"
	"strings"
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

// TestErrorExamplesHaveTheirStatus: an error the document shows as an
// example of an error reply has the status of that reply.
func TestErrorExamplesHaveTheirStatus(t *testing.T) {
	t.Parallel()
	type reply struct {
		Ref     string `json:"$ref"`
		Content map[string]struct {
			Examples map[string]struct {
				Value json.RawMessage `json:"value"`
			} `json:"examples"`
		} `json:"content"`
	}
	var doc struct {
		Paths      map[string]map[string]struct{ Responses map[string]reply } `json:"paths"`
		Components struct {
			Responses map[string]reply `json:"responses"`
		} `json:"components"`
	}
	raw, err := yaml.YAMLToJSON(openapi.YAML())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &doc))
	shown := 0
	for route, ops := range doc.Paths {
		for method, op := range ops {
			for status, r := range op.Responses {
				code, err := strconv.Atoi(status)
				require.NoError(t, err, "%s %s: a status, not %q", method, route, status)
				if code < 400 {
					continue // a reply's own error field (a batch's) is no error reply
				}
				if r.Ref != "" {
					r = doc.Components.Responses[strings.TrimPrefix(r.Ref, "#/components/responses/")]
				}
				for name, e := range r.Content["application/json"].Examples {
					var v struct {
						Error *struct {
							Code gateway.ErrorCode `json:"code"`
						} `json:"error"`
					}
					require.NoError(t, json.Unmarshal(e.Value, &v))
					if v.Error == nil {
						continue
					}
					require.Equal(t, code, statusFor(v.Error.Code), "%s %s %s: example %s", method, route, status, name)
					shown++
				}
			}
		}
	}
	require.NotZero(t, shown)
}
