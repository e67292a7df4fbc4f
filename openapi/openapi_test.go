package openapi_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway/openapi"
)

func TestJSONIsTheYAMLDocument(t *testing.T) {
	t.Parallel()
	js, err := openapi.JSON()
	require.NoError(t, err)
	var fromJSON, fromYAML map[string]any
	require.NoError(t, json.Unmarshal(js, &fromJSON))
	require.NoError(t, yaml.Unmarshal(openapi.YAML(), &fromYAML))
	require.Equal(t, fromYAML, fromJSON)
	require.Equal(t, "3.0.3", fromJSON["openapi"])
}

func TestJSONSchemaIsDerivedFromComponents(t *testing.T) {
	t.Parallel()
	raw, err := openapi.JSONSchema()
	require.NoError(t, err)
	var schema map[string]any
	require.NoError(t, json.Unmarshal(raw, &schema))
	require.Equal(t, "https://json-schema.org/draft/2020-12/schema", schema["$schema"])

	var doc map[string]any
	require.NoError(t, yaml.Unmarshal(openapi.YAML(), &doc))
	components := doc["components"].(map[string]any)["schemas"].(map[string]any)
	defs := schema["$defs"].(map[string]any)
	require.Len(t, defs, len(components), "every component schema is a $def")

	usage := defs["Usage"].(map[string]any)["properties"].(map[string]any)
	require.Equal(t, []any{"integer", "null"}, usage["regions_activated"].(map[string]any)["type"])
	require.NotContains(t, string(raw), "nullable")
	rungs := defs["ResponseRequest"].(map[string]any)["properties"].(map[string]any)["max_output_rungs"].(map[string]any)
	require.NotContains(t, rungs, "format", "uint64 is no format a validator knows")
	require.Equal(t, "integer", rungs["type"])
	require.Equal(t, "date-time", defs["Batch"].(map[string]any)["properties"].(map[string]any)["created_at"].(map[string]any)["format"])
	require.NotContains(t, string(raw), "#/components/")
	codes := defs["ErrorCode"].(map[string]any)
	require.NotContains(t, codes, "enum", "a code newer than the document still validates")
	require.Equal(t, components["ErrorCode"].(map[string]any)["x-extensible-enum"], codes["examples"], "the codes are named")

	// Every reference resolves inside $defs.
	for _, part := range strings.Split(string(raw), `"#/$defs/`)[1:] {
		name := part[:strings.IndexByte(part, '"')]
		require.Contains(t, defs, name)
	}
}

func TestPolicies(t *testing.T) {
	t.Parallel()
	policies, err := openapi.Policies()
	require.NoError(t, err)
	require.Len(t, policies, 14, "the twelve routes of the interface and the two health checks")

	require.True(t, policies["getOpenAPI"].Public)
	require.True(t, policies["getJSONSchema"].Public)
	require.True(t, policies["getHealth"].Public)
	require.True(t, policies["getReadiness"].Public)
	require.Equal(t, "/api/v1/batch/{batch_id}", policies["getBatch"].Path)
	for _, id := range []string{"createBatch", "getBatch", "getBatchResults", "cancelBatch", "listBatches"} {
		require.Equal(t, "developer", policies[id].Tier, id)
		require.Equal(t, []string{"inference"}, policies[id].AnyScope, id)
	}
	for _, id := range []string{"createResponse", "createChat", "getSources", "getResponseSources"} {
		require.False(t, policies[id].Public, id)
		require.Empty(t, policies[id].Tier, id)
		require.Equal(t, []string{"inference"}, policies[id].AnyScope, id)
	}
	require.ElementsMatch(t, []string{"inference", "usage"}, policies["getUsage"].AnyScope)
	require.Equal(t, int64(1<<20), policies["createResponse"].MaxBodyBytes)
	require.Equal(t, int64(1<<20), policies["createChat"].MaxBodyBytes)
	require.Equal(t, int64(16<<20), policies["createBatch"].MaxBodyBytes)
	for id, p := range policies {
		require.Equal(t, id == "createResponse" || id == "createChat", p.Streams, id)
		require.Equal(t, id == "createBatch", p.InTurns, id)
	}
	require.ElementsMatch(t, []string{"start", "end"}, policies["getUsage"].Query)
	require.ElementsMatch(t, []string{"limit", "after"}, policies["listBatches"].Query)
	require.Empty(t, policies["getBatch"].Query, "a path parameter is not a query one")
}
