package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
)

// jsonBinder decodes request bodies for the generated strict handlers: the body
// must be application/json in UTF-8, uncompressed, one JSON value, within the
// operation's size limit and body read timeout. Field names match exactly
// (decisions D11): a name that differs from a field's only in case is an
// unknown field, and unknown fields are ignored. Every failure is
// INVALID_REQUEST naming the field, REQUEST_TOO_LARGE or REQUEST_TIMEOUT.
type jsonBinder struct{}

// Bind implements echo.Binder.
func (jsonBinder) Bind(i any, c echo.Context) error {
	r := c.Request()
	if err := checkContentType(r.Header.Get("Content-Type")); err != nil {
		return err
	}
	if err := checkContentEncoding(r.Header.Values("Content-Encoding")); err != nil {
		return err
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		// The deadline stays: the server must not wait for the rest of the body.
		return readError(err)
	}
	if bytes.HasPrefix(body, byteOrderMark) {
		// RFC 8259 lets a parser ignore it, and some clients write one
		// (Windows PowerShell's UTF-8): read as whitespace, so that the
		// offsets of later refusals still count the client's bytes.
		copy(body, "   ")
	}
	switch trimmed := bytes.TrimSpace(body); {
	case len(trimmed) == 0:
		return gateway.Errorf(gateway.EInvalidRequest, "a JSON body is required")
	case string(trimmed) == "null":
		// encoding/json takes null for an object and leaves it empty.
		return notAnObject()
	}
	if !utf8.Valid(body) {
		return notUTF8(body)
	}
	twice, at, found := exactFieldNames(body, fieldNames(reflect.TypeOf(i)))
	if err := json.Unmarshal(body, i); err != nil {
		return decodeError(body, err)
	}
	if found {
		return inElement(body, int64(at), "", func(string) *gateway.Error {
			return gateway.Errorf(gateway.EInvalidRequest, "field %q appears more than once in one object; name each field once", twice)
		})
	}
	noteMisplacedText(c, i, body)
	return nil
}

// byteOrderMark is UTF-8's byte order mark, U+FEFF.
var byteOrderMark = []byte{0xEF, 0xBB, 0xBF}

// batchItems is the field of a batch's body that holds its items.
const batchItems = "requests"

// inElement returns the error made by describe, naming the batch item that
// holds byte offset of body when that byte is inside one (InItem), as a
// refusal by validation does. Past the items a
// batch may hold, no item is named: the body is too large a batch anyway.
// field, when set, is a dotted path from body's object (encoding/json's);
// describe is given the rest of it below the item, or all of it when no item
// is named.
func inElement(body []byte, offset int64, field string, describe func(rest string) *gateway.Error) *gateway.Error {
	name, index, ok := elementAt(body, offset)
	rest, under := strings.CutPrefix(field, name)
	if !ok || name != batchItems || index >= gateway.MaxBatchItems || (field != "" && !under) || (under && rest != "" && rest[0] != '.') {
		return describe(field)
	}
	return describe(strings.TrimPrefix(rest, ".")).InItem(index)
}

// elementAt finds the field of body's object whose value holds byte offset
// and, when that value is an array, the index of its element that does.
func elementAt(body []byte, offset int64) (field string, index int, ok bool) {
	field, value, start, found := valueAt(body, offset)
	if !found {
		return "", 0, false
	}
	index, _, _, ok = elementOf(value, offset-start)
	return field, index, ok
}

// fieldAt is the path of the field whose value holds byte offset of body, as
// encoding/json names fields: `prompt`, or `requests.prompt` for a batch
// item's (its index is inElement's to find); "" when offset is in no field's
// value (in a key, say).
func fieldAt(body []byte, offset int64) string {
	name, value, start, ok := valueAt(body, offset)
	if !ok {
		return ""
	}
	_, element, at, ok := elementOf(value, offset-start)
	if !ok || name != batchItems {
		return name
	}
	if inner, _, _, ok := valueAt(element, offset-start-at); ok {
		return name + "." + inner
	}
	return name
}

// valueAt finds the field of object whose value holds byte offset of it: its
// name, its value and where the value starts in object. It reads object with
// encoding/json's tokenizer: it runs only on a body already refused.
func valueAt(object []byte, offset int64) (name string, value json.RawMessage, start int64, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(object))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", nil, 0, false
	}
	for dec.More() {
		tok, err := dec.Token()
		key, isKey := tok.(string)
		if err != nil || !isKey || dec.Decode(&value) != nil {
			return "", nil, 0, false
		}
		if end := dec.InputOffset(); end >= offset {
			start = end - int64(len(value))
			if offset < start {
				return "", nil, 0, false // offset is in the key
			}
			return key, value, start, true
		}
	}
	return "", nil, 0, false
}

// elementOf returns the index of the element of array that holds byte offset
// of it, when array is an array, with the element and where it starts in
// array.
func elementOf(array json.RawMessage, offset int64) (index int, element json.RawMessage, start int64, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(array))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('[') {
		return 0, nil, 0, false
	}
	for i := 0; dec.More(); i++ {
		if dec.Decode(&element) != nil {
			return 0, nil, 0, false
		}
		if end := dec.InputOffset(); end >= offset {
			return i, element, end - int64(len(element)), true
		}
	}
	return 0, nil, 0, false
}

// checkContentType accepts JSON in UTF-8: application/json (most clients'
// exact value, taken without parsing) with no charset or UTF-8's.
func checkContentType(ct string) error {
	if ct == "application/json" {
		return nil
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return gateway.Errorf(gateway.EInvalidRequest, "Content-Type must be application/json")
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") && !strings.EqualFold(cs, "utf8") {
		return gateway.Errorf(gateway.EInvalidRequest, "the body must be UTF-8; charset %s is not accepted", gateway.Quote(cs))
	}
	return nil
}

// checkContentEncoding accepts a body sent as it is: no Content-Encoding, or
// identity. A compressed body is refused before it is read, rather than its
// bytes taken for malformed JSON, and a body that only claims a coding is
// refused too.
func checkContentEncoding(values []string) error {
	for _, v := range values {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.TrimSpace(c); c != "" && !strings.EqualFold(c, "identity") {
				return gateway.Errorf(gateway.EInvalidRequest, "Content-Encoding %s is not accepted: send the body uncompressed", gateway.Quote(c))
			}
		}
	}
	return nil
}

// readError is the reply to a body that could not be read.
func readError(err error) error {
	var netErr net.Error
	switch {
	case tooLarge(err):
		return gateway.Errorf(gateway.ERequestTooLarge, "request body is larger than the limit of this route")
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return gateway.Errorf(gateway.ERequestTimeout, "the request body did not arrive within the server's body read timeout")
	default:
		return gateway.Errorf(gateway.EInvalidRequest, "the request body could not be read")
	}
}

func tooLarge(err error) bool {
	var mbe *http.MaxBytesError
	return errors.As(err, &mbe)
}

// notUTF8 is the reply to a body that is not UTF-8 (RFC 8259 requires it;
// encoding/json would take each invalid byte for U+FFFD, three bytes, so a
// prompt the client sent within the limit could be refused as over it, and
// what reached the model would not be what was sent). It names the first
// invalid byte (counted from 1, as a malformed body's reply does), the field
// that holds it and, in a batch, its item.
func notUTF8(body []byte) error {
	at := 0
	for at < len(body) {
		r, n := utf8.DecodeRune(body[at:])
		if r == utf8.RuneError && n == 1 {
			break
		}
		at += n
	}
	return inElement(body, int64(at), fieldAt(body, int64(at)), func(field string) *gateway.Error {
		if field == "" {
			return gateway.Errorf(gateway.EInvalidRequest, "the body is not valid UTF-8 (byte %d)", at+1)
		}
		return gateway.Errorf(gateway.EInvalidRequest, "field %q is not valid UTF-8 (byte %d of the body)", field, at+1)
	})
}

// notAnObject is the reply to a body that is JSON but not an object.
func notAnObject() error {
	return gateway.Errorf(gateway.EInvalidRequest, "the body must be a JSON object")
}

func decodeError(body []byte, err error) error {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr) && typeErr.Field != "":
		what := typeMismatch(typeErr)
		return inElement(body, typeErr.Offset, typeErr.Field, func(field string) *gateway.Error {
			if field == "" {
				return gateway.Errorf(gateway.EInvalidRequest, "%s", what)
			}
			return gateway.Errorf(gateway.EInvalidRequest, "field %q: %s", field, what)
		})
	case errors.As(err, &typeErr):
		return notAnObject()
	case errors.As(err, &syntaxErr) && strings.HasSuffix(syntaxErr.Error(), "exceeded max depth"):
		return gateway.Errorf(gateway.EInvalidRequest, "the body nests arrays and objects deeper than %d levels", maxNesting)
	case errors.As(err, &syntaxErr):
		return gateway.Errorf(gateway.EInvalidRequest, "malformed JSON at byte %d", syntaxErr.Offset)
	default:
		return gateway.Errorf(gateway.EInvalidRequest, "the body must hold exactly one JSON value")
	}
}

// typeMismatch says why a JSON value does not fit the field it was given
// for: a whole number past an unsigned field's range is out of range,
// anything else not the kind of value the field takes.
func typeMismatch(err *json.UnmarshalTypeError) string {
	value := gateway.Clip(err.Value)
	digits, isNumber := strings.CutPrefix(err.Value, "number ")
	kind := err.Type.Kind()
	if isNumber && strings.Trim(digits, "0123456789") == "" && kind >= reflect.Uint && kind <= reflect.Uint64 {
		return fmt.Sprintf("%s is out of range (at most %d)", value, uint64(1)<<err.Type.Bits()-1)
	}
	return fmt.Sprintf("%s is not a valid %s", value, jsonType(err.Type))
}

// jsonType names the JSON value a Go type decodes from.
func jsonType(t reflect.Type) string {
	switch k := t.Kind(); {
	case k == reflect.String:
		return "string"
	case k == reflect.Bool:
		return "boolean"
	case k >= reflect.Uint && k <= reflect.Uint64:
		return "non-negative integer"
	case k >= reflect.Int && k <= reflect.Int64:
		return "integer"
	case k == reflect.Slice || k == reflect.Array:
		return "array"
	default:
		return "object"
	}
}

// exactFieldNames makes every object key of body that equals one of names only
// when case is ignored an unknown field, in place: its first byte becomes '~',
// which no field name holds. encoding/json matches names case-insensitively;
// the contract matches them exactly. It also returns the first of names that
// an object of body names twice (after escapes), if any: encoding/json would
// take the last silently, where a proxy or a log in front of the gateway may
// have read the first, and at, the offset of its second key. (Unknown keys
// are ignored, twice or not.) One pass over
// the bytes, no value decoded: a prompt of 100 KB is skipped, not copied. A
// body that is not valid JSON, or nested deeper than the decoder takes, is
// left for the decoder to report.
func exactFieldNames(body []byte, names map[string]bool) (twice string, at int, found bool) {
	// open holds the containers open, innermost last; known the field names
	// of the objects open, each object's after its parent's; wantKey: the
	// next string of the innermost object is a key.
	var openBuf [8]container
	var knownBuf [16][]byte
	open, known := openBuf[:0], knownBuf[:0]
	wantKey := false
	for i := 0; i < len(body); i++ {
		switch body[i] {
		case '{', '[':
			if len(open) == maxNesting {
				return twice, at, found
			}
			open = append(open, container{object: body[i] == '{', known: len(known)})
			wantKey = body[i] == '{'
		case '}', ']':
			if len(open) == 0 {
				return twice, at, found
			}
			known = known[:open[len(open)-1].known]
			open = open[:len(open)-1]
			wantKey = false // in a body that is not JSON, a string may follow
		case ',':
			wantKey = len(open) > 0 && open[len(open)-1].object
		case '"':
			end, escaped := stringEnd(body, i+1)
			if end < 0 {
				return twice, at, found
			}
			if wantKey {
				wantKey = false
				key := keyName(body[i+1:end], escaped)
				switch {
				case names[string(key)] && !found:
					siblings := known[open[len(open)-1].known:]
					if slices.ContainsFunc(siblings, func(k []byte) bool { return bytes.Equal(k, key) }) {
						twice, at, found = string(key), i, true
					}
					known = append(known, key)
				case !names[string(key)] && foldsToAny(string(key), names):
					body[i+1] = '~'
				}
			}
			i = end
		}
	}
	return twice, at, found
}

// maxNesting is how deep encoding/json decodes: exactFieldNames reads no
// deeper (the decoder refuses the body).
const maxNesting = 10000

// container is a JSON object or array open where exactFieldNames reads;
// known is where its field names start in the list of them.
type container struct {
	object bool
	known  int
}

// keyName is the name an object key's contents stand for: key itself, or
// with escapes, what they decode to (key when they do not decode).
func keyName(key []byte, escaped bool) []byte {
	if !escaped {
		return key
	}
	var name string
	quoted := make([]byte, 0, len(key)+2)
	quoted = append(append(append(quoted, '"'), key...), '"')
	if json.Unmarshal(quoted, &name) != nil {
		return key
	}
	return []byte(name)
}

// stringEnd returns the index of the quote ending the JSON string whose
// contents start at from, or -1, and whether the string holds an escape. It
// is kept a call of its own: inlined into exactFieldNames, its loop ran 15 %
// slower (BenchmarkBind, a prompt of 100 KB), and a loop of
// bytes.IndexByte calls, faster on a plain prompt, is slower on one of
// escapes.
//
//go:noinline
func stringEnd(body []byte, from int) (int, bool) {
	escaped := false
	for i := from; i < len(body); i++ {
		switch body[i] {
		case '\\':
			escaped = true
			i++
		case '"':
			return i, escaped
		}
	}
	return -1, escaped
}

func foldsToAny(key string, names map[string]bool) bool {
	for name := range names {
		if strings.EqualFold(key, name) {
			return true
		}
	}
	return false
}

var fieldNameCache sync.Map // reflect.Type → map[string]bool

// fieldNames are the JSON field names of t and of every struct it holds.
func fieldNames(t reflect.Type) map[string]bool {
	if names, ok := fieldNameCache.Load(t); ok {
		return names.(map[string]bool)
	}
	names := map[string]bool{}
	collectFieldNames(t, names, map[reflect.Type]bool{})
	fieldNameCache.Store(t, names)
	return names
}

func collectFieldNames(t reflect.Type, names map[string]bool, seen map[reflect.Type]bool) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Array || t.Kind() == reflect.Map {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || seen[t] {
		return
	}
	seen[t] = true
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		names[name] = true
		collectFieldNames(f.Type, names, seen)
	}
}

// limitBody bounds the request body in size and in time: a declared
// Content-Length over the limit is refused at once, a chunked body when the
// decoder reads past it; a body not in within timeout is REQUEST_TIMEOUT.
func limitBody(limit int64, timeout time.Duration) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			r := c.Request()
			if r.ContentLength > limit {
				return gateway.Errorf(gateway.ERequestTooLarge, "request body is %d bytes; the limit of this route is %d bytes", r.ContentLength, limit)
			}
			_ = http.NewResponseController(c.Response()).SetReadDeadline(time.Now().Add(timeout))
			r.Body = http.MaxBytesReader(c.Response(), r.Body, limit)
			return next(c)
		}
	}
}
