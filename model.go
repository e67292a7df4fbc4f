package gateway

import (
	"strings"
)

// Model is a canonical model name.
type Model string

// The canonical models.
const (
	ModelInstant   Model = "instant"
	ModelReasoning Model = "reasoning"
	ModelElements  Model = "elements"
)

// Models lists the canonical models.
var Models = []Model{ModelInstant, ModelReasoning, ModelElements}

// OwnNames maps every canonical model to its own name: the upstream model
// names when the operator names none.
func OwnNames() map[Model]string {
	names := make(map[Model]string, len(Models))
	for _, m := range Models {
		names[m] = string(m)
	}
	return names
}

var modelAliases = map[string]Model{
	"instant":   ModelInstant,
	"fast":      ModelInstant,
	"reasoning": ModelReasoning,
	"reason":    ModelReasoning,
	"think":     ModelReasoning,
	"thinking":  ModelReasoning,
	"elements":  ModelElements,
	"element":   ModelElements,
}

// ParseModel trims s and resolves it case-insensitively to a canonical model or
// one of its aliases. Anything else is INVALID_MODEL.
func ParseModel(s string) (Model, error) {
	if m, ok := modelAliases[strings.ToLower(strings.TrimSpace(s))]; ok {
		return m, nil
	}
	return "", Errorf(EInvalidModel, "model %s is not recognised; use instant, reasoning or elements", Quote(s))
}

// OutputLimit is the model's default and maximum max_output_rungs.
func (m Model) OutputLimit() uint64 {
	if m == ModelInstant {
		return 32000
	}
	return 64000
}

// EntryPoint is the route a request came in by.
type EntryPoint string

// The entry points.
const (
	EntryResponses EntryPoint = "responses"
	EntryChat      EntryPoint = "chat"
	EntryBatch     EntryPoint = "batch"
)

// MaxPromptBytes is the largest accepted prompt, in bytes.
const MaxPromptBytes = 100000

// Hints are the request's mode flags, passed upstream.
type Hints struct {
	WebSearch bool
	CodeMode  bool
	ImageMode bool
}

// Request is a validated request for one response, interactive or a batch item.
type Request struct {
	Prompt             string
	Model              Model
	ModelExplicit      bool
	MaxOutputRungs     uint64
	IncludeRegions     bool
	CustomInstructions string
	Hints              Hints
}

// RequestInput is a request as the caller sent it, before validation.
type RequestInput struct {
	Prompt string
	// Misplaced names the field that holds the text of a request sent in
	// another API's shape (`messages`, `input`) without a prompt, for the
	// refusal to name it.
	Misplaced          string
	Model              *string
	MaxOutputRungs     *uint64
	IncludeRegions     bool
	CustomInstructions string
	// StudioID is parsed and ignored, but validated like every string.
	StudioID string
	Hints    Hints
}

// Catalog says which canonical models the operator made available.
type Catalog interface {
	Available(Model) bool
}

// Validate checks in against the interface's rules, picks the model when it is
// omitted (code_mode or image_mode → elements, otherwise instant), and returns the
// request to run. The order of checks is strings (no U+0000, decisions D11),
// prompt, model, output ceiling.
func Validate(in RequestInput, catalog Catalog) (Request, error) {
	model := ""
	if in.Model != nil {
		model = *in.Model
	}
	for _, f := range []struct{ name, value string }{
		{"prompt", in.Prompt}, {"model", model}, {"custom_instructions", in.CustomInstructions}, {"studio_id", in.StudioID},
	} {
		if strings.IndexByte(f.value, 0) >= 0 {
			return Request{}, Errorf(EInvalidRequest, "field %q must not contain the character U+0000", f.name)
		}
	}
	if in.Prompt == "" && in.Misplaced != "" {
		return Request{}, Errorf(EEmptyPrompt, "prompt must be a non-empty string: this API takes the text in %q, and does not read %q", "prompt", in.Misplaced)
	}
	if in.Prompt == "" {
		return Request{}, Errorf(EEmptyPrompt, "prompt must be a non-empty string")
	}
	if len(in.Prompt) > MaxPromptBytes {
		return Request{}, Errorf(EPromptTooLarge, "prompt is %d bytes; the limit is %d bytes", len(in.Prompt), MaxPromptBytes)
	}
	req := Request{
		Prompt:             in.Prompt,
		IncludeRegions:     in.IncludeRegions,
		CustomInstructions: in.CustomInstructions,
		Hints:              in.Hints,
	}
	if in.Model != nil {
		m, err := ParseModel(*in.Model)
		if err != nil {
			return Request{}, err
		}
		req.Model, req.ModelExplicit = m, true
	} else {
		req.Model = AutoRoute(in.Hints)
	}
	if !catalog.Available(req.Model) {
		return Request{}, Errorf(EModelUnavailable, "model %s is not available on this gateway", req.Model)
	}
	limit := req.Model.OutputLimit()
	req.MaxOutputRungs = limit
	if in.MaxOutputRungs != nil {
		if v := *in.MaxOutputRungs; v == 0 || v > limit {
			return Request{}, Errorf(EInvalidRequest, "max_output_rungs must be between 1 and %d for model %s", limit, req.Model)
		}
		req.MaxOutputRungs = *in.MaxOutputRungs
	}
	return req, nil
}

// AutoRoute is the model the gateway picks when the request names none.
func AutoRoute(h Hints) Model {
	if h.CodeMode || h.ImageMode {
		return ModelElements
	}
	return ModelInstant
}
