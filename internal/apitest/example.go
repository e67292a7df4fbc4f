package apitest

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway/openapi"
)

// Example returns the part of the OpenAPI document at pointer, a JSON
// pointer (RFC 6901: "/components/responses/X/…", "~1" for "/"), as JSON: a
// test holds an example the document shows to what the code sends.
func Example(t testing.TB, pointer string) json.RawMessage {
	t.Helper()
	raw, err := yaml.YAMLToJSON(openapi.YAML())
	require.NoError(t, err)
	var at any
	require.NoError(t, json.Unmarshal(raw, &at))
	for _, token := range strings.Split(strings.TrimPrefix(pointer, "/"), "/") {
		token = strings.NewReplacer("~1", "/", "~0", "~").Replace(token)
		switch node := at.(type) {
		case map[string]any:
			v, ok := node[token]
			require.True(t, ok, "the document has nothing at %s (%q)", pointer, token)
			at = v
		case []any:
			i, err := strconv.Atoi(token)
			require.NoError(t, err, "%s: %q indexes a list", pointer, token)
			require.Less(t, i, len(node), "%s: the list is shorter", pointer)
			at = node[i]
		default:
			require.FailNow(t, "the document has no "+pointer, "%q is in a %T", token, node)
		}
	}
	out, err := json.Marshal(at)
	require.NoError(t, err)
	return out
}
