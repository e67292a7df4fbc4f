package sim_test

import (
	"context"
	"errors"
	"strings"
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
	dispatched := 0
	req := upstream.Request{Model: gateway.ModelInstant, Prompt: "hello there", System: "be kind", MaxOutputTokens: 32000, OnDispatch: func() { dispatched++ }}
	a, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	b, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.Equal(t, 2, dispatched, "each call is dispatched")
	require.True(t, strings.HasPrefix(a.Content, "[instant] "), "the answer names its model: %q", a.Content)
	require.NotEmpty(t, a.Content)
	require.Equal(t, p.Tokenizer.Count(a.Content), a.OutputTokens)
	require.Equal(t, p.Tokenizer.Count("hello there")+p.Tokenizer.Count("be kind"), a.InputTokens)
	require.Empty(t, a.Sources)
	require.Empty(t, a.Verdict)

	other, err := p.Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "something else", MaxOutputTokens: 32000})
	require.NoError(t, err)
	require.NotEqual(t, a.Content, other.Content)
	for _, differs := range []upstream.Request{
		{Model: gateway.ModelReasoning, Prompt: "hello there", System: "be kind", MaxOutputTokens: 32000},
		{Model: gateway.ModelInstant, Prompt: "hello there", System: "be brief", MaxOutputTokens: 32000},
	} {
		res, err := p.Complete(context.Background(), &differs)
		require.NoError(t, err)
		words, otherWords := strings.Fields(a.Content), strings.Fields(res.Content)
		require.NotEqual(t, words[1:], otherWords[1:], "the model and the instructions shape the answer too")
	}
}

// TestPacedPerToken: a call takes the simulated time of the tokens it
// answers with, at least.
func TestPacedPerToken(t *testing.T) {
	t.Parallel()
	const latency = time.Millisecond
	p := provider(t, latency)
	begun := time.Now()
	res, err := p.Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "paced", MaxOutputTokens: 32000})
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(begun), time.Duration(res.OutputTokens)*latency)
}

func TestRespectsOutputCeiling(t *testing.T) {
	t.Parallel()
	p := provider(t, 0)
	whole, err := p.Complete(context.Background(), &upstream.Request{Model: gateway.ModelElements, Prompt: "long answer please", MaxOutputTokens: 32000})
	require.NoError(t, err)
	words := strings.Fields(whole.Content)
	for _, limit := range []uint64{1, 3, 10, 20} {
		req := upstream.Request{Model: gateway.ModelElements, Prompt: "long answer please", MaxOutputTokens: limit}
		res, err := p.Complete(context.Background(), &req)
		require.NoError(t, err)
		require.LessOrEqual(t, res.OutputTokens, limit)
		require.Equal(t, p.Tokenizer.Count(res.Content), res.OutputTokens)
		// The answer is cut to the most of its words that fit.
		kept := len(strings.Fields(res.Content))
		require.Equal(t, strings.Join(words[:kept], " "), res.Content)
		require.Greater(t, p.Tokenizer.Count(strings.Join(words[:kept+1], " ")), limit, "limit %d: %q", limit, res.Content)
		if limit >= 10 {
			require.NotEmpty(t, res.Content)
		}
		// Streamed, the same answer, and no piece of it empty.
		streamed, err := p.Stream(context.Background(), &req, func(d upstream.Delta) error {
			require.NotEmpty(t, d.Content, "limit %d", limit)
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, res, streamed)
	}
}

func TestWebSearchGivesEvidence(t *testing.T) {
	t.Parallel()
	res, err := provider(t, 0).Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "news", MaxOutputTokens: 100, Hints: gateway.Hints{WebSearch: true}})
	require.NoError(t, err)
	require.Len(t, res.Sources, 2)
	require.NotEmpty(t, res.Sources[0].URL)
	require.NotEqual(t, res.Sources[0].URL, res.Sources[1].URL)
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
	dispatched := 0
	req := upstream.Request{Model: gateway.ModelInstant, Prompt: "stream me", MaxOutputTokens: 32000, Hints: gateway.Hints{WebSearch: true}, OnDispatch: func() { dispatched++ }}
	whole, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	require.Equal(t, 1, dispatched)
	var text string
	var deltas []upstream.Delta
	res, err := p.Stream(context.Background(), &req, func(d upstream.Delta) error {
		deltas = append(deltas, d)
		text += d.Content
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 2, dispatched, "a stream is dispatched too")
	require.Equal(t, whole, res)
	require.Equal(t, whole.Content, text)
	require.Greater(t, len(deltas), 5)
	require.Equal(t, whole.Sources, deltas[0].Sources)
	for _, d := range deltas[1:] {
		require.Empty(t, d.Sources)
	}
}

// TestStreamCutShortReturnsPartial: a stream cancelled, or whose reader
// fails, ends there with what it sent: its text, evidence and verdict, and
// usage counted as the simulator counts.
func TestStreamCutShortReturnsPartial(t *testing.T) {
	t.Parallel()
	p := provider(t, time.Millisecond)
	req := upstream.Request{Model: gateway.ModelInstant, Prompt: "cut me short", System: "be kind", MaxOutputTokens: 32000, Hints: gateway.Hints{WebSearch: true}}
	whole, err := p.Complete(context.Background(), &req)
	require.NoError(t, err)
	partial := func(t *testing.T, res upstream.Result, sent string) {
		t.Helper()
		require.Equal(t, sent, res.Content)
		require.True(t, strings.HasPrefix(whole.Content, res.Content))
		require.True(t, res.UsageReported)
		require.Equal(t, whole.InputTokens, res.InputTokens)
		require.Equal(t, p.Tokenizer.Count(res.Content), res.OutputTokens)
		require.Equal(t, whole.Sources, res.Sources)
		require.Equal(t, "supported", res.Verdict)
	}
	t.Run("cancelled", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(context.Background())
		n, sent := 0, ""
		res, err := p.Stream(ctx, &req, func(d upstream.Delta) error {
			sent += d.Content
			if n++; n == 3 {
				cancel()
			}
			return nil
		})
		require.ErrorIs(t, err, context.Canceled)
		partial(t, res, sent)
	})
	t.Run("its reader fails", func(t *testing.T) {
		t.Parallel()
		errGone := errors.New("client gone")
		n, sent := 0, ""
		res, err := p.Stream(context.Background(), &req, func(d upstream.Delta) error {
			if n++; n == 3 {
				return errGone
			}
			sent += d.Content
			return nil
		})
		require.ErrorIs(t, err, errGone)
		require.Equal(t, 3, n, "nothing is sent after the reader failed")
		partial(t, res, sent)
	})
}
