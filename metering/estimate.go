package metering

import (
	"fmt"
	"sync"
	"unicode/utf8"

	"github.com/tiktoken-go/tokenizer"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// Tokenizer counts tokens with the o200k_base vocabulary, compiled into the binary.
type Tokenizer struct {
	codec tokenizer.Codec
	fast  *counter
}

var (
	defaultTokenizer     *Tokenizer
	defaultTokenizerErr  error
	defaultTokenizerOnce sync.Once
)

// DefaultTokenizer returns the process-wide tokenizer, loaded once.
func DefaultTokenizer() (*Tokenizer, error) {
	defaultTokenizerOnce.Do(func() {
		codec, err := tokenizer.Get(tokenizer.O200kBase)
		if err != nil {
			defaultTokenizerErr = fmt.Errorf("error loading o200k_base vocabulary: %w", err)
			return
		}
		defaultTokenizer = &Tokenizer{codec: codec, fast: newCounter(codec)}
	})
	return defaultTokenizer, defaultTokenizerErr
}

// Segment bounds of Count. Text is counted in segments cut where the o200k
// pre-tokenizer starts a piece anyway (after an ASCII letter or digit, before a
// space: no piece holds both), so ordinary text counts exactly. A stretch with
// no such place (whitespace, one long "word", emoji) is cut every runBytes,
// which adds at most one token per cut; 384 is a multiple of the periods of
// the tokens uniform runs merge into (3 digits, 4-byte emoji, 8 letters, 128
// spaces), so those still count exactly.
// Identical segments are counted once per call, so a repeated run costs about
// one segment.
const (
	segmentBytes    = 2 << 10
	maxSegmentBytes = 4 << 10
	runBytes        = 384
	// maxTokenBytes is the longest o200k_base token, in bytes.
	maxTokenBytes = 128
)

// Count returns the number of tokens in s, at a cost linear in len(s) whatever
// s holds (see segmentBytes).
func (t *Tokenizer) Count(s string) uint64 {
	return t.CountUpTo(s, ^uint64(0))
}

// CountUpTo is Count, but stops once the count passes limit and then returns
// limit+1: text whose count matters only up to a bound costs no more than that.
func (t *Tokenizer) CountUpTo(s string, limit uint64) uint64 {
	if limit < 1<<40 && uint64(len(s)) > (limit+1)*maxTokenBytes {
		return limit + 1 // no token is longer than maxTokenBytes
	}
	if len(s) <= maxSegmentBytes {
		return past(t.count(s), limit)
	}
	var total uint64
	seen := map[string]uint64{}
	for s != "" && total <= limit {
		seg := s[:segmentEnd(s)]
		s = s[len(seg):]
		n, ok := seen[seg]
		if !ok {
			n = t.count(seg)
			seen[seg] = n
		}
		total += n
	}
	return past(total, limit)
}

// past is n, or limit+1 when n passes limit.
func past(n, limit uint64) uint64 {
	if n > limit {
		return limit + 1
	}
	return n
}

func (t *Tokenizer) count(s string) uint64 {
	if s == "" {
		return 0
	}
	if utf8.ValidString(s) {
		return t.fast.count(s)
	}
	// The codec counts invalid UTF-8 too, its bytes as they are (its default
	// error mode). It fails only when its pattern cannot be matched; the
	// bytes are then a safe upper bound, each token holding one at least.
	n, err := t.codec.Count(s)
	if err != nil {
		return uint64(len(s))
	}
	return uint64(n)
}

// segmentEnd is where the first segment of s ends: all of s when it is short;
// else the first piece start at or after segmentBytes, or the last before
// maxSegmentBytes; else, in a run with none, runBytes moved back to a rune
// start (bytes of invalid UTF-8 that start none are cut at runBytes).
func segmentEnd(s string) int {
	if len(s) <= maxSegmentBytes {
		return len(s)
	}
	last := 0
	for i := 1; i < maxSegmentBytes; i++ {
		if s[i] == ' ' && isASCIIAlnum(s[i-1]) {
			if i >= segmentBytes {
				return i
			}
			last = i
		}
	}
	if last >= runBytes {
		return last
	}
	// At a character's start, which any four bytes of valid UTF-8 hold; in
	// bytes that start none (invalid UTF-8), where the run ends.
	for end := runBytes; end > runBytes-utf8.UTFMax; end-- {
		if utf8.RuneStart(s[end]) {
			return end
		}
	}
	return runBytes
}

func isASCIIAlnum(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9'
}

// Estimate is the pre-dispatch cost of a request: the tokenizer's count of its
// input and its accepted output ceiling, both priced.
type Estimate struct {
	InputTokens uint64
	InputRungs  int64
	// OutputRungs is max_output_rungs priced as output.
	OutputRungs int64
}

// Total is the admission estimate: input plus the priced output ceiling.
func (e Estimate) Total() int64 { return e.InputRungs + e.OutputRungs }

// Estimator prices requests before they are dispatched, and what the upstream
// reports after.
type Estimator struct {
	Tokenizer *Tokenizer
	RateCard  *RateCard
	// OnClamp, when set, is told of every upstream token count that cannot
	// be true: past its bound, or none for text there was.
	OnClamp func(Clamp)
}

// Clamp is an upstream token count that cannot be true, and what is billed
// instead: a count past its bound (decisions D11), cut to the bound; or a
// count of no tokens for text there was (the input sent, output received),
// replaced by the tokenizer's count of that text.
type Clamp struct {
	Model gateway.Model
	// Side is "input" or "output".
	Side     string
	Reported uint64
	Bound    uint64
}

// perMessageTokens is the allowance per message sent, for the chat template's
// tokens around it.
const perMessageTokens = 16

// InputBound is the most input tokens an upstream may report for req (D11):
// the UTF-8 byte length of the messages sent plus 16 per message.
func InputBound(req gateway.Request) uint64 {
	n := uint64(len(req.Prompt)) + perMessageTokens
	if req.CustomInstructions != "" {
		n += uint64(len(req.CustomInstructions)) + perMessageTokens
	}
	return n
}

// InputTokens counts the tokens the upstream will read: the system message and the prompt.
func (e *Estimator) InputTokens(req gateway.Request) uint64 {
	return e.Tokenizer.Count(req.CustomInstructions) + e.Tokenizer.Count(req.Prompt)
}

// Estimate prices req for the entry point before dispatch.
func (e *Estimator) Estimate(req gateway.Request, entry gateway.EntryPoint) (Estimate, error) {
	tokens := e.InputTokens(req)
	u, err := e.RateCard.Usage(req.Model, entry, tokens, req.MaxOutputRungs)
	if err != nil {
		return Estimate{}, err
	}
	return Estimate{InputTokens: tokens, InputRungs: u.InputRungs, OutputRungs: u.OutputRungs}, nil
}

// Actual prices what the upstream produced for req: its reported token counts,
// or, when it reported none (a stream cut short), the tokenizer's count of the
// input and of the output received, a reasoning model's thinking with its
// content (the upstream charges for both). A reported count of no tokens for
// text there was (a prompt is never empty; output only when text was
// received) is none: servers that report zeros, or their counts under other
// names, would have made their replies free, so the tokenizer counts that
// side.
// Either is clamped (D11): output to the output ceiling sent, input to
// InputBound. So the admission estimate's output part is a true upper bound,
// and no upstream can make a counter overflow.
func (e *Estimator) Actual(req gateway.Request, entry gateway.EntryPoint, res upstream.Result) (gateway.Usage, error) {
	in, out := res.InputTokens, res.OutputTokens
	if !res.UsageReported {
		in, out = e.InputTokens(req), e.outputTokens(req, res)
	} else {
		if in == 0 {
			in = e.counted(req.Model, "input", e.InputTokens(req))
		}
		if out == 0 && (res.Content != "" || res.Reasoning != "") {
			out = e.counted(req.Model, "output", e.outputTokens(req, res))
		}
	}
	in = e.clamp(req.Model, "input", in, InputBound(req))
	out = e.clamp(req.Model, "output", out, req.MaxOutputRungs)
	return e.RateCard.Usage(req.Model, entry, in, out)
}

// outputTokens counts the output of res, its content and its thinking, up
// to one past the output ceiling of req (CountUpTo): the sum of the two may
// pass it, which clamp then reports.
func (e *Estimator) outputTokens(req gateway.Request, res upstream.Result) uint64 {
	out := e.Tokenizer.CountUpTo(res.Content, req.MaxOutputRungs)
	if res.Reasoning != "" {
		out += e.Tokenizer.CountUpTo(res.Reasoning, req.MaxOutputRungs)
	}
	return out
}

// counted reports a count of no tokens replaced by the tokenizer's, n, and
// returns n.
func (e *Estimator) counted(model gateway.Model, side string, n uint64) uint64 {
	if n > 0 && e.OnClamp != nil {
		e.OnClamp(Clamp{Model: model, Side: side, Reported: 0, Bound: n})
	}
	return n
}

func (e *Estimator) clamp(model gateway.Model, side string, reported, bound uint64) uint64 {
	if reported <= bound {
		return reported
	}
	if e.OnClamp != nil {
		e.OnClamp(Clamp{Model: model, Side: side, Reported: reported, Bound: bound})
	}
	return bound
}
