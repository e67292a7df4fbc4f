package upstream_test

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// FuzzGuard feeds arbitrary replies through the guard, whole and streamed:
// what it lets through is clean (valid UTF-8, no U+0000) and within every
// bound, and a stream's result holds the sources it emitted and no more text
// (the same text when the upstream's is valid UTF-8: invalid bytes cleaned
// delta by delta may take more room than cleaned in one run).
func FuzzGuard(f *testing.F) {
	f.Add("answer", "title", "https://example.org", "snippet", uint8(3), uint8(2), uint8(4))
	f.Add("a\x00b\xffé", "t\x00\xfe", "u", "", uint8(200), uint8(150), uint8(1))
	f.Add(strings.Repeat("é", 300), strings.Repeat("T", 2000), strings.Repeat("u", 5000), strings.Repeat("s", 3000), uint8(9), uint8(120), uint8(2))
	f.Fuzz(func(t *testing.T, content, title, url, snippet string, deltas, sources, tokens uint8) {
		req := &upstream.Request{MaxOutputTokens: uint64(tokens)}
		var whole upstream.Result
		var script []upstream.Delta
		for i := range int(deltas) {
			d := upstream.Delta{Content: content}
			if i < int(sources) {
				d.Sources = []gateway.Source{{Title: title, URL: url, Snippet: snippet}}
			}
			whole.Content += d.Content
			whole.Sources = append(whole.Sources, d.Sources...)
			script = append(script, d)
		}
		checkText := func(what, s string, bound int) {
			if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 || len(s) > bound {
				t.Fatalf("%s of %d bytes (bound %d) is not clean: %q", what, len(s), bound, s)
			}
		}
		checkSources := func(got []gateway.Source) {
			if len(got) > upstream.MaxSources {
				t.Fatalf("%d sources kept", len(got))
			}
			for _, s := range got {
				checkText("a title", s.Title, upstream.MaxTitleBytes)
				checkText("a url", s.URL, upstream.MaxURLBytes)
				checkText("a snippet", s.Snippet, upstream.MaxSnippetBytes)
			}
		}

		res, err := upstream.Guard(scripted{res: whole}, nil).Complete(context.Background(), req)
		if err == nil {
			checkText("a reply's text", res.Content, upstream.MaxTextBytes(req))
			checkSources(res.Sources)
		}

		var text strings.Builder
		var sent []gateway.Source
		res, _ = upstream.Guard(scripted{res: whole, deltas: script}, nil).Stream(context.Background(), req, func(d upstream.Delta) error {
			text.WriteString(d.Content)
			sent = append(sent, d.Sources...)
			return nil
		})
		checkText("a stream's text", text.String(), upstream.MaxTextBytes(req))
		checkText("a stream's result", res.Content, text.Len())
		if utf8.ValidString(content) && strings.IndexByte(content, 0) < 0 && res.Content != text.String() {
			t.Fatalf("the result's text (%d bytes) is not the text sent (%d bytes)", len(res.Content), text.Len())
		}
		checkSources(sent)
		if len(res.Sources) != len(sent) {
			t.Fatalf("the result holds %d sources, %d were sent", len(res.Sources), len(sent))
		}
	})
}
