package gateway_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
)

type catalog map[gateway.Model]bool

func (c catalog) Available(m gateway.Model) bool { return c[m] }

var all = catalog{gateway.ModelInstant: true, gateway.ModelReasoning: true, gateway.ModelElements: true}

func ptr[T any](v T) *T { return &v }

func TestParseModel(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]gateway.Model{
		"instant": gateway.ModelInstant, " FAST ": gateway.ModelInstant,
		"Reasoning": gateway.ModelReasoning, "think": gateway.ModelReasoning, "THINKING": gateway.ModelReasoning, "reason": gateway.ModelReasoning,
		"elements": gateway.ModelElements, "Element": gateway.ModelElements,
	} {
		got, err := gateway.ParseModel(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "gpt-4", "instantx", "elementss"} {
		_, err := gateway.ParseModel(bad)
		require.Equal(t, gateway.EInvalidModel, gateway.ErrorCodeOf(err), bad)
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		in        gateway.RequestInput
		catalog   catalog
		wantCode  gateway.ErrorCode
		wantModel gateway.Model
		wantMax   uint64
		explicit  bool
	}{
		{name: "empty prompt", in: gateway.RequestInput{}, wantCode: gateway.EEmptyPrompt},
		{name: "prompt at limit", in: gateway.RequestInput{Prompt: strings.Repeat("a", 100000)}, wantModel: gateway.ModelInstant, wantMax: 32000},
		{name: "prompt over limit", in: gateway.RequestInput{Prompt: strings.Repeat("a", 100001)}, wantCode: gateway.EPromptTooLarge},
		{name: "multibyte prompt over limit in bytes", in: gateway.RequestInput{Prompt: strings.Repeat("é", 50001)}, wantCode: gateway.EPromptTooLarge},
		{name: "empty prompt wins over bad model", in: gateway.RequestInput{Model: ptr("nope")}, wantCode: gateway.EEmptyPrompt},
		{name: "text in another field", in: gateway.RequestInput{Misplaced: "messages"}, wantCode: gateway.EEmptyPrompt},
		{name: "a prompt beside another field", in: gateway.RequestInput{Prompt: "p", Misplaced: "messages"}, wantModel: gateway.ModelInstant, wantMax: 32000},
		{name: "bad model", in: gateway.RequestInput{Prompt: "p", Model: ptr("nope")}, wantCode: gateway.EInvalidModel},
		{name: "alias", in: gateway.RequestInput{Prompt: "p", Model: ptr(" Think ")}, wantModel: gateway.ModelReasoning, wantMax: 64000, explicit: true},
		{name: "auto instant", in: gateway.RequestInput{Prompt: "p"}, wantModel: gateway.ModelInstant, wantMax: 32000},
		{name: "auto code", in: gateway.RequestInput{Prompt: "p", Hints: gateway.Hints{CodeMode: true}}, wantModel: gateway.ModelElements, wantMax: 64000},
		{name: "auto image", in: gateway.RequestInput{Prompt: "p", Hints: gateway.Hints{ImageMode: true}}, wantModel: gateway.ModelElements, wantMax: 64000},
		{name: "unavailable", in: gateway.RequestInput{Prompt: "p", Model: ptr("reasoning")}, catalog: catalog{gateway.ModelInstant: true}, wantCode: gateway.EModelUnavailable},
		{name: "auto unavailable", in: gateway.RequestInput{Prompt: "p"}, catalog: catalog{gateway.ModelReasoning: true}, wantCode: gateway.EModelUnavailable},
		{name: "max zero", in: gateway.RequestInput{Prompt: "p", MaxOutputRungs: ptr(uint64(0))}, wantCode: gateway.EInvalidRequest},
		{name: "max at instant limit", in: gateway.RequestInput{Prompt: "p", MaxOutputRungs: ptr(uint64(32000))}, wantModel: gateway.ModelInstant, wantMax: 32000},
		{name: "max over instant limit", in: gateway.RequestInput{Prompt: "p", MaxOutputRungs: ptr(uint64(32001))}, wantCode: gateway.EInvalidRequest},
		{name: "max at reasoning limit", in: gateway.RequestInput{Prompt: "p", Model: ptr("reasoning"), MaxOutputRungs: ptr(uint64(64000))}, wantModel: gateway.ModelReasoning, wantMax: 64000, explicit: true},
		{name: "max near 2^64", in: gateway.RequestInput{Prompt: "p", MaxOutputRungs: ptr(^uint64(0))}, wantCode: gateway.EInvalidRequest},
		{name: "max given", in: gateway.RequestInput{Prompt: "p", MaxOutputRungs: ptr(uint64(7))}, wantModel: gateway.ModelInstant, wantMax: 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := tt.catalog
			if c == nil {
				c = all
			}
			req, err := gateway.Validate(tt.in, c)
			if tt.wantCode != "" {
				require.Error(t, err)
				require.Equal(t, tt.wantCode, gateway.ErrorCodeOf(err))
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.wantModel, req.Model)
			require.Equal(t, tt.wantMax, req.MaxOutputRungs)
			require.Equal(t, tt.explicit, req.ModelExplicit)
		})
	}
}

func TestQuoteRepeatsLittleOfALargeValue(t *testing.T) {
	t.Parallel()
	require.Equal(t, `"gpt-5"`, gateway.Quote("gpt-5"))
	require.Equal(t, `"\x00"`, gateway.Quote("\x00"))
	long := strings.Repeat("m", 100000)
	require.Equal(t, `"`+strings.Repeat("m", 64)+`…"`, gateway.Quote(long))
	// Cut at a character's start, never inside one.
	require.Equal(t, strings.Repeat("a", 63)+"…", gateway.Clip(strings.Repeat("a", 63)+"é"+strings.Repeat("a", 10)))
	require.Equal(t, strings.Repeat("a", 64), gateway.Clip(strings.Repeat("a", 64)))
}
