package tryout_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/sim"
	"github.com/rungworks/gateway/upstream/tryout"
)

// refusing is an upstream that refuses every call before it is sent.
type refusing struct{}

func (refusing) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	return upstream.Result{}, fmt.Errorf("%w: connection refused", upstream.ErrUnavailable)
}

func (r refusing) Stream(ctx context.Context, req *upstream.Request, _ func(upstream.Delta) error) (upstream.Result, error) {
	return r.Complete(ctx, req)
}

// thinking is an upstream whose model thinks before it answers, and reports
// no usage.
type thinking struct{}

func (thinking) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	return upstream.Result{Content: "Blue.", Reasoning: "Light scatters."}, nil
}

func (t thinking) Stream(ctx context.Context, req *upstream.Request, _ func(upstream.Delta) error) (upstream.Result, error) {
	return t.Complete(ctx, req)
}

// TestThinkingIsReported: a target whose model thinks is said to, the
// thinking counted as its output.
func TestThinkingIsReported(t *testing.T) {
	t.Parallel()
	targets := tryout.Targets(map[gateway.Model]routing.Route{
		gateway.ModelReasoning: {Targets: []routing.Target{{Provider: "r", UpstreamModel: "think", Client: thinking{}}}},
	})
	reports := tryout.Run(context.Background(), targets, time.Minute)
	require.Len(t, reports, 1)
	require.Regexp(t, `^  whole:    ok in [0-9.]+ ms: "Blue\.", thinking of 15 bytes \(output, not sent\), no usage reported \(billed from the gateway's tokenizer\)$`,
		strings.Split(reports[0].String(), "\n")[1])
}

// TestTargetsAreTriedOnceEach: a target that serves several models is
// listed, and called, once, in the order of the models and their targets;
// each report says how its two calls went.
func TestTargetsAreTriedOnceEach(t *testing.T) {
	t.Parallel()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	answering := &sim.Provider{Tokenizer: tok}
	routes := map[gateway.Model]routing.Route{
		gateway.ModelInstant:   {Targets: []routing.Target{{Provider: "a", UpstreamModel: "x", Client: answering}}},
		gateway.ModelReasoning: {Targets: []routing.Target{{Provider: "b", UpstreamModel: "y", Client: refusing{}}, {Provider: "a", UpstreamModel: "x", Client: answering}}},
	}
	targets := tryout.Targets(routes)
	require.Len(t, targets, 2)
	require.Equal(t, []string{"a/x", "b/y"}, []string{targets[0].Provider + "/" + targets[0].UpstreamModel, targets[1].Provider + "/" + targets[1].UpstreamModel})
	require.Equal(t, []gateway.Model{gateway.ModelInstant, gateway.ModelReasoning}, targets[0].Models)
	require.Equal(t, []gateway.Model{gateway.ModelReasoning}, targets[1].Models)

	reports := tryout.Run(context.Background(), targets, time.Minute)
	require.Len(t, reports, 2)
	ok, failed := reports[0], reports[1]
	require.False(t, ok.Failed())
	for _, c := range []tryout.Call{ok.Whole, ok.Streamed} {
		require.NoError(t, c.Err)
		require.NotEmpty(t, c.Result.Content)
		require.True(t, c.Result.UsageReported)
	}
	require.Positive(t, ok.Streamed.FirstOutput)
	require.Contains(t, ok.String(), "a/x (instant, reasoning)\n  whole:    ok in ")
	require.Contains(t, ok.String(), fmt.Sprintf("usage %d in, %d out\n", ok.Whole.Result.InputTokens, ok.Whole.Result.OutputTokens))

	require.True(t, failed.Failed())
	require.ErrorIs(t, failed.Whole.Err, upstream.ErrUnavailable)
	lines := strings.Split(failed.String(), "\n")
	require.Equal(t, "b/y (reasoning)", lines[0])
	require.Regexp(t, `^  whole:    failed after [0-9.]+ ms: upstream unavailable: connection refused$`, lines[1])
	require.Regexp(t, `^  streamed: failed after [0-9.]+ ms: upstream unavailable: connection refused$`, lines[2])
}
