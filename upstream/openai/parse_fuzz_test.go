package openai

import (
	"bytes"
	"context"
	"io"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
	"time"
	"unicode/utf8"

	"github.com/rungworks/gateway/upstream"
)

// FuzzParseReply feeds arbitrary bodies to the reader of replies asked for
// whole: it never panics, anything it cannot use is a failure after
// dispatch, and what it takes is a completion or an event stream to its
// [DONE] or finish_reason. A body that arrives a byte at a time reads as the
// whole body does.
func FuzzParseReply(f *testing.F) {
	for _, seed := range []string{
		`{"choices":[{"message":{"content":"hi","annotations":[{"type":"url_citation","url_citation":{"url":"u","title":"t","start_index":0,"end_index":2}}]}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`,
		`{"choices":[{"message":{"content":"a\u0000b"}}],"usage":{"prompt_tokens":18446744073709551615,"completion_tokens":4611686018427387904}}`,
		`{"choices":[{"message":{"content":"x","annotations":[{"type":"url_citation","url_citation":{"url":"u","start_index":5,"end_index":1}}]}}],"usage":{}}`,
		`{"choices":[{"message":{"content":"é東x","annotations":[{"type":"url_citation","url_citation":{"url":"u","title":"t","start_index":1,"end_index":3}},{"type":"url_citation","url_citation":{"url":"v","start_index":2,"end_index":4}}]}}]}`,
		`{"choices":[]}`, `{}`, `null`, `[`, ``, `{"error":"Input validation error","error_type":"validation"}`,
		"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n", ": keep-alive\n\ndata: [DONE]", "<html>",
		`{"choices":[{"message":{"content":[{"type":"thinking","thinking":[{"type":"text","text":"t"}]},{"type":"text","text":"a"}]}}]}`,
		"\uFEFF{\"choices\":[{\"message\":{\"content\":\"bom\"}}]}",
		`{"choices":[{"message":{"content":"x","annotations":{"a":1}}}],"citations":[{"url":"u","source":"s"},1,"v"],"search_results":"no"}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		res, err := readWhole(bytes.NewReader(raw), len(raw))
		again, againErr := readWhole(iotest.OneByteReader(bytes.NewReader(raw)), len(raw))
		if !reflect.DeepEqual(res, again) || (err == nil) != (againErr == nil) || err != nil && err.Error() != againErr.Error() {
			t.Fatalf("the reply read a byte at a time reads otherwise: %+v, %v against %+v, %v", again, againErr, res, err)
		}
		if err == nil && !wholeStream(raw) {
			t.Fatalf("an event stream without [DONE] or a finish_reason was taken")
		}
		if err != nil {
			if Kind := upstream.Kind(err); Kind != "failed" {
				t.Fatalf("a bad reply is %q, not a failure after dispatch: %v", Kind, err)
			}
			return
		}
		for _, s := range res.Sources {
			if s.URL == "" {
				t.Fatalf("a source without a url: %+v", s)
			}
			if !strings.Contains(res.Content, s.Snippet) || utf8.ValidString(res.Content) && !utf8.ValidString(s.Snippet) {
				t.Fatalf("a snippet that is not whole characters of the content: %q in %q", s.Snippet, res.Content)
			}
		}
	})
}

// readWhole reads body as Complete reads a reply of at most n bytes, with a
// watchdog that does not fire.
func readWhole(body io.Reader, n int) (upstream.Result, error) {
	c := &Client{cfg: Config{Timeout: time.Hour}}
	w := c.watch(func() {}, wholeCall, time.Hour)
	defer w.timer.Stop()
	return c.receiveWhole(context.Background(), w, body, int64(n))
}

// wholeStream says whether raw may be taken as a whole reply: a completion
// (after a byte order mark or not), or events with a [DONE] or a
// finish_reason (whose name JSON may spell in any case, or with escapes).
func wholeStream(raw []byte) bool {
	return completionFirst(bytes.TrimPrefix(raw, byteOrderMark)) || bytes.Contains(raw, doneMarker) ||
		bytes.Contains(bytes.ToLower(raw), []byte("reason")) || bytes.Contains(raw, []byte(`\`))
}

// FuzzReadStream feeds arbitrary event streams to the stream parser: it never
// panics, never reads past a line limit, and what it returns is exactly what
// it emitted.
func FuzzReadStream(f *testing.F) {
	for _, seed := range []string{
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"hi \"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"a\\u0000b\"}}]}\n\ndata: [DONE]",
		"data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
		"data: {\"error\":\"Request failed during generation\"}\n\n",
		"event: error\ndata: {\"code\":422}\n\ndata: [DONE]\n\n",
		"error: {\"code\":500,\"message\":\"the context is full\"}\n\n",
		": comment\nevent: x\ndata:[DONE]\r\n",
		"data: {\"choices\":[{\"delta\":{\"annotations\":[{\"type\":\"url_citation\",\"url_citation\":{\"url\":\"u\",\"title\":\"t\"}}]}}]}\n",
		"data: {not json}\n", "data: ", "",
		"data: {\"choices\":[{\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"x\"},{\"type\":\"thinking\"}]}}]}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"spread\"},\"finish_reason\":\"stop\"}]}\n\ndata:\n\n",
		"data: : keepalive\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\ndata: : keepalive\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var emitted strings.Builder
		res, err := readStream(bytes.NewReader(raw), maxLineBytes, maxLineBytes, func(bool) {}, func(d upstream.Delta) error {
			emitted.WriteString(d.Content)
			return nil
		})
		if emitted.String() != res.Content {
			t.Fatalf("returned %q but emitted %q", res.Content, emitted.String())
		}
		if err == nil && !wholeStream(raw) {
			t.Fatalf("a stream without [DONE] or a finish_reason succeeded")
		}
	})
}

// FuzzErrorSays feeds arbitrary error bodies to errorSays, whose message a
// rejected caller is sent: it never panics, and the message is valid UTF-8
// without NUL, at most maxMessageBytes long, whatever the body holds.
func FuzzErrorSays(f *testing.F) {
	for _, seed := range []string{
		`{"error":{"message":"bad","code":"insufficient_quota"}}`, `{"error":"overloaded"}`, `{"object":"error","message":"too long"}`,
		`[{"error":{"code":400,"message":"Invalid JSON payload","status":"INVALID_ARGUMENT"}}]`, `{"detail":[{"msg":"field required"}]}`,
		`{"detail":"Not Found"}`, `{"error":{"message":5},"detail":["x"]}`, "[", "", "<html>bad gateway</html>", "\xff\x00",
		strings.Repeat("\xffa", 300),
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		message, _ := errorSays(body)
		if !utf8.ValidString(message) || strings.IndexByte(message, 0) >= 0 || len(message) > maxMessageBytes {
			t.Fatalf("message %q: not valid UTF-8 without NUL within %d bytes", message, maxMessageBytes)
		}
	})
}
