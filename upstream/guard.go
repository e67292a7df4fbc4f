package upstream

import (
	"context"
	"strings"
	"unicode/utf8"

	"github.com/rungworks/gateway"
)

// Clean makes upstream text storable and sendable (D11): U+0000 is removed
// (PostgreSQL text and jsonb cannot hold it) and invalid UTF-8 is replaced by
// U+FFFD. Clean text is returned as is, without allocating.
func Clean(s string) string {
	if strings.IndexByte(s, 0) < 0 && utf8.ValidString(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "")
}

// cleanSources cleans every field of every source, in place.
func cleanSources(sources []gateway.Source) {
	for i := range sources {
		s := &sources[i]
		s.Title, s.URL, s.Snippet = Clean(s.Title), Clean(s.URL), Clean(s.Snippet)
	}
}

// Guard wraps a provider so that everything it returns is untrusted input made
// safe (D11): text is cleaned before anyone stores or sends it.
func Guard(p Provider) Provider {
	return &guarded{next: p}
}

type guarded struct {
	next Provider
}

// Complete implements Provider.
func (g *guarded) Complete(ctx context.Context, req *Request) (Result, error) {
	res, err := g.next.Complete(ctx, req)
	return cleanResult(res), err
}

// Stream implements Provider: each delta is cleaned before emit sees it.
func (g *guarded) Stream(ctx context.Context, req *Request, emit func(Delta) error) (Result, error) {
	res, err := g.next.Stream(ctx, req, func(d Delta) error {
		d.Content = Clean(d.Content)
		cleanSources(d.Sources)
		return emit(d)
	})
	return cleanResult(res), err
}

func cleanResult(res Result) Result {
	res.Content, res.Verdict = Clean(res.Content), Clean(res.Verdict)
	cleanSources(res.Sources)
	return res
}
