package sim_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/sim"
)

func provider(t *testing.T, latency time.Duration) *sim.Provider {
	t.Helper()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	return &sim.Provider{Tokenizer: tok, TokenLatency: latency}
}

func TestDeterministicAndCounted(t *testing.T) {
	t.Parallel()
	p := provider(t, 0)
	req := upstream.Request{Model: gateway.ModelInstant, Prompt: "hello there", System: "be kind", MaxOutputTokens: 32000}
	a, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	b, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.NotEmpty(t, a.Content)
	require.Equal(t, p.Tokenizer.Count(a.Content), a.OutputTokens)
	require.Equal(t, p.Tokenizer.Count("hello there")+p.Tokenizer.Count("be kind"), a.InputTokens)
	require.Empty(t, a.Sources)
	require.Empty(t, a.Verdict)

	other, err := p.Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "something else", MaxOutputTokens: 32000})
	require.NoError(t, err)
	require.NotEqual(t, a.Content, other.Content)
}

func TestRespectsOutputCeiling(t *testing.T) {
	t.Parallel()
	p := provider(t, 0)
	for _, limit := range []uint64{1, 3, 10} {
		res, err := p.Complete(context.Background(), &upstream.Request{Model: gateway.ModelElements, Prompt: "long answer please", MaxOutputTokens: limit})
		require.NoError(t, err)
		require.LessOrEqual(t, res.OutputTokens, limit)
	}
}

func TestWebSearchGivesEvidence(t *testing.T) {
	t.Parallel()
	res, err := provider(t, 0).Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "news", MaxOutputTokens: 100, Hints: gateway.Hints{WebSearch: true}})
	require.NoError(t, err)
	require.Len(t, res.Sources, 2)
	require.NotEmpty(t, res.Sources[0].URL)
	require.Equal(t, "supported", res.Verdict)
}

func TestCancellation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := provider(t, time.Second).Complete(ctx, &upstream.Request{Model: gateway.ModelInstant, Prompt: "x", MaxOutputTokens: 100})
	require.ErrorIs(t, err, context.Canceled)
}

func TestStreamMatchesComplete(t *testing.T) {
	t.Parallel()
	p := provider(t, 0)
	req := upstream.Request{Model: gateway.ModelInstant, Prompt: "stream me", MaxOutputTokens: 32000, Hints: gateway.Hints{WebSearch: true}}
	whole, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	var text string
	var deltas []upstream.Delta
	res, err := p.Stream(context.Background(), &req, func(d upstream.Delta) error {
		deltas = append(deltas, d)
		text += d.Content
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, whole, res)
	require.Equal(t, whole.Content, text)
	require.Greater(t, len(deltas), 5)
	require.Equal(t, whole.Sources, deltas[0].Sources)
	for _, d := range deltas[1:] {
		require.Empty(t, d.Sources)
	}
}

func TestStreamCancelledReturnsPartial(t *testing.T) {
	t.Parallel()
	p := provider(t, time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	res, err := p.Stream(ctx, &upstream.Request{Model: gateway.ModelInstant, Prompt: "cut me short", MaxOutputTokens: 32000}, func(upstream.Delta) error {
		if n++; n == 3 {
			cancel()
		}
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	require.NotEmpty(t, res.Content)
	require.True(t, res.UsageReported)
	require.Equal(t, p.Tokenizer.Count(res.Content), res.OutputTokens)
}
