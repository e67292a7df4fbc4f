package metering

import (
	"fmt"
	"sync"

	"github.com/tiktoken-go/tokenizer"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// Tokenizer counts tokens with the o200k_base vocabulary, compiled into the binary.
type Tokenizer struct {
	codec tokenizer.Codec
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
		defaultTokenizer = &Tokenizer{codec: codec}
	})
	return defaultTokenizer, defaultTokenizerErr
}

// Count returns the number of tokens in s.
func (t *Tokenizer) Count(s string) uint64 {
	if s == "" {
		return 0
	}
	n, err := t.codec.Count(s)
	if err != nil {
		// The codec only fails on invalid UTF-8; count its bytes as a safe upper bound.
		return uint64(len(s))
	}
	return uint64(n)
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

// Estimator prices requests before they are dispatched.
type Estimator struct {
	Tokenizer *Tokenizer
	RateCard  *RateCard
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
// input and of the output received.
func (e *Estimator) Actual(req gateway.Request, entry gateway.EntryPoint, res upstream.Result) (gateway.Usage, error) {
	in, out := res.InputTokens, res.OutputTokens
	if !res.UsageReported {
		in, out = e.InputTokens(req), e.Tokenizer.Count(res.Content)
	}
	return e.RateCard.Usage(req.Model, entry, in, out)
}
