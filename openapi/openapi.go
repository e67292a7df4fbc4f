// Package openapi embeds the gateway's OpenAPI document, the source of truth of
// its public interface, and derives from it what the server serves and enforces:
// the document as JSON, a JSON Schema of the payloads, and each operation's
// access policy.
package openapi

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"

	"sigs.k8s.io/yaml"
)

//go:embed openapi.yaml
var document []byte

// YAML returns the document as written.
func YAML() []byte { return document }

var (
	parseOnce sync.Once
	parsed    map[string]any
	asJSON    []byte
	schema    []byte
	parseErr  error
)

func parse() {
	asJSON, parseErr = yaml.YAMLToJSON(document)
	if parseErr != nil {
		parseErr = fmt.Errorf("error converting openapi.yaml to JSON: %w", parseErr)
		return
	}
	if parseErr = json.Unmarshal(asJSON, &parsed); parseErr != nil {
		parseErr = fmt.Errorf("error decoding openapi document: %w", parseErr)
		return
	}
	schema, parseErr = json.Marshal(jsonSchema(parsed))
	if parseErr != nil {
		parseErr = fmt.Errorf("error encoding JSON Schema: %w", parseErr)
	}
}

// JSON returns the document as JSON.
func JSON() ([]byte, error) {
	parseOnce.Do(parse)
	return asJSON, parseErr
}

// JSONSchema returns a JSON Schema (draft 2020-12) whose $defs are the document's
// components.schemas translated from OpenAPI 3.0: nullable becomes a "null"
// type, references point into $defs, an x-extensible-enum's values (the
// error codes, a set that grows) become examples, which constrain nothing,
// and OpenAPI-only keywords are dropped.
func JSONSchema() ([]byte, error) {
	parseOnce.Do(parse)
	return schema, parseErr
}

func jsonSchema(doc map[string]any) map[string]any {
	components, _ := doc["components"].(map[string]any)
	schemas, _ := components["schemas"].(map[string]any)
	defs := make(map[string]any, len(schemas))
	names := make([]string, 0, len(schemas))
	for name, s := range schemas {
		defs[name] = translate(s)
		names = append(names, name)
	}
	sort.Strings(names)
	anyOf := make([]any, len(names))
	for i, name := range names {
		anyOf[i] = map[string]any{"$ref": "#/$defs/" + name}
	}
	info, _ := doc["info"].(map[string]any)
	return map[string]any{
		"$schema":     "https://json-schema.org/draft/2020-12/schema",
		"$id":         "/api/schema.json",
		"title":       fmt.Sprintf("%v payloads", info["title"]),
		"description": "Request and reply payloads of the API, derived from components.schemas of /openapi.json. Validate a payload against one of $defs.",
		"$defs":       defs,
		"anyOf":       anyOf,
	}
}

// openAPIOnly are OpenAPI 3.0 schema keywords with no JSON Schema meaning.
var openAPIOnly = map[string]bool{"nullable": true, "discriminator": true, "xml": true, "externalDocs": true, "example": true}

// knownFormats are the formats JSON Schema 2020-12 defines and OpenAPI's data
// types add (int32, int64, ...), which validators that assert formats know
// (Ajv with ajv-formats). Any other (uint64, which the document gives for the
// code generator) is left out of the JSON Schema: such a validator refuses a
// schema naming a format it does not know, and the type and bounds say the
// rest.
var knownFormats = map[string]bool{
	"date-time": true, "date": true, "time": true, "duration": true, "email": true, "hostname": true,
	"ipv4": true, "ipv6": true, "uri": true, "uri-reference": true, "uri-template": true, "uuid": true,
	"json-pointer": true, "relative-json-pointer": true, "regex": true,
	"int32": true, "int64": true, "float": true, "double": true, "byte": true, "binary": true, "password": true,
}

func translate(v any) any {
	switch t := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, val := range t {
			switch {
			case k == "$ref":
				ref, _ := val.(string)
				out[k] = strings.Replace(ref, "#/components/schemas/", "#/$defs/", 1)
			case openAPIOnly[k]:
			case strings.HasPrefix(k, "x-"):
			case k == "format" && isUnknownFormat(val):
			default:
				out[k] = translate(val)
			}
		}
		if ex, ok := t["example"]; ok {
			out["examples"] = []any{ex}
		}
		if values, ok := t["x-extensible-enum"].([]any); ok {
			out["examples"] = values
		}
		if nullable, _ := t["nullable"].(bool); nullable {
			if typ, ok := t["type"].(string); ok {
				out["type"] = []any{typ, "null"}
			}
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, val := range t {
			out[i] = translate(val)
		}
		return out
	default:
		return v
	}
}

// isUnknownFormat tells a format keyword's value that knownFormats lacks (a
// property named format, an object, is not one).
func isUnknownFormat(v any) bool {
	f, ok := v.(string)
	return ok && !knownFormats[f]
}
