package apitest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/stretchr/testify/require"
)

// Event is one server-sent event.
type Event struct {
	Name string
	Data []byte
}

// Stream is a parsed text/event-stream body.
type Stream struct {
	Events []Event
	// Comments counts the `:` keep-alive lines.
	Comments int
}

// Decode unmarshals the event's data.
func (e Event) Decode(t testing.TB, v any) {
	t.Helper()
	require.NoError(t, json.Unmarshal(e.Data, v), "event %s: %s", e.Name, e.Data)
}

// ParseEvents reads a text/event-stream body: each event is an `event:` line and
// one `data:` line ended by a blank line (decisions D9).
func ParseEvents(t testing.TB, body io.Reader) Stream {
	t.Helper()
	var s Stream
	var cur Event
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		switch {
		case len(line) == 0:
			if cur.Name != "" || cur.Data != nil {
				require.NotEmpty(t, cur.Name, "an event without an event: line")
				require.NotNil(t, cur.Data, "event %s without a data: line", cur.Name)
				s.Events = append(s.Events, cur)
			}
			cur = Event{}
		case bytes.HasPrefix(line, []byte(":")):
			s.Comments++
		case bytes.HasPrefix(line, []byte("event: ")):
			cur.Name = string(line[len("event: "):])
		case bytes.HasPrefix(line, []byte("data: ")):
			require.Nil(t, cur.Data, "one data: line per event")
			cur.Data = append([]byte(nil), line[len("data: "):]...)
		default:
			t.Fatalf("unexpected line in event stream: %q", line)
		}
	}
	require.NoError(t, sc.Err())
	require.True(t, cur.Name == "" && cur.Data == nil, "the stream ended inside an event")
	return s
}

// eventSchemas names the component schema of each event's data (interface §6).
var eventSchemas = map[string]string{
	"response.output_text.delta": "StreamChunk",
	"response.completed":         "StreamChunk",
	"response.error":             "ErrorEnvelope",
}

// ValidateEvents fails t unless every event is one of the three of interface §6
// and its data matches its schema in the OpenAPI document.
func ValidateEvents(t testing.TB, s Stream) {
	t.Helper()
	loadOnce.Do(load)
	require.NoError(t, loadErr)
	for _, e := range s.Events {
		name, ok := eventSchemas[e.Name]
		require.True(t, ok, "unknown event %q", e.Name)
		var v any
		require.NoError(t, json.Unmarshal(e.Data, &v))
		require.NoError(t, doc.Components.Schemas[name].Value.VisitJSON(v), "event %s does not match %s: %s", e.Name, name, e.Data)
	}
}

func init() {
	// The reply validator reads an event stream as the string its schema declares;
	// ValidateEvents checks the events inside.
	openapi3filter.RegisterBodyDecoder("text/event-stream", func(body io.Reader, _ http.Header, _ *openapi3.SchemaRef, _ openapi3filter.EncodingFn) (any, error) {
		b, err := io.ReadAll(body)
		return string(b), err
	})
}
