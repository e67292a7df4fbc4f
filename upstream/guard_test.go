package upstream_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// scripted is a provider that returns what the test gives it.
type scripted struct {
	res    upstream.Result
	deltas []upstream.Delta
	err    error
}

func (p scripted) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	return p.res, p.err
}

func (p scripted) Stream(_ context.Context, _ *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	for _, d := range p.deltas {
		if err := emit(d); err != nil {
			return p.res, err
		}
	}
	return p.res, p.err
}

func TestClean(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"plain":            "plain",
		"a\x00b":           "ab",
		"\x00\x00":         "",
		"bad \xff\xfe end": "bad \uFFFD end",
		"ok ✓":             "ok ✓",
		"\xe2\x82":         "\uFFFD",
	} {
		got := upstream.Clean(in)
		require.Equal(t, want, got, "%q", in)
		require.True(t, utf8.ValidString(got))
	}
}

// TestCut: a cut keeps whole characters, and keeps nothing of a text whose
// bytes before the cut start no character (an upstream's reasoning is cut
// before it is cleaned).
func TestCut(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"plain", 10, "plain"},
		{"plain", 5, "plain"},
		{"plain", 2, "pl"},
		{"hé!", 2, "h"},
		{"hé!", 3, "hé"},
		{"é", 0, ""},
		{"\x80\x80\x80", 2, ""},
	} {
		require.Equal(t, c.want, upstream.Cut(c.in, c.n), "%q cut to %d", c.in, c.n)
	}
}

func TestGuardCleansEverythingReturned(t *testing.T) {
	t.Parallel()
	hostile := upstream.Result{
		Content: "a\x00b\xff", Reasoning: "r\x00\xfe", Verdict: "v\x00",
		Sources: []gateway.Source{{Title: "t\x00", URL: "u\x00\xfe", Snippet: "s\x00"}},
	}
	p := upstream.Guard(scripted{res: hostile, deltas: []upstream.Delta{{Content: "\x00"}, {Content: "d\x00", Sources: []gateway.Source{{Title: "x\x00"}}}}}, nil)

	res, err := p.Complete(context.Background(), &upstream.Request{})
	require.NoError(t, err)
	require.Equal(t, "ab\uFFFD", res.Content)
	require.Equal(t, "r\uFFFD", res.Reasoning)
	require.Equal(t, "v", res.Verdict)
	require.Equal(t, []gateway.Source{{Title: "t", URL: "u\uFFFD", Snippet: "s"}}, res.Sources)

	var got []upstream.Delta
	res, err = p.Stream(context.Background(), &upstream.Request{}, func(d upstream.Delta) error {
		got = append(got, d)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []upstream.Delta{{Content: "d", Sources: []gateway.Source{{Title: "x"}}}}, got, "a delta left empty is not sent")
	require.Equal(t, "r\uFFFD", res.Reasoning)
	require.Equal(t, "v", res.Verdict)

	stop := errors.New("the client left")
	_, err = p.Stream(context.Background(), &upstream.Request{}, func(upstream.Delta) error { return stop })
	require.ErrorIs(t, err, stop, "emit's error stops the stream")
}

// TestGuardBoundsHoldTheirLimit: what is as long as its bound passes whole,
// reported as no cut; sources none of which is kept are no slice at all (the
// upstream's are not held).
func TestGuardBoundsHoldTheirLimit(t *testing.T) {
	t.Parallel()
	req := &upstream.Request{MaxOutputTokens: 1}
	atBound := gateway.Source{
		URL:     "https://a.example/" + strings.Repeat("u", upstream.MaxURLBytes-len("https://a.example/")),
		Title:   strings.Repeat("t", upstream.MaxTitleBytes),
		Snippet: strings.Repeat("s", upstream.MaxSnippetBytes),
	}
	text := strings.Repeat("a", upstream.MaxTextBytes(req))
	var cuts []string
	onCut := func(bound string) { cuts = append(cuts, bound) }
	res, err := upstream.Guard(scripted{res: upstream.Result{Content: text, Sources: []gateway.Source{atBound}, Verdict: strings.Repeat("v", upstream.MaxVerdictBytes)}}, onCut).
		Complete(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, []gateway.Source{atBound}, res.Sources)
	require.Len(t, res.Verdict, upstream.MaxVerdictBytes)

	res, err = upstream.Guard(scripted{deltas: []upstream.Delta{{Content: text[:10]}, {Content: text[10:]}}, res: upstream.Result{Content: text}}, onCut).
		Stream(context.Background(), req, func(upstream.Delta) error { return nil })
	require.NoError(t, err, "a stream of as much text as its tokens hold is whole")
	require.Equal(t, text, res.Content)
	require.Empty(t, cuts)

	// A byte more is past the bound.
	pastTitle := atBound
	pastTitle.Title += "t"
	res, err = upstream.Guard(scripted{res: upstream.Result{Content: "a", Sources: []gateway.Source{pastTitle}}}, onCut).Complete(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, []gateway.Source{atBound}, res.Sources)
	require.Equal(t, []string{upstream.CutTitle}, cuts)

	cuts = nil
	pastURL := atBound
	pastURL.URL += "/"
	res, err = upstream.Guard(scripted{res: upstream.Result{Content: "a", Sources: []gateway.Source{pastURL}}}, onCut).Complete(context.Background(), req)
	require.NoError(t, err)
	require.Nil(t, res.Sources)
	require.Equal(t, []string{upstream.CutURL}, cuts)
}

func TestMaxTextBytesIsBounded(t *testing.T) {
	t.Parallel()
	require.Equal(t, 1<<40, upstream.MaxTextBytes(&upstream.Request{MaxOutputTokens: math.MaxUint64}), "no overflow: a terabyte at most")
}

func TestKind(t *testing.T) {
	t.Parallel()
	require.Equal(t, "unavailable", upstream.Kind(upstream.ErrUnavailable))
	require.Equal(t, "denied", upstream.Kind(fmt.Errorf("%w: %w", upstream.ErrUnavailable, upstream.ErrDenied)))
	require.Equal(t, "failed", upstream.Kind(upstream.ErrFailed))
	require.Equal(t, "rejected", upstream.Kind(&upstream.RejectedError{}))
	require.Equal(t, "broken", upstream.Kind(upstream.ErrStreamBroken))
	require.Equal(t, "cancelled", upstream.Kind(context.Canceled))
	require.Equal(t, "other", upstream.Kind(errors.New("x")))
	require.Empty(t, upstream.Kind(nil))
}

// TestGuardBoundsWhatIsReturned pins the bounds of a reply (D11): an upstream
// cannot make the gateway hold, store or send more text than the request's
// output tokens can hold, more than MaxSources sources, or fields past their
// bounds, and each bound passed is reported once a reply.
func TestGuardBoundsWhatIsReturned(t *testing.T) {
	t.Parallel()
	req := &upstream.Request{MaxOutputTokens: 4} // 1,024 bytes of text
	maxText := upstream.MaxTextBytes(req)
	require.Equal(t, 4*upstream.BytesPerToken, maxText)
	require.Equal(t, 64000*upstream.BytesPerToken, upstream.MaxTextBytes(&upstream.Request{Model: gateway.ModelReasoning}),
		"no ceiling sent: the model's")

	// Many sources, each citing the whole (long) text: sent as they are,
	// they would repeat it in the reply as many times.
	long := strings.Repeat("é", upstream.MaxSnippetBytes) // 2 bytes a character
	hostileSources := func() []gateway.Source {
		var out []gateway.Source
		out = append(out, gateway.Source{URL: "https://a.example/" + strings.Repeat("x", upstream.MaxURLBytes), Title: "too long a URL"})
		for i := range 2 * upstream.MaxSources {
			out = append(out, gateway.Source{URL: fmt.Sprintf("https://a.example/%d", i), Title: "t" + long, Snippet: "s" + long})
		}
		return out
	}
	checkSources := func(t *testing.T, got []gateway.Source) {
		t.Helper()
		require.Len(t, got, upstream.MaxSources-1, "the first MaxSources sent, less the one with too long a URL")
		for i, s := range got {
			require.Equal(t, fmt.Sprintf("https://a.example/%d", i), s.URL)
			require.Len(t, s.Title, upstream.MaxTitleBytes-1, "cut at a character boundary")
			require.Len(t, s.Snippet, upstream.MaxSnippetBytes-1)
			require.True(t, utf8.ValidString(s.Title) && utf8.ValidString(s.Snippet))
		}
	}

	t.Run("Complete", func(t *testing.T) {
		t.Parallel()
		var cuts []string
		p := upstream.Guard(scripted{res: upstream.Result{
			Content: strings.Repeat("a", maxText), Sources: hostileSources(), Verdict: strings.Repeat("v", 300),
		}}, func(bound string) { cuts = append(cuts, bound) })
		res, err := p.Complete(context.Background(), req)
		require.NoError(t, err, "text up to the bound is a reply")
		require.Len(t, res.Content, maxText)
		checkSources(t, res.Sources)
		require.Len(t, res.Verdict, upstream.MaxVerdictBytes)
		require.Equal(t, []string{upstream.CutSources, upstream.CutURL, upstream.CutTitle, upstream.CutSnippet, upstream.CutVerdict}, cuts)

		cuts = nil
		p = upstream.Guard(scripted{res: upstream.Result{Content: strings.Repeat("a", maxText+1), UsageReported: true, OutputTokens: 4}},
			func(bound string) { cuts = append(cuts, bound) })
		res, err = p.Complete(context.Background(), req)
		require.ErrorIs(t, err, upstream.ErrFailed, "more text than its tokens can hold: the upstream ran it, and it failed")
		require.Equal(t, upstream.Result{}, res)
		require.Equal(t, []string{upstream.CutText}, cuts)

		cuts = nil
		tooLong := fmt.Errorf("%w: %w", upstream.ErrFailed, upstream.ErrTooLong)
		p = upstream.Guard(scripted{err: tooLong}, func(bound string) { cuts = append(cuts, bound) })
		_, err = p.Complete(context.Background(), req)
		require.ErrorIs(t, err, upstream.ErrTooLong)
		require.Equal(t, []string{upstream.CutText}, cuts, "a reply its provider stopped reading passed its text's bound")
	})

	t.Run("Stream", func(t *testing.T) {
		t.Parallel()
		var cuts []string
		sources := hostileSources()
		deltas := []upstream.Delta{{Content: "abc", Sources: sources[:50]}, {Sources: sources[50:]}}
		for range maxText {
			deltas = append(deltas, upstream.Delta{Content: "é"}) // the last one that fits is cut: 1 byte left
		}
		p := upstream.Guard(scripted{deltas: deltas, res: upstream.Result{Content: "abc" + strings.Repeat("é", maxText)}},
			func(bound string) { cuts = append(cuts, bound) })
		var text strings.Builder
		var sent []gateway.Source
		res, err := p.Stream(context.Background(), req, func(d upstream.Delta) error {
			text.WriteString(d.Content)
			sent = append(sent, d.Sources...)
			return nil
		})
		require.ErrorIs(t, err, upstream.ErrStreamBroken, "the stream breaks off at the bound")
		require.Len(t, text.String(), maxText-1, "the text up to the bound, cut at a character boundary")
		require.True(t, utf8.ValidString(text.String()))
		require.Equal(t, text.String(), res.Content, "the result holds the text sent, no more")
		checkSources(t, sent)
		require.Equal(t, sent, res.Sources, "the result holds the sources sent")
		require.Equal(t, []string{upstream.CutText, upstream.CutSources, upstream.CutURL, upstream.CutTitle, upstream.CutSnippet}, cuts)

		cuts = nil
		tooLong := fmt.Errorf("%w: %w", upstream.ErrStreamBroken, upstream.ErrTooLong)
		p = upstream.Guard(scripted{deltas: []upstream.Delta{{Content: "kept"}}, res: upstream.Result{Content: "kept"}, err: tooLong},
			func(bound string) { cuts = append(cuts, bound) })
		res, err = p.Stream(context.Background(), req, func(upstream.Delta) error { return nil })
		require.ErrorIs(t, err, upstream.ErrTooLong)
		require.Equal(t, "kept", res.Content)
		require.Equal(t, []string{upstream.CutText}, cuts, "a stream whose line its provider stopped reading passed its text's bound")
	})
}

// TestRetryAfter: a wait is carried when positive, at most MaxRetryAfter.
func TestRetryAfter(t *testing.T) {
	t.Parallel()
	for asked, want := range map[time.Duration]time.Duration{
		-time.Second: 0,
		0:            0,
		time.Second:  time.Second,
		time.Hour:    upstream.MaxRetryAfter,
	} {
		err := upstream.WithRetryAfter(upstream.ErrUnavailable, asked)
		require.ErrorIs(t, err, upstream.ErrUnavailable)
		require.Equal(t, want, upstream.RetryAfter(err), "%s asked", asked)
	}
}

func TestParseModelPairs(t *testing.T) {
	t.Parallel()
	got, err := upstream.ParseModelPairs(" instant = a ,, reasoning=b ,")
	require.NoError(t, err)
	require.Equal(t, map[gateway.Model]string{gateway.ModelInstant: "a", gateway.ModelReasoning: "b"}, got)
	got, err = upstream.ParseModelPairs("")
	require.NoError(t, err)
	require.Empty(t, got)
	for in, want := range map[string]string{
		"instant":   "not of the form model=value",
		"instant= ": "not of the form model=value",
		"fastest=a": `unknown model "fastest"`,
	} {
		_, err := upstream.ParseModelPairs(in)
		require.ErrorContains(t, err, want, in)
	}
}
