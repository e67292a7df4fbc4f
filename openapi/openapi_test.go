package openapi_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/apitest"
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

// exampleTypes are the generated types of the schemas the document's
// examples show: what the gateway decodes (requests) or encodes (replies).
var exampleTypes = map[string]func() any{
	"ResponseRequest": func() any { return new(api.ResponseRequest) },
	"Response":        func() any { return new(api.Response) },
	"Sources":         func() any { return new(api.Sources) },
	"Batch":           func() any { return new(api.Batch) },
	"BatchRequest":    func() any { return new(api.BatchRequest) },
	"BatchResults":    func() any { return new(api.BatchResults) },
	"BatchList":       func() any { return new(api.BatchList) },
	"UsageView":       func() any { return new(api.UsageView) },
	"ErrorEnvelope":   func() any { return new(api.ErrorEnvelope) },
	"StreamChunk":     func() any { return new(api.StreamChunk) },
}

// requireSentAsShown fails t unless example decodes into the generated type
// of schema with no field it does not know, and encodes back to itself: an
// example is what the gateway sends, field for field (a null included).
func requireSentAsShown(t *testing.T, where, schema string, example []byte) {
	t.Helper()
	newValue, ok := exampleTypes[schema]
	require.True(t, ok, "%s: an example of %s, whose type the test does not know", where, schema)
	v := newValue()
	dec := json.NewDecoder(bytes.NewReader(example))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(v), "%s: %s", where, example)
	again, err := json.Marshal(v)
	require.NoError(t, err)
	require.JSONEq(t, string(example), string(again), where)
}

// TestExamplesAreWhatTheGatewaySends: every example of the document (of a
// request body, a reply, a stream) is a payload of the generated types as
// they encode, so the examples a reader copies cannot drift from the API.
// Their validity against the schemas is make lint's (Spectral's
// oas3-valid-media-example).
func TestExamplesAreWhatTheGatewaySends(t *testing.T) {
	t.Parallel()
	var doc map[string]any
	require.NoError(t, yaml.Unmarshal(openapi.YAML(), &doc))
	checked := map[string]int{}
	var walk func(where string, node any)
	walk = func(where string, node any) {
		switch n := node.(type) {
		case []any:
			for i, v := range n {
				walk(fmt.Sprintf("%s[%d]", where, i), v)
			}
		case map[string]any:
			if examples, ok := n["examples"].(map[string]any); ok && n["schema"] != nil {
				schema := n["schema"].(map[string]any)
				for name, e := range examples {
					at := where + ".examples." + name
					value := e.(map[string]any)["value"]
					if ref, ok := schema["$ref"].(string); ok {
						raw, err := json.Marshal(value)
						require.NoError(t, err)
						requireSentAsShown(t, at, path.Base(ref), raw)
						checked[path.Base(ref)]++
						continue
					}
					require.True(t, strings.HasSuffix(where, "text/event-stream"), "%s: an example of an inline schema", at)
					stream := apitest.ParseEvents(t, strings.NewReader(value.(string)))
					apitest.ValidateEvents(t, stream)
					require.NotEmpty(t, stream.Events, at)
					for i, ev := range stream.Events {
						schema := "StreamChunk"
						if ev.Name == "response.error" {
							schema = "ErrorEnvelope"
						}
						requireSentAsShown(t, fmt.Sprintf("%s event %d", at, i), schema, ev.Data)
					}
					checked["text/event-stream"]++
				}
			}
			for k, v := range n {
				walk(where+"."+k, v)
			}
		}
	}
	walk("", doc)
	for _, shown := range []string{"ResponseRequest", "Response", "text/event-stream", "Sources", "Batch", "BatchRequest", "BatchResults", "BatchList", "UsageView", "ErrorEnvelope"} {
		require.NotZero(t, checked[shown], "the document shows an example of %s", shown)
	}
}
