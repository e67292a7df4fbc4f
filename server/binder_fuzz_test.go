package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
)

// FuzzBind feeds arbitrary bodies to the request decoder: it never panics,
// every refusal is a domain error (the contract's envelope, never a parser's
// text), a body accepted is UTF-8, and no field is ever filled from a name
// that differs from it in case.
func FuzzBind(f *testing.F) {
	for _, seed := range []string{
		`{"prompt":"hi"}`, `{"prompt":"","Prompt":"hi"}`, `{"prompt":"hi","Stream":true}`,
		`{"requests":[{"prompt":"a","PROMPT":"b"}]}`, `{"\u0050rompt":"x","prompt":"y"}`, `{"ſtream":true,"prompt":"p"}`,
		`{"prompt":1}`, `[]`, `{"prompt":"a"} {}`, `{"prompt":"a"},{}`, `{"max_output_rungs":-1,"prompt":"x"}`, `{"prompt":"a\u0000b"}`, "", "{\"prompt\":\"caf\xe9\"}", "{\"requests\":[{\"\xff\":1}]}", "\xef\xbb\xbf{\"prompt\":\"hi\"}",
		`{"messages":[{"role":"user","content":"hi"}]}`, `{"requests":[{"prompt":"a"},{"input":"b"}]}`,
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, batch bool) {
		var target any = &api.ResponseRequest{}
		if batch {
			target = &api.BatchRequest{}
		}
		req := httptest.NewRequest("POST", "/api/v1/responses", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		c := echo.New().NewContext(req, httptest.NewRecorder())
		err := jsonBinder{}.Bind(target, c)
		var e *gateway.Error
		if err != nil {
			if !errors.As(err, &e) {
				t.Fatalf("a refusal that is not a domain error: %v", err)
			}
			for _, leak := range []string{"json:", "Go ", "reflect", "struct"} {
				if strings.Contains(e.Message, leak) {
					t.Fatalf("message leaks internals: %q", e.Message)
				}
			}
			return
		}
		if !utf8.Valid(body) {
			t.Fatalf("a body that is not UTF-8 was accepted: %q", body)
		}
		if !batch {
			checkExactNames(t, body, target.(*api.ResponseRequest))
		}
	})
}

// checkExactNames: the prompt is what the body holds under the exact name
// "prompt" (the last one, as JSON decoders take it), and nothing else.
func checkExactNames(t *testing.T, body []byte, got *api.ResponseRequest) {
	t.Helper()
	var raw map[string]json.RawMessage
	if json.Unmarshal(body, &raw) != nil {
		return
	}
	var want string
	if v, ok := raw["prompt"]; ok {
		_ = json.Unmarshal(v, &want)
	}
	if got.Prompt != want {
		t.Fatalf("prompt %q, want %q from %q", got.Prompt, want, body)
	}
}

// FuzzExactFieldNames: rewriting keys keeps a valid body valid, changes
// nothing else, and leaves no key that folds to a field name without being it:
// its output is, byte for byte, that of a rewrite driven by encoding/json's
// own tokenizer.
func FuzzExactFieldNames(f *testing.F) {
	for _, seed := range []string{`{"Prompt":"x"}`, `{"a":{"MODEL":[1,{"Stream":2}]}}`, `{"\u0070ROMPT":1}`, `[{"Prompt":{}}]`, `{"":""}`,
		`{"a\"Prompt":1,"Prompt\\":2,"x":"\"Prompt\":"}`, `{"a":[1,"Model",{"MODEL":[]}],"Stream":{"Prompt":1}}`, `{"ſtream":true,"\u0050rompt":"x"}`,
		`{"prompt":1,"pro\u006dpt":2}`, `{"a":{"x":1},"b":{"x":2},"a":3}`, `{"PROMPT":1,"~ROMPT":2,"PROMPT":3}`, manyKeysBody(40, true), `{"a":1,"a":2,"model":{"model":1},"model":3}`,
		`{"model":{"prompt":1},"prompt":2}`, `{"a":["Prompt"],"b":"Model"}`, `{"model":1,"model":2,"prompt":1,"prompt":2}`, `{"\"":1,"Prompt":2}`,
		`{}"requests"`, `[{}"Prompt"]`} {
		f.Add([]byte(seed))
	}
	names := fieldNames(reflect.TypeOf(&api.BatchRequest{}))
	f.Fuzz(func(t *testing.T, body []byte) {
		valid := json.Valid(body)
		out := append([]byte(nil), body...)
		twice, at, found := exactFieldNames(out, names)
		if json.Valid(out) != valid {
			t.Fatalf("validity changed: %q -> %q", body, out)
		}
		if len(out) != len(body) {
			t.Fatalf("length changed")
		}
		if !valid {
			return
		}
		want := append([]byte(nil), body...)
		wantTwice, wantAt, wantFound := exactFieldNamesByTokens(want, names)
		if !bytes.Equal(out, want) {
			t.Fatalf("%q became %q, want %q", body, out, want)
		}
		if twice != wantTwice || found != wantFound || (found && at != wantAt) {
			t.Fatalf("%q: named twice %q at %d (%v), want %q at %d (%v)", body, twice, at, found, wantTwice, wantAt, wantFound)
		}
	})
}

// exactFieldNamesByTokens is exactFieldNames done with encoding/json's
// tokenizer: the reference it is checked against.
func exactFieldNamesByTokens(body []byte, names map[string]bool) (twice string, at int, found bool) {
	type frame struct {
		object, wantKey bool
		seen            map[string]bool
	}
	var stack []frame
	dec := json.NewDecoder(bytes.NewReader(body))
	for {
		before := dec.InputOffset()
		tok, err := dec.Token()
		if err != nil {
			return twice, at, found
		}
		top := len(stack) - 1
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				if top >= 0 && stack[top].object {
					stack[top].wantKey = true // after this value, a key
				}
				stack = append(stack, frame{object: d == '{', wantKey: d == '{', seen: map[string]bool{}})
			default:
				stack = stack[:top]
			}
			continue
		}
		if top < 0 || !stack[top].object {
			continue
		}
		if !stack[top].wantKey {
			stack[top].wantKey = true // a value; a key comes next
			continue
		}
		stack[top].wantKey = false
		key, _ := tok.(string)
		if names[key] && stack[top].seen[key] && !found {
			// The key's quote is the first after the separator before it.
			twice, at, found = key, int(before)+bytes.IndexByte(body[before:], '"'), true
		}
		stack[top].seen[key] = true
		if names[key] || !foldsToAny(key, names) {
			continue
		}
		if q := bytes.IndexByte(body[before:], '"'); q >= 0 && int(before)+q+1 < len(body) {
			body[int(before)+q+1] = '~'
		}
	}
}

// manyKeysBody is an object of n unknown keys k0… and a prompt, with the
// prompt again at its end when repeat is set, nested in an object of a few
// keys.
func manyKeysBody(n int, repeat bool) string {
	var b strings.Builder
	b.WriteString(`{"prompt":"p","requests":[{"prompt":"q",`)
	for i := range n {
		fmt.Fprintf(&b, `"k%d":%d,`, i, i)
	}
	if repeat {
		b.WriteString(`"prompt":"r",`)
	}
	b.WriteString(`"last":true}],"model":"x"}`)
	return b.String()
}
