package server

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
)

// TestFieldNames: the names a body's keys are matched against are each
// field's JSON name (its Go name when untagged, none when tagged "-"), of
// every struct held through pointers, slices, arrays and maps, a type that
// holds itself included.
func TestFieldNames(t *testing.T) {
	t.Parallel()
	type node struct {
		Next     *node                   `json:"next"`
		Children []node                  `json:"children,omitempty"`
		Named    map[string]node         `json:"named"`
		Pair     [2]*struct{ Leaf bool } `json:"pair"`
		Hidden   string                  `json:"-"`
		Plain    int
	}
	require.Equal(t, map[string]bool{"next": true, "children": true, "named": true, "pair": true, "Leaf": true, "Plain": true},
		fieldNames(reflect.TypeOf(&node{})))
}

// TestTypeMismatch: a value of the wrong kind is named with the kind of JSON
// value its field takes, and a whole number past an unsigned field's range
// with the range, not as a wrong kind.
func TestTypeMismatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		value string
		into  any
		want  string
	}{
		{"number 300", uint8(0), "number 300 is out of range (at most 255)"},
		{"number 18446744073709551616", uint64(0), "number 18446744073709551616 is out of range (at most 18446744073709551615)"},
		{"number -1", uint64(0), "number -1 is not a valid non-negative integer"},
		{"number 1.5", uint64(0), "number 1.5 is not a valid non-negative integer"},
		{"number -1", uint(0), "number -1 is not a valid non-negative integer"},
		{"number 300", int8(0), "number 300 is not a valid integer"},
		{"number 1.5", int(0), "number 1.5 is not a valid integer"},
		{"number 1.5", int64(0), "number 1.5 is not a valid integer"},
		{"number 1", "", "number 1 is not a valid string"},
		{"number 1", gateway.Model(""), "number 1 is not a valid string"},
		{"string", true, "string is not a valid boolean"},
		{"object", []string{}, "object is not a valid array"},
		{"number 1", [2]string{}, "number 1 is not a valid array"},
		{"array", struct{}{}, "array is not a valid object"},
	} {
		err := &json.UnmarshalTypeError{Value: tc.value, Type: reflect.TypeOf(tc.into)}
		require.Equal(t, tc.want, typeMismatch(err), "%s into %T", tc.value, tc.into)
	}
}

// TestInElement: a refusal is placed in a batch item only when the field it
// names is the items' or below them; a field of another name, however it
// begins, names no item even where the byte is in one.
func TestInElement(t *testing.T) {
	t.Parallel()
	body := []byte(`{"requests":[{"prompt":"a"},{"prompt":"b"}]}`)
	at := int64(strings.Index(string(body), `"b"`))
	describe := func(field string) *gateway.Error { return gateway.Errorf(gateway.EInvalidRequest, "%s", field) }
	for field, want := range map[string]string{
		"requests.prompt":   `requests[1]: prompt`,
		"requests":          `requests[1]: `,
		"":                  `requests[1]: `,
		"other":             `other`,
		"requestsX.prompt":  `requestsX.prompt`,
		"requests_x":        `requests_x`,
		"x.requests.prompt": `x.requests.prompt`,
	} {
		require.Equal(t, want, inElement(body, at, field, describe).Message, "field %q", field)
	}
}

// TestExactFieldNamesStopsAtTheDecodersDepth: below the depth encoding/json
// decodes, where it refuses the body, no key is read (nor does the list of
// containers open grow past it, for a body of nothing but brackets).
func TestExactFieldNamesStopsAtTheDecodersDepth(t *testing.T) {
	t.Parallel()
	names := map[string]bool{"prompt": true}
	for depth, want := range map[int]string{maxNesting - 1: `{"~rompt":1}`, maxNesting: `{"Prompt":1}`} {
		body := []byte(strings.Repeat("[", depth) + `{"Prompt":1}`)
		exactFieldNames(body, names)
		require.Equal(t, want, string(body[depth:]), "at depth %d", depth)
	}
}
