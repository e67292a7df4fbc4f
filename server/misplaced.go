package server

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway/gen/api"
)

// otherAPIFields are the fields that hold a request's text in the APIs that
// clients most often come from: Chat Completions' `messages` and OpenAI's
// Responses API's `input`. A body that holds one and no prompt is refused as
// any empty prompt is (EMPTY_PROMPT), with a message that names it.
var otherAPIFields = []string{"messages", "input"}

// misplacedKey is the request context's key of the misplaced text found by
// noteMisplacedText.
type misplacedKey struct{}

// noteMisplacedText records, in the request's context, which of a decoded
// body's requests (the one of a response request, each item of a batch)
// have an empty prompt and their text under one of otherAPIFields, for
// requestInput to carry to validation. It reads body again only when a
// prompt is empty.
func noteMisplacedText(c echo.Context, v any, body []byte) {
	var requests []api.ResponseRequest
	var objects []map[string]json.RawMessage
	switch v := v.(type) {
	case *api.ResponseRequest:
		if v.Prompt != "" {
			return
		}
		var object map[string]json.RawMessage
		if json.Unmarshal(body, &object) != nil {
			return
		}
		requests, objects = []api.ResponseRequest{*v}, []map[string]json.RawMessage{object}
	case *api.BatchRequest:
		if !slices.ContainsFunc(v.Requests, func(r api.ResponseRequest) bool { return r.Prompt == "" }) {
			return
		}
		var batch struct {
			Requests []map[string]json.RawMessage `json:"requests"`
		}
		if json.Unmarshal(body, &batch) != nil || len(batch.Requests) != len(v.Requests) {
			return
		}
		requests, objects = v.Requests, batch.Requests
	default:
		return
	}
	names := make([]string, len(objects))
	found := false
	for i, object := range objects {
		if requests[i].Prompt != "" {
			continue
		}
		for _, name := range otherAPIFields {
			if value, ok := object[name]; ok && !bytes.Equal(bytes.TrimSpace(value), []byte("null")) {
				names[i], found = name, true
				break
			}
		}
	}
	if found {
		r := c.Request()
		c.SetRequest(r.WithContext(context.WithValue(r.Context(), misplacedKey{}, names)))
	}
}

// misplacedText is the field of otherAPIFields that request index of the
// body (0 for a response request, the item's index in a batch) holds its
// text in, or "".
func misplacedText(ctx context.Context, index int) string {
	names, _ := ctx.Value(misplacedKey{}).([]string)
	if index < len(names) {
		return names[index]
	}
	return ""
}
