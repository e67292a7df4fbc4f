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
	res, err := readStream(body, maxLine, func(bool) {}, func(d upstream.Delta) error {
		emitted = append(emitted, d.Content)
		return nil
	})
	require.ErrorIs(t, err, upstream.ErrTooLong)
	require.Equal(t, []string{"before "}, emitted)
	require.Equal(t, "before ", res.Content)
	require.LessOrEqual(t, body.read, int64(maxLine+8<<10), "the line up to its bound, and a buffer")
	require.Greater(t, body.read, int64(maxLine))
}

// TestTextDecodesStringsAsJSONDoes: text, read again for a reply whose
// content was not a string, decodes the strings of its other contents as
// encoding/json does; null leaves what was there.
func TestTextDecodesStringsAsJSONDoes(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{`"plain words"`, `""`, `"esc\"aped\\ \n"`, `"\u00e9\ud83d\ude00"`, "\"bad \xff utf-8\"", "\"ok é\""} {
		var want string
		require.NoError(t, json.Unmarshal([]byte(raw), &want), raw)
		var got text
		require.NoError(t, json.Unmarshal([]byte(raw), &got), raw)
		require.Equal(t, want, string(got), raw)
	}
	got := text("kept")
	require.NoError(t, json.Unmarshal([]byte(`null`), &got))
	require.Equal(t, text("kept"), got)
}
