package openapi

import (
	"fmt"
	"net/http"
	"strings"
)

// Policy is what an operation demands of its caller, read from the document:
// its security requirements, the x-required-scopes, x-required-tier and
// x-max-body-bytes extensions.
type Policy struct {
	OperationID string
	Method      string
	// Path is the OpenAPI path template, e.g. /api/v1/batch/{batch_id}.
	Path string
	// Public operations need no key.
	Public bool
	// AnyScope lists the scopes of which the key needs one.
	AnyScope []string
	// Tier, when set, is the account tier the operation needs.
	Tier string
	// MaxBodyBytes, when positive, bounds the request body.
	MaxBodyBytes int64
	// Streams is true when the operation may answer text/event-stream: its
	// failures after authentication are reported by the handler (in the stream
	// when streaming), not refused up front.
	Streams bool
	// Query names the operation's query parameters.
	Query []string
	// Headers names the operation's header parameters.
	Headers []string
	// InTurns is true when an account's large requests of the operation wait
	// for a place before their body is read, so that a replica reads and
	// prices a few at a time (x-account-turns).
	InTurns bool
}

// Policies returns the policy of every operation, keyed by operationId.
func Policies() (map[string]Policy, error) {
	if _, err := JSON(); err != nil {
		return nil, err
	}
	global, _ := parsed["security"].([]any)
	paths, _ := parsed["paths"].(map[string]any)
	out := map[string]Policy{}
	for path, item := range paths {
		ops, _ := item.(map[string]any)
		for method, raw := range ops {
			op, ok := raw.(map[string]any)
			if !ok {
				continue
			}
			id, _ := op["operationId"].(string)
			if id == "" {
				return nil, fmt.Errorf("%s %s has no operationId", method, path)
			}
			p := Policy{OperationID: id, Method: strings.ToUpper(method), Path: path}
			security := global
			if s, ok := op["security"].([]any); ok {
				security = s
			}
			p.Public = len(security) == 0
			scopes, _ := op["x-required-scopes"].([]any)
			for _, sc := range scopes {
				p.AnyScope = append(p.AnyScope, fmt.Sprint(sc))
			}
			if !p.Public && len(p.AnyScope) == 0 {
				return nil, fmt.Errorf("operation %s needs a key but declares no x-required-scopes", id)
			}
			p.Tier, _ = op["x-required-tier"].(string)
			if n, ok := op["x-max-body-bytes"].(float64); ok {
				p.MaxBodyBytes = int64(n)
			}
			p.Streams = streams(op)
			p.InTurns, _ = op["x-account-turns"].(bool)
			if p.InTurns && (p.Public || p.MaxBodyBytes == 0) {
				return nil, fmt.Errorf("operation %s takes turns by account but needs no key or declares no x-max-body-bytes", id)
			}
			for _, param := range parameters(op) {
				name, _ := param["name"].(string)
				switch param["in"] {
				case "query":
					p.Query = append(p.Query, name)
				case "header":
					p.Headers = append(p.Headers, name)
				}
			}
			if p.Method != http.MethodGet && !p.Public && p.MaxBodyBytes == 0 && op["requestBody"] != nil {
				return nil, fmt.Errorf("operation %s takes a body but declares no x-max-body-bytes", id)
			}
			out[id] = p
		}
	}
	return out, nil
}

// streams reports whether op's 200 reply offers text/event-stream.
func streams(op map[string]any) bool {
	responses, _ := op["responses"].(map[string]any)
	ok, _ := responses["200"].(map[string]any)
	if ref, isRef := ok["$ref"].(string); isRef {
		name := strings.TrimPrefix(ref, "#/components/responses/")
		components, _ := parsed["components"].(map[string]any)
		all, _ := components["responses"].(map[string]any)
		ok, _ = all[name].(map[string]any)
	}
	content, _ := ok["content"].(map[string]any)
	_, found := content["text/event-stream"]
	return found
}

// ParameterForms describes, in plain words, the form every parameter of the
// document takes, keyed by its name: the message of a malformed one names the
// parameter and this, never a parser's text.
func ParameterForms() (map[string]string, error) {
	if _, err := JSON(); err != nil {
		return nil, err
	}
	out := map[string]string{}
	paths, _ := parsed["paths"].(map[string]any)
	for _, item := range paths {
		ops, _ := item.(map[string]any)
		for _, raw := range ops {
			op, _ := raw.(map[string]any)
			for _, p := range parameters(op) {
				name, _ := p["name"].(string)
				schema, _ := p["schema"].(map[string]any)
				if name == "" {
					return nil, fmt.Errorf("a parameter has no name")
				}
				out[name] = form(schema)
			}
		}
	}
	return out, nil
}

// parameters returns an operation's parameters, references resolved.
func parameters(op map[string]any) []map[string]any {
	raw, _ := op["parameters"].([]any)
	out := make([]map[string]any, 0, len(raw))
	for _, rp := range raw {
		p, _ := rp.(map[string]any)
		if ref, ok := p["$ref"].(string); ok {
			components, _ := parsed["components"].(map[string]any)
			all, _ := components["parameters"].(map[string]any)
			p, _ = all[strings.TrimPrefix(ref, "#/components/parameters/")].(map[string]any)
		}
		out = append(out, p)
	}
	return out
}

// form is a schema's form in plain words.
func form(schema map[string]any) string {
	typ, _ := schema["type"].(string)
	format, _ := schema["format"].(string)
	minimum, hasMin := schema["minimum"].(float64)
	maximum, hasMax := schema["maximum"].(float64)
	switch {
	case typ == "integer" && hasMin && hasMax:
		return fmt.Sprintf("a whole number from %d to %d", int64(minimum), int64(maximum))
	case typ == "integer":
		return "a whole number"
	case format == "date-time":
		return "an RFC 3339 timestamp such as 2026-01-02T15:04:05Z, or a date such as 2026-01-02 (its midnight UTC)"
	case format == "uuid":
		return "a UUID such as 0190a7c2-5b1e-7d3a-9f00-3c2b1a000000"
	default:
		return "a string"
	}
}
