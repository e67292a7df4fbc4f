package drainer_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
)

// recordingProvider records the requests it is given; a prompt that begins
// "unsent" it never sends, waiting instead for its context to end, as a
// connection that never opens.
type recordingProvider struct {
	upstream.Provider
	mu       sync.Mutex
	requests []upstream.Request
	unsent   atomic.Bool // a prompt beginning "unsent" waits
}

func (p *recordingProvider) Complete(ctx context.Context, req *upstream.Request) (upstream.Result, error) {
	p.mu.Lock()
	p.requests = append(p.requests, *req)
	p.mu.Unlock()
	if strings.HasPrefix(req.Prompt, "unsent") {
		p.unsent.Store(true)
		<-ctx.Done()
		return upstream.Result{}, ctx.Err()
	}
	return p.Provider.Complete(ctx, req)
}

// sent returns the requests recorded.
func (p *recordingProvider) sent() []upstream.Request {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]upstream.Request(nil), p.requests...)
}

// TestACompletedItemIsStoredAsAnswered: an item's call asks that the prompt
// reach the upstream at most once and names its account; the item is
// stored with the tokens the upstream reported (in its request's record),
// their rungs at the batch rate, the target that answered, and its evidence, held for the retention.
func TestACompletedItemIsStoredAsAnswered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("answered", fakeupstream.Hostile{PromptTokens: 5, CompletionTokens: 3})
	router, err := routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {Targets: []routing.Target{
		{Provider: "fake", UpstreamModel: "fake-model", Client: b.provider},
	}}}})
	require.NoError(t, err)
	rec := &recordingProvider{Provider: router}
	b.provider = rec
	id := b.newBatch(t, "answered", 1)
	b.run(t, b.store, drainer.Config{Lease: time.Minute})
	b.completed(t, id)

	it := b.items(t, id)[0]
	want, err := b.estimator.RateCard.Usage(gateway.ModelInstant, gateway.EntryBatch, 5, 3)
	require.NoError(t, err)
	require.Equal(t, gateway.Usage{InputRungs: want.InputRungs, OutputRungs: want.OutputRungs, TotalRungs: want.TotalRungs}, it.Usage)
	var tokens [2]int64
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT input_tokens, output_tokens FROM requests WHERE id = $1`, *it.RequestID).Scan(&tokens[0], &tokens[1]))
	require.Equal(t, [2]int64{5, 3}, tokens, "the request's record holds the tokens")
	require.Equal(t, &gateway.UpstreamRoute{Provider: "fake", UpstreamModel: "fake-model", Attempts: 1}, it.Route)
	_, err = b.store.DeleteExpiredEvidence(b.ctx, 100)
	require.NoError(t, err)
	ev, err := b.store.Evidence(b.ctx, b.principal.AccountID, *it.RequestID)
	require.NoError(t, err, "the evidence is held for the retention")
	require.NotEmpty(t, ev.Sources)

	sent := rec.sent()
	require.Len(t, sent, 1)
	require.True(t, sent[0].AtMostOnce)
	require.Equal(t, b.principal.AccountID, sent[0].Tenant)
}

// TestARejectedItemFailsWithTheProvidersWord: an item the upstream rejects
// (a 4xx for this request) fails INFERENCE_BUSY with the upstream's message.
func TestARejectedItemFailsWithTheProvidersWord(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("rejected", fakeupstream.Hostile{Status: http.StatusBadRequest})
	id := b.newBatch(t, "rejected", 1)
	b.run(t, b.store, drainer.Config{Lease: time.Minute})
	item := b.failedItem(t, id)
	require.Equal(t, gateway.EInferenceBusy, item.Error.Code)
	require.Equal(t, "the inference provider rejected the request: status 400", item.Error.Message)
	require.Zero(t, item.Usage.TotalRungs)
}

// TestAnItemNotSentByTheGracesEndGoesBack: an item whose call had not been
// sent when the grace ended (its connection never opened) was never
// processed: it goes back to the queue, not failed INTERRUPTED (D12).
func TestAnItemNotSentByTheGracesEndGoesBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rec := &recordingProvider{Provider: b.provider}
	b.provider = rec
	id := b.newBatch(t, "unsent", 1)
	stop := b.start(t, b.store, drainer.Config{Lease: time.Minute, PollInterval: 50 * time.Millisecond, Grace: 200 * time.Millisecond}, io.Discard)
	require.Eventually(t, rec.unsent.Load, 10*time.Second, 10*time.Millisecond)
	stop()
	require.Equal(t, gateway.ItemQueued, b.items(t, id)[0].Status)
	require.Empty(t, b.fake.Calls())
}

// TestAHurriedStopCutsTheGraceShort: asked to stop again (Hurried), a
// stopping drainer ends its grace at once: the item at the upstream fails
// INTERRUPTED, billed nothing, long before the grace (a minute) would have
// ended it, and it is not sent again.
func TestAHurriedStopCutsTheGraceShort(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.provider = upstream.Guard(openai.New(openai.Config{BaseURL: b.fake.BaseURL(), Timeout: 10 * time.Minute}), nil)
	b.fake.SetSlow("held", 10*time.Minute)
	id := b.newBatch(t, "held", 1)
	hurried := make(chan struct{})
	stop := b.start(t, b.store, drainer.Config{Lease: time.Minute, PollInterval: 50 * time.Millisecond, Grace: time.Minute, Hurried: hurried}, io.Discard)
	require.Eventually(t, func() bool { return b.fake.InFlight() == 1 }, 10*time.Second, 10*time.Millisecond)
	stopped := make(chan struct{})
	go func() { defer close(stopped); stop() }()
	select {
	case <-stopped:
		t.Fatal("stopped before its grace ended or it was hurried")
	case <-time.After(200 * time.Millisecond):
	}
	close(hurried)
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("still running 30 s after it was hurried")
	}
	b.failedUnbilled(t, id, gateway.EInterrupted)
	require.Len(t, b.fake.Calls(), 1)
}
