package metering_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tiktoken-go/tokenizer"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/wordtext"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream"
)

// adversarial are prompts of the largest accepted size built to make a
// tokenizer slow: long runs its pre-tokenizer cannot split.
var adversarial = map[string]string{
	"whitespace": strings.Repeat(" ", gateway.MaxPromptBytes),
	"newlines":   strings.Repeat("\n", gateway.MaxPromptBytes),
	"one word":   strings.Repeat("a", gateway.MaxPromptBytes),
	"emoji":      strings.Repeat("😀", gateway.MaxPromptBytes/4),
	"digits":     strings.Repeat("7", gateway.MaxPromptBytes),
	"tabs":       strings.Repeat(" \t", gateway.MaxPromptBytes/2),
	"prose":      strings.Repeat("The quick brown fox jumps over the lazy dog, said Tom. ", gateway.MaxPromptBytes/55),
	"random":     randomText(gateway.MaxPromptBytes),
	"words":      wordtext.Random(gateway.MaxPromptBytes),
}

// randomText is text that never repeats a segment: words of random letters,
// digits and punctuation.
func randomText(n int) string {
	rng := rand.New(rand.NewPCG(1, 2))
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'-"
	var b strings.Builder
	for b.Len() < n-16 {
		for range 1 + rng.IntN(9) {
			b.WriteByte(alphabet[rng.IntN(len(alphabet))])
		}
		b.WriteByte(" \n\t"[min(rng.IntN(12), 2)/2*rng.IntN(3)%3])
	}
	return b.String()
}

// tokenizers returns the gateway's tokenizer and the library's codec it
// counts as.
func tokenizers(t *testing.T) (*metering.Tokenizer, tokenizer.Codec) {
	t.Helper()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	codec, err := tokenizer.Get(tokenizer.O200kBase)
	require.NoError(t, err)
	return tok, codec
}

// TestCountIsExactOnText: segments are cut where the tokenizer starts a piece
// anyway, so ordinary text counts exactly as one call of the codec would.
func TestCountIsExactOnText(t *testing.T) {
	t.Parallel()
	tok, codec := tokenizers(t)
	texts := []string{
		adversarial["prose"],
		strings.Repeat("Rungs meter every call; ledgers don't lie. 42 items, 3.14 ratio!\n", 900),
		strings.Repeat("función análisis über straße 東京 ", 2000),
		// Runs of spaces before a newline, which o200k takes as one piece,
		// placed so that a cut at any space would fall inside one.
		"xyz" + strings.Repeat("abcd   \n", 2000),
	}
	for _, text := range texts {
		want, err := codec.Count(text)
		require.NoError(t, err)
		require.Equal(t, uint64(want), tok.Count(text))
	}
}

// TestCountStaysHonestOnRuns: a run with no piece boundary is cut at a fixed
// size, which adds at most one token per cut and never undercounts by more.
func TestCountStaysHonestOnRuns(t *testing.T) {
	t.Parallel()
	tok, codec := tokenizers(t)
	for name, text := range adversarial {
		want, err := codec.Count(text)
		require.NoError(t, err)
		got := float64(tok.Count(text))
		cuts := float64(len(text)/384 + 1)
		require.InDelta(t, float64(want), got, cuts, "%s", name)
	}
}

func TestCountUpTo(t *testing.T) {
	t.Parallel()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	text := adversarial["prose"]
	full := tok.Count(text)
	require.Equal(t, full, tok.CountUpTo(text, full), "a bound that is not passed changes nothing")
	require.Equal(t, uint64(101), tok.CountUpTo(text, 100))
	require.Equal(t, uint64(11), tok.CountUpTo(strings.Repeat(" ", 1<<20), 10), "no token is longer than 128 bytes")
	require.Zero(t, tok.CountUpTo("", 0))
}

// TestCountOfInvalidUTF8: text that is not valid UTF-8 (no request brings
// any: a body that is not is refused, and the guard cleans what an upstream
// sends) counts as the codec counts it, or within a token a cut when long,
// as any text does.
func TestCountOfInvalidUTF8(t *testing.T) {
	t.Parallel()
	tok, codec := tokenizers(t)
	for _, text := range []string{"\xff", "\xff\xfe and the rest", "cut mid-character \xc3", "h\xc3\xa9llo\x80w\xc3\xb6rld"} {
		want, err := codec.Count(text)
		require.NoError(t, err)
		require.Equal(t, uint64(want), tok.Count(text), "%q", text)
	}
	// Runs of bytes that start no character are cut as other runs are, every
	// 384 bytes (TestCountStaysHonestOnRuns), not at each byte.
	long := strings.Repeat("\x80", 3*gateway.MaxPromptBytes/4) + strings.Repeat("text \xff", gateway.MaxPromptBytes/24)
	want, err := codec.Count(long)
	require.NoError(t, err)
	require.InDelta(t, float64(want), float64(tok.Count(long)), float64(len(long)/384+1))
}

// clampRecorder returns an estimator whose clamp hook records each clamp in
// the slice returned.
func clampRecorder(t *testing.T) (*metering.Estimator, *[]metering.Clamp) {
	t.Helper()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	clamps := new([]metering.Clamp)
	return &metering.Estimator{Tokenizer: tok, RateCard: defaultCard(t), OnClamp: func(c metering.Clamp) { *clamps = append(*clamps, c) }}, clamps
}

// TestActualClampsUpstreamCounts pins D11: an upstream cannot bill past the
// output ceiling sent, or past the input it was sent.
func TestActualClampsUpstreamCounts(t *testing.T) {
	t.Parallel()
	est, clamps := clampRecorder(t)
	req := gateway.Request{Prompt: "hello there", CustomInstructions: "be brief", Model: gateway.ModelReasoning, MaxOutputRungs: 40}
	inBound := uint64(len("hello there") + 16 + len("be brief") + 16)
	require.Equal(t, inBound, metering.InputBound(req))

	u, err := est.Actual(req, gateway.EntryResponses, upstream.Result{UsageReported: true, InputTokens: 1 << 62, OutputTokens: math.MaxUint64})
	require.NoError(t, err)
	require.Equal(t, int64(inBound), u.InputTokens)
	require.Equal(t, int64(40), u.OutputTokens)
	require.Equal(t, int64(40*4), u.OutputRungs, "the estimate's output part is a true upper bound")
	require.Equal(t, []metering.Clamp{
		{Model: gateway.ModelReasoning, Side: "input", Reported: 1 << 62, Bound: inBound},
		{Model: gateway.ModelReasoning, Side: "output", Reported: math.MaxUint64, Bound: 40},
	}, *clamps)

	*clamps = nil
	u, err = est.Actual(req, gateway.EntryResponses, upstream.Result{Content: strings.Repeat("word ", 1000)})
	require.NoError(t, err)
	require.Equal(t, int64(40), u.OutputTokens, "counted output is clamped too")
	require.Len(t, *clamps, 1)

	*clamps = nil
	_, err = est.Actual(req, gateway.EntryResponses, upstream.Result{UsageReported: true, InputTokens: 3, OutputTokens: 5})
	require.NoError(t, err)
	require.Empty(t, *clamps, "honest counts pass untouched")
	u, err = est.Actual(req, gateway.EntryResponses, upstream.Result{UsageReported: true, InputTokens: inBound, OutputTokens: 40})
	require.NoError(t, err)
	require.Equal(t, [2]int64{int64(inBound), 40}, [2]int64{u.InputTokens, u.OutputTokens})
	require.Empty(t, *clamps, "counts at their bounds are not past them")
}

// TestActualCountsWhatIsReportedAsNothing: a report of no tokens for text
// there was (servers that report zeros, or their counts under other names)
// would make a reply free; the tokenizer counts that side instead, and the
// clamp hook is told. No output for no text is true, and passes.
func TestActualCountsWhatIsReportedAsNothing(t *testing.T) {
	t.Parallel()
	est, clamps := clampRecorder(t)
	req := gateway.Request{Prompt: "hello there", CustomInstructions: "be brief", Model: gateway.ModelInstant, MaxOutputRungs: 400}
	const content = "a reply of some words"
	counted, err := est.Actual(req, gateway.EntryResponses, upstream.Result{Content: content})
	require.NoError(t, err)
	require.Positive(t, counted.InputTokens)
	require.Positive(t, counted.OutputTokens)

	for name, tc := range map[string]struct {
		in, out   uint64
		want      gateway.Usage
		corrected []string
	}{
		"zeros":            {0, 0, counted, []string{"input", "output"}},
		"no output":        {7, 0, usageOf(t, est, req, 7, uint64(counted.OutputTokens)), []string{"output"}},
		"no input":         {0, 9, usageOf(t, est, req, uint64(counted.InputTokens), 9), []string{"input"}},
		"counts, reported": {7, 9, usageOf(t, est, req, 7, 9), nil},
	} {
		*clamps = nil
		u, err := est.Actual(req, gateway.EntryResponses, upstream.Result{Content: content, UsageReported: true, InputTokens: tc.in, OutputTokens: tc.out})
		require.NoError(t, err, name)
		require.Equal(t, tc.want, u, name)
		var sides []string
		for _, c := range *clamps {
			require.Zero(t, c.Reported, name)
			require.Positive(t, c.Bound, name)
			sides = append(sides, c.Side)
		}
		require.Equal(t, tc.corrected, sides, name)
	}

	*clamps = nil
	u, err := est.Actual(req, gateway.EntryResponses, upstream.Result{UsageReported: true, InputTokens: 7})
	require.NoError(t, err)
	require.Zero(t, u.OutputTokens, "no output for no text is true")
	require.Empty(t, *clamps)
}

// TestActualCountsThinking: a reasoning model's thinking is output the
// upstream charges for; when no usage is reported (a stream cut short while
// the model thought) or none for the output, the tokenizer counts it with
// the content, as much as the ceiling holds. A reported count stands.
func TestActualCountsThinking(t *testing.T) {
	t.Parallel()
	est, clamps := clampRecorder(t)
	req := gateway.Request{Prompt: "hello there", Model: gateway.ModelReasoning, MaxOutputRungs: 400}
	const content, thinking = "a reply of some words", "first, what is asked; then what answers it"
	count := func(s string) int64 { return int64(est.Tokenizer.CountUpTo(s, req.MaxOutputRungs)) }

	for name, res := range map[string]upstream.Result{
		"not reported":         {Content: content, Reasoning: thinking},
		"reported as nothing":  {Content: content, Reasoning: thinking, UsageReported: true, InputTokens: 3},
		"thinking, no content": {Reasoning: thinking, UsageReported: true, InputTokens: 3},
	} {
		u, err := est.Actual(req, gateway.EntryResponses, res)
		require.NoError(t, err, name)
		require.Equal(t, count(res.Content)+count(thinking), u.OutputTokens, name)
	}

	u, err := est.Actual(req, gateway.EntryResponses, upstream.Result{Content: content, Reasoning: thinking, UsageReported: true, InputTokens: 3, OutputTokens: 5})
	require.NoError(t, err)
	require.Equal(t, int64(5), u.OutputTokens, "a reported count holds the thinking already")

	*clamps = nil
	short := req
	short.MaxOutputRungs = uint64(count(content)) + 1
	u, err = est.Actual(short, gateway.EntryResponses, upstream.Result{Content: content, Reasoning: thinking})
	require.NoError(t, err)
	require.Equal(t, short.MaxOutputRungs, uint64(u.OutputTokens), "the ceiling holds content and thinking together")
	require.Len(t, *clamps, 1)
}

// usageOf is the usage est prices for req's counts, in and out, as reported.
func usageOf(t *testing.T, est *metering.Estimator, req gateway.Request, in, out uint64) gateway.Usage {
	t.Helper()
	u, err := est.RateCard.Usage(req.Model, gateway.EntryResponses, in, out)
	require.NoError(t, err)
	return u
}

// BenchmarkEstimateAdversarial prices the slowest prompts the API accepts; each
// must cost a few milliseconds at most (see docs/benchmarks.md).
// BenchmarkCountReference counts the same prompts with the library's codec,
// for a same-run comparison.
func BenchmarkEstimateAdversarial(b *testing.B) {
	tok, err := metering.DefaultTokenizer()
	require.NoError(b, err)
	est := &metering.Estimator{Tokenizer: tok, RateCard: defaultCard(b)}
	for _, name := range []string{"prose", "words", "random", "whitespace", "newlines", "one word", "emoji", "digits", "tabs"} {
		req := gateway.Request{Prompt: adversarial[name], Model: gateway.ModelInstant, MaxOutputRungs: 32000}
		b.Run(strings.ReplaceAll(name, " ", "_"), func(b *testing.B) {
			b.SetBytes(int64(len(req.Prompt)))
			for b.Loop() {
				if _, err := est.Estimate(req, gateway.EntryBatch); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkCountReference(b *testing.B) {
	codec, err := tokenizer.Get(tokenizer.O200kBase)
	require.NoError(b, err)
	for _, name := range []string{"prose", "words", "random", "whitespace", "newlines", "one word", "emoji", "digits", "tabs"} {
		text := adversarial[name]
		b.Run(strings.ReplaceAll(name, " ", "_"), func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				if _, err := codec.Count(text); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
