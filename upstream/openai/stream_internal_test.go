package openai

import (
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/upstream"
)

// countingReader counts the bytes read from r.
type countingReader struct {
	r    io.Reader
	read int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.read += int64(n)
	return n, err
}

// endless is a reader of x without end.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	return len(p), nil
}

// TestStreamLinesAreReadNoFurtherThanTheirBound: a line without end breaks
// the stream once it passes maxLine (upstream.ErrTooLong), read no further
// than the line and the reader's buffer; what came before it is kept.
func TestStreamLinesAreReadNoFurtherThanTheirBound(t *testing.T) {
	t.Parallel()
	const maxLine = 1 << 20
	body := &countingReader{r: io.MultiReader(strings.NewReader("data: {\"choices\":[{\"delta\":{\"content\":\"before \"}}]}\n\ndata: "), endless{})}
	var emitted []string
	res, err := readStream(body, maxLine, maxLine, func(bool) {}, func(d upstream.Delta) error {
		emitted = append(emitted, d.Content)
		return nil
	})
	require.ErrorIs(t, err, upstream.ErrTooLong)
	require.Equal(t, []string{"before "}, emitted)
	require.Equal(t, "before ", res.Content)
	require.LessOrEqual(t, body.read, int64(maxLine+8<<10), "the line up to its bound, and a buffer")
	require.Greater(t, body.read, int64(maxLine))
}

// TestALineAsLongAsTheBoundIsRead: a line as long as its bound, its newline
// included, is read, and so is an event spread over lines whose data,
// joined, is as long; one a byte longer is too long.
func TestALineAsLongAsTheBoundIsRead(t *testing.T) {
	t.Parallel()
	const (
		maxLine    = 8 << 10 // past the reader's buffer
		head, tail = `data: {"choices":[{"delta":{"content":"`, `"}}]}` + "\n"
		done       = "data: [DONE]\n\n"
	)
	line := func(n int) string { return head + strings.Repeat("x", n-len(head)-len(tail)) + tail }
	res, _, err := readBody(line(maxLine)+done, maxLine)
	require.NoError(t, err)
	require.Len(t, res.Content, maxLine-len(head)-len(tail))
	_, _, err = readBody(line(maxLine+1)+done, maxLine)
	require.ErrorIs(t, err, upstream.ErrTooLong)

	// An event of five lines, its data joined by newlines n bytes long.
	spread := func(n int) string {
		parts := []string{"{", `"choices":[{"delta":{"content":"x"}}],`, `"a":"` + strings.Repeat("a", maxLine/2) + `",`, "", "}"}
		joined := len(strings.Join(parts, "\n")) + len(`"b":""`)
		parts[3] = `"b":"` + strings.Repeat("b", n-joined) + `"`
		return "data: " + strings.Join(parts, "\ndata: ") + "\n\n"
	}
	res, _, err = readBody(spread(maxLine)+done, maxLine)
	require.NoError(t, err)
	require.Equal(t, "x", res.Content)
	_, _, err = readBody(spread(maxLine+1)+done, maxLine)
	require.ErrorIs(t, err, upstream.ErrTooLong)
}

// readBody reads body with readStream, its lines bounded by maxLine, and
// returns what it returned and the contents it emitted.
func readBody(body string, maxLine int64) (upstream.Result, []string, error) {
	var emitted []string
	res, err := readStream(strings.NewReader(body), maxLine, int(maxLine), func(bool) {}, func(d upstream.Delta) error {
		emitted = append(emitted, d.Content)
		return nil
	})
	return res, emitted, err
}

// TestEventsSpreadOverLines: an event's data spread over several data:
// lines is joined, as SSE joins it, and read at the event's end (its blank
// line, or the body's end); events of one line each are read as they come,
// blank lines between them or not; an event with empty data is none. Data
// that is not JSON once joined, or longer than a line may be, breaks the
// stream, with what came before it kept.
func TestEventsSpreadOverLines(t *testing.T) {
	t.Parallel()
	const (
		one    = `data: {"choices":[{"delta":{"content":"one "}}]}` + "\n"
		spread = "data: {\ndata:   \"choices\": [{\"delta\": {\"content\": \"two \"}}],\ndata:   \"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 4}\ndata: }\n"
		last   = "data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"three\"},\"finish_reason\":\"stop\"}]}\n"
	)
	for name, body := range map[string]string{
		"with blank lines":           one + "\n" + spread + "\n" + "data:\n\n" + last + "\ndata: [DONE]\n\n",
		"the last ended by the body": one + "\n" + spread + "\n" + last,
		"one-line events unparted":   one + one[:len(one)-1] + "\r\n" + spread + "\r\n" + last + "\n",
	} {
		res, emitted, err := readBody(body, maxLineBytes)
		require.NoError(t, err, name)
		want := []string{"one ", "two ", "three"}
		if name == "one-line events unparted" {
			want = []string{"one ", "one ", "two ", "three"}
		}
		require.Equal(t, want, emitted, name)
		require.Equal(t, strings.Join(want, ""), res.Content, name)
		require.True(t, res.UsageReported, name)
		require.Equal(t, [2]uint64{3, 4}, [2]uint64{res.InputTokens, res.OutputTokens}, name)
	}

	for name, tc := range map[string]struct {
		body    string
		maxLine int64
		want    error
	}{
		"not JSON once joined":       {body: one + "\ndata: {\ndata: not json\n\ndata: [DONE]\n\n", maxLine: maxLineBytes},
		"not JSON at the body's end": {body: one + "\ndata: {\"choices\":\n", maxLine: maxLineBytes},
		"longer than a line may be":  {body: one + "\ndata: {\n" + strings.Repeat("data: \"x\",\n", 100) + "data: }\n\n", maxLine: 256, want: upstream.ErrTooLong},
	} {
		res, emitted, err := readBody(tc.body, tc.maxLine)
		require.Error(t, err, name)
		if tc.want != nil {
			require.ErrorIs(t, err, tc.want, name)
		} else {
			require.ErrorContains(t, err, "malformed stream chunk", name)
		}
		require.Equal(t, []string{"one "}, emitted, name)
		require.Equal(t, "one ", res.Content, name)
	}
}

// TestDataThatIsNoChunkIsAKeepAlive: data that is no chunk (an object) is
// a keep-alive: a comment wrapped as data, as proxies that re-send their
// upstream's keep-alives send it (Vertex AI's for partner models, gateways
// before OpenRouter), a word ("data: ping", as Express's documentation
// sends one), a line a proxy put in, a JSON value that is no object. It is
// skipped, emitting nothing, before the first event, between events and
// after the finish_reason; a stream of nothing else is no whole stream, and
// its error says what the last of it was.
func TestDataThatIsNoChunkIsAKeepAlive(t *testing.T) {
	t.Parallel()
	const (
		vertex = "data: : keepalive\n\n"
		routed = "data: : OPENROUTER PROCESSING\n\n"
		bare   = "data::\n\n"
		ping   = "data: ping\n\n"
		junk   = "data: <html>proxy junk</html>\n\n"
		values = "data: 42\n\ndata: \"text\"\n\ndata: [1]\n\ndata: null\n\n"
	)
	body := vertex + routed + ping + `data: {"choices":[{"delta":{"content":"one "}}]}` + "\n\n" + vertex + bare + junk + values +
		`data: {"choices":[{"delta":{"content":"two"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}` + "\n\n" + vertex + ping
	res, emitted, err := readBody(body, maxLineBytes)
	require.NoError(t, err)
	require.Equal(t, []string{"one ", "two"}, emitted)
	require.Equal(t, "one two", res.Content)
	require.True(t, res.UsageReported)

	_, emitted, err = readBody(vertex+routed+vertex+ping, maxLineBytes)
	require.ErrorContains(t, err, `connection closed before [DONE] or a finish_reason (the last data that was no chunk: "ping")`)
	require.Empty(t, emitted)
}

// TestPartsDecodeStringsAsJSONDoes: parts, read again for a reply whose
// content was not a string, decodes the strings of its other contents as
// encoding/json does; null leaves what was there.
func TestPartsDecodeStringsAsJSONDoes(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{`"plain words"`, `""`, `"esc\"aped\\ \n"`, `"\u00e9\ud83d\ude00"`, "\"bad \xff utf-8\"", "\"ok é\""} {
		var want string
		require.NoError(t, json.Unmarshal([]byte(raw), &want), raw)
		var got parts
		require.NoError(t, json.Unmarshal([]byte(raw), &got), raw)
		require.Equal(t, parts{text: want}, got, raw)
	}
	got := parts{text: "kept"}
	require.NoError(t, json.Unmarshal([]byte(`null`), &got))
	require.Equal(t, parts{text: "kept"}, got)
}

// TestThinkingIsKeptToItsBound: a stream keeps its thinking up to its bound,
// cut at a character, and reads on: an upstream that thinks without end
// holds no more memory for it (its stream is bounded by its time alone).
func TestThinkingIsKeptToItsBound(t *testing.T) {
	t.Parallel()
	var body strings.Builder
	for range 1000 {
		body.WriteString(`data: {"choices":[{"delta":{"reasoning_content":"pensé "}}]}` + "\n\n")
	}
	body.WriteString(`data: {"choices":[{"delta":{"content":"done"},"finish_reason":"stop"}]}` + "\n\ndata: [DONE]\n\n")
	res, err := readStream(strings.NewReader(body.String()), maxLineBytes, 19, func(bool) {}, func(upstream.Delta) error { return nil })
	require.NoError(t, err)
	require.Equal(t, "done", res.Content)
	require.Equal(t, "pensé pensé pensp", res.Reasoning, "19 bytes, each delta cut at a character")
}
