// Package sim is the built-in inference simulator (GATEWAY_UPSTREAM=sim): it
// answers deterministically from the prompt, counts tokens with the real
// tokenizer, paces its output per token, and returns sources and a verdict when
// web search is asked for.
package sim

import (
	"context"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream"
)

// DefaultTokenLatency is the simulated time per output token.
const DefaultTokenLatency = 2 * time.Millisecond

var vocabulary = strings.Fields(`the gateway routes each prompt through a model and meters
every rung it spends while evidence from sources supports the answer with care so
results stay grounded in retrieval and reasoning across instant elements batches
streams budgets ceilings replicas queues leases drains tokens context signal
latency throughput accuracy review summary detail example pattern structure`)

// Provider is the simulator. The zero TokenLatency means no pacing.
type Provider struct {
	Tokenizer    *metering.Tokenizer
	TokenLatency time.Duration
}

var _ upstream.Provider = (*Provider)(nil)

// Complete implements upstream.Provider.
func (p *Provider) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	req.Dispatched()
	res := p.answer(req)
	if err := p.pace(ctx, res.OutputTokens); err != nil {
		return upstream.Result{}, err
	}
	return res, nil
}

// Stream implements upstream.Provider: the same answer as Complete, a word at a
// time, paced per token, with the evidence on the first piece.
func (p *Provider) Stream(ctx context.Context, req *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	req.Dispatched()
	res := p.answer(req)
	sent := upstream.Result{Verdict: res.Verdict}
	words := strings.SplitAfter(res.Content, " ")
	for i, w := range words {
		if w == "" {
			continue
		}
		tokens := p.Tokenizer.Count(w)
		if err := p.pace(ctx, tokens); err != nil {
			return p.partial(req, sent), err
		}
		d := upstream.Delta{Content: w}
		if i == 0 {
			d.Sources = res.Sources
			sent.Sources = res.Sources
		}
		if err := emit(d); err != nil {
			return p.partial(req, sent), err
		}
		sent.Content += w
	}
	return res, nil
}

// partial is what a cut-short stream produced, with the simulator's own counts.
func (p *Provider) partial(req *upstream.Request, sent upstream.Result) upstream.Result {
	sent.UsageReported = true
	sent.InputTokens = p.Tokenizer.Count(req.System) + p.Tokenizer.Count(req.Prompt)
	sent.OutputTokens = p.Tokenizer.Count(sent.Content)
	return sent
}

// pace waits the simulated time of n output tokens.
func (p *Provider) pace(ctx context.Context, n uint64) error {
	if p.TokenLatency <= 0 || n == 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(time.Duration(n) * p.TokenLatency)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// answer derives the whole reply from the request, deterministically.
func (p *Provider) answer(req *upstream.Request) upstream.Result {
	h := fnv.New64a()
	_, _ = h.Write([]byte(req.Model))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(req.System))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(req.Prompt))
	seed := h.Sum64()
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))

	words := make([]string, 0, 64)
	words = append(words, fmt.Sprintf("[%s]", req.Model))
	for n := 16 + rng.IntN(48); n > 0; n-- {
		words = append(words, vocabulary[rng.IntN(len(vocabulary))])
	}
	content := strings.Join(words, " ") + "."
	out := p.Tokenizer.Count(content)
	for out > req.MaxOutputTokens && len(words) > 1 {
		words = words[:len(words)-1]
		content = strings.Join(words, " ")
		out = p.Tokenizer.Count(content)
	}
	if out > req.MaxOutputTokens {
		content, out = "", 0
	}

	res := upstream.Result{
		UsageReported: true,
		Content:       content,
		InputTokens:   p.Tokenizer.Count(req.System) + p.Tokenizer.Count(req.Prompt),
		OutputTokens:  out,
	}
	if req.Hints.WebSearch {
		for i := 1; i <= 2; i++ {
			res.Sources = append(res.Sources, gateway.Source{
				Title:   fmt.Sprintf("Simulated source %d for %s", i, req.Model),
				URL:     fmt.Sprintf("https://sim.invalid/evidence/%016x/%d", seed, i),
				Snippet: strings.Join(words[1:min(len(words), 8)], " "),
			})
		}
		res.Verdict = "supported"
	}
	return res
}
