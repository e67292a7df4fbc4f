package upstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/rungworks/gateway"
)

// Bounds of what one reply may carry (D11): whatever an upstream sends, the
// gateway holds, stores and sends no more than this.
const (
	// BytesPerToken bounds the text of one output token: twice the longest
	// token of o200k_base and cl100k_base (128 bytes). A reply's text holds
	// at most the request's MaxOutputTokens of them (MaxTextBytes).
	BytesPerToken = 256
	// MaxSources is the most sources one reply keeps: those after are
	// dropped. A provider need not hold more.
	MaxSources = 100
	// MaxURLBytes bounds a source's URL: a source with a longer one is
	// dropped, as a URL cut short names another page.
	MaxURLBytes = 4 << 10
	// MaxTitleBytes, MaxSnippetBytes and MaxVerdictBytes bound a source's
	// title and snippet and the evidence verdict: longer ones are cut at a
	// character boundary.
	MaxTitleBytes   = 1 << 10
	MaxSnippetBytes = 2 << 10
	MaxVerdictBytes = 256
)

// The bounds Guard names when a reply passes one (see Guard).
const (
	CutText    = "text"    // the reply failed, or was too long to read, or its stream broke off
	CutSources = "sources" // sources past MaxSources dropped
	CutURL     = "url"     // a source dropped for its URL
	CutTitle   = "title"
	CutSnippet = "snippet"
	CutVerdict = "verdict"
)

// Cuts are the Cut constants, in the order Guard reports them.
var Cuts = []string{CutText, CutSources, CutURL, CutTitle, CutSnippet, CutVerdict}

// MaxTextBytes is the most text a reply to req may hold: MaxOutputTokens
// tokens (the model's limit when it is zero) of BytesPerToken bytes.
func MaxTextBytes(req *Request) int {
	tokens := req.MaxOutputTokens
	if tokens == 0 {
		tokens = req.Model.OutputLimit()
	}
	return int(min(tokens, 1<<40/BytesPerToken) * BytesPerToken)
}

// Clean makes upstream text storable and sendable (D11): U+0000 is removed
// (PostgreSQL text and jsonb cannot hold it) and invalid UTF-8 is replaced by
// U+FFFD. Clean text is returned as is, without allocating.
func Clean(s string) string {
	if strings.IndexByte(s, 0) < 0 && utf8.ValidString(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "")
}

// Cut returns s cut to at most n bytes, at a character boundary.
func Cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// Guard wraps a provider so that everything it returns is untrusted input made
// safe (D11): text is cleaned before anyone stores or sends it, and bounded.
// A reply whose text passes MaxTextBytes fails (ErrFailed: the upstream ran
// it), as one its provider stopped reading does (ErrTooLong); a stream's
// breaks off there (ErrStreamBroken), what came before it sent and kept.
// Sources past MaxSources, or with a URL past MaxURLBytes, are
// dropped; titles, snippets and verdicts past theirs are cut. onCut, when
// set, is told once a reply of each bound it passed (a Cut constant).
func Guard(p Provider, onCut func(string)) Provider {
	return &guarded{next: p, onCut: onCut}
}

type guarded struct {
	next  Provider
	onCut func(string)
}

// Complete implements Provider.
func (g *guarded) Complete(ctx context.Context, req *Request) (Result, error) {
	res, err := g.next.Complete(ctx, req)
	b := g.bounds(req)
	defer b.report()
	if errors.Is(err, ErrTooLong) {
		b.cut(CutText)
	}
	res.Content, res.Reasoning = Clean(res.Content), Clean(res.Reasoning)
	if err == nil && len(res.Content) > b.maxText {
		b.cut(CutText)
		return Result{}, fmt.Errorf("%w: the reply holds %d bytes of text, more than %d output tokens can (%d bytes)",
			ErrFailed, len(res.Content), b.maxText/BytesPerToken, b.maxText)
	}
	res.Sources = b.sources(res.Sources)
	res.Verdict = b.verdict(res.Verdict)
	return res, err
}

// Stream implements Provider: each delta is cleaned and bounded before emit
// sees it. The result's sources are those emitted, and its text no more than
// was emitted (the same text when the upstream's is valid UTF-8; invalid
// bytes cleaned delta by delta may take more room than in one run).
func (g *guarded) Stream(ctx context.Context, req *Request, emit func(Delta) error) (Result, error) {
	b := g.bounds(req)
	defer b.report()
	var kept []gateway.Source
	sent := 0
	res, err := g.next.Stream(ctx, req, func(d Delta) error {
		d.Content = Clean(d.Content)
		d.Sources = b.sources(d.Sources)
		kept = append(kept, d.Sources...)
		var over error
		if sent+len(d.Content) > b.maxText {
			b.cut(CutText)
			d.Content = Cut(d.Content, b.maxText-sent)
			over = fmt.Errorf("%w: the upstream sent more text than %d output tokens can hold (%d bytes)",
				ErrStreamBroken, b.maxText/BytesPerToken, b.maxText)
		}
		sent += len(d.Content)
		if d.Content != "" || len(d.Sources) > 0 {
			if err := emit(d); err != nil {
				return err
			}
		}
		return over
	})
	if errors.Is(err, ErrTooLong) {
		b.cut(CutText)
	}
	res.Content, res.Reasoning = Cut(Clean(res.Content), sent), Clean(res.Reasoning)
	res.Sources = kept
	res.Verdict = b.verdict(res.Verdict)
	return res, err
}

// bounds are one reply's: what it has passed so far.
type bounds struct {
	maxText int
	seen    int // sources the upstream sent
	cuts    map[string]bool
	onCut   func(string)
}

func (g *guarded) bounds(req *Request) bounds {
	return bounds{maxText: MaxTextBytes(req), onCut: g.onCut}
}

func (b *bounds) cut(what string) {
	if b.cuts == nil {
		b.cuts = map[string]bool{}
	}
	b.cuts[what] = true
}

// report tells onCut each bound the reply passed.
func (b *bounds) report() {
	if b.onCut == nil {
		return
	}
	for _, what := range Cuts {
		if b.cuts[what] {
			b.onCut(what)
		}
	}
}

// sources cleans and bounds sources, in place, and returns those kept.
func (b *bounds) sources(sources []gateway.Source) []gateway.Source {
	kept := sources[:0]
	for _, s := range sources {
		b.seen++
		if b.seen > MaxSources {
			b.cut(CutSources)
			continue
		}
		if s.URL = Clean(s.URL); len(s.URL) > MaxURLBytes {
			b.cut(CutURL)
			continue
		}
		s.Title = b.text(s.Title, MaxTitleBytes, CutTitle)
		s.Snippet = b.text(s.Snippet, MaxSnippetBytes, CutSnippet)
		kept = append(kept, s)
	}
	if len(kept) == 0 {
		return nil
	}
	return kept
}

func (b *bounds) verdict(v string) string { return b.text(v, MaxVerdictBytes, CutVerdict) }

// text is s cleaned and cut to max bytes, the cut recorded as what.
func (b *bounds) text(s string, max int, what string) string {
	s = Clean(s)
	if len(s) > max {
		b.cut(what)
		s = Cut(s, max)
	}
	return s
}
