package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
)

// largePrompt makes a body over 64 KiB, which takes its account's turn.
var largePrompt = strings.Repeat("word ", 14_000)

// largeBatch is the body of a batch creation over 64 KiB.
func largeBatch() map[string]any {
	return map[string]any{"requests": []map[string]any{{"prompt": largePrompt}, {"prompt": "item"}}}
}

// async runs f off the test's goroutine and returns its result.
func async(f func() int) <-chan int {
	out := make(chan int, 1)
	go func() { out <- f() }()
	return out
}

// holdTurn starts a batch creation of key whose body, over 64 KiB, stops
// halfway, and waits until it holds the account's one place: until the
// account's next such creation is refused for its turn (the server's
// TurnWait must be short). Until then, the next ones may take the place
// before it, and are stored. finish sends the rest of the body and returns
// the creation's status.
func (b *testBundle) holdTurn(t *testing.T, key string, body any) (finish func() int) {
	const path = "/api/v1/batch"
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	slow, rest := io.Pipe()
	t.Cleanup(func() { _ = rest.CloseWithError(io.ErrUnexpectedEOF) }) // runs before the server's
	status := async(func() int { return b.postBody(context.Background(), path, key, slow) })
	_, err = rest.Write(raw[:len(raw)/2])
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r := b.post(path, key, body)
		return r.status == http.StatusTooManyRequests && strings.Contains(r.message(t), "for its turn")
	}, 20*time.Second, time.Millisecond)
	return func() int {
		_, err := rest.Write(raw[len(raw)/2:])
		require.NoError(t, err)
		require.NoError(t, rest.Close())
		return <-status
	}
}

// oneTurn is a server with one place an account and a short wait for it.
func oneTurn(c *server.Config) {
	c.TurnPlaces = 1
	c.TurnWait = 300 * time.Millisecond
}

// TestAnAccountsBatchCreationsAreReadAndPricedInTurn: with one place an
// account, a large creation whose body is still coming holds its account's
// place. The account's next large creation waits for it and, past the wait,
// is refused RATE_LIMITED with nothing stored; a small one, or another
// account's, does not wait.
func TestAnAccountsBatchCreationsAreReadAndPricedInTurn(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(protoName(h2c), func(t *testing.T) {
			t.Parallel()
			testReadAndPricedInTurn(t, setupWith(t, options{server: oneTurn, h2c: h2c}))
		})
	}
}

func testReadAndPricedInTurn(t *testing.T, b *testBundle) {
	other := b.newKey("globex", gateway.TierDeveloper, gateway.ScopeInference)
	finish := b.holdTurn(t, b.key, largeBatch())

	refused := b.postWith("/api/v1/batch", b.key, largeBatch(), http.Header{"Idempotency-Key": {"turned-away"}})
	require.Equal(t, http.StatusTooManyRequests, refused.status)
	require.Equal(t, gateway.ERateLimited, refused.errorCode(t))
	require.Equal(t, "5", refused.header.Get("Retry-After"))
	require.Contains(t, refused.message(t), "over 64 KiB are priced 1 at a time")

	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)}).status,
		"a small creation takes no turn")
	tooLarge := b.post("/api/v1/batch", b.key, map[string]any{"requests": []map[string]any{{"prompt": strings.Repeat("x", 17<<20)}}})
	require.Equal(t, http.StatusRequestEntityTooLarge, tooLarge.status, "a body too large for the route is refused as such, without a turn")
	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", other, largeBatch()).status,
		"another account's creation must not wait for this account's place")

	require.Equal(t, http.StatusAccepted, finish())
	require.Equal(t, http.StatusAccepted,
		b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(3)}, http.Header{"Idempotency-Key": {"turned-away"}}).status,
		"the place is free again, and the refused creation's key was never stored")
}

// TestLargeResponsesArePricedInTurn: a response request whose text (its
// prompt and instructions together) is over 64 KiB is priced in its account's turn, which large batch creations take
// too. While a creation holds the place, a large response is refused
// RATE_LIMITED in the form it asked for: a 429, or in its stream; a small one
// does not wait, nor does one of 64 KiB exactly. Neither refusal is billed.
func TestLargeResponsesArePricedInTurn(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: oneTurn})
	finish := b.holdTurn(t, b.key, largeBatch())
	served := b.usage(t, b.key).Totals.Requests

	r := b.post("/api/v1/responses", b.key, map[string]any{"prompt": largePrompt})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, gateway.ERateLimited, r.errorCode(t))
	require.Equal(t, "5", r.header.Get("Retry-After"))

	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": "small", "custom_instructions": largePrompt})
	require.Equal(t, http.StatusTooManyRequests, r.status, "the instructions count with the prompt")

	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": largePrompt})
	require.Len(t, s.Events, 1, "a stream refused before it starts ends with its error")
	require.Equal(t, "response.error", s.Events[0].Name)
	require.Contains(t, string(s.Events[0].Data), `"RATE_LIMITED"`)
	require.Equal(t, served, b.usage(t, b.key).Totals.Requests, "refusals are not billed")

	require.Equal(t, http.StatusOK, b.post("/api/v1/chat", b.key, map[string]any{"prompt": "small"}).status,
		"a small request takes no turn")
	r = b.post("/api/v1/responses", b.key, map[string]any{"prompt": strings.Repeat("x", 64<<10-5), "custom_instructions": "12345"})
	require.Equal(t, http.StatusOK, r.status, "a text of 64 KiB exactly takes no turn")
	require.Equal(t, http.StatusAccepted, finish())
}

// TestARequestPastItsRateTakesNoTurn: a large streamed request past its key's
// rate is refused for its rate at once, in its stream, without waiting for
// its account's place.
func TestARequestPastItsRateTakesNoTurn(t *testing.T) {
	t.Parallel()
	// A fixed clock keeps every request in one rate window.
	at := time.Now().Truncate(time.Minute).Add(30 * time.Second)
	b := setupWith(t, options{server: oneTurn, rates: ratelimit.Config{
		Limits: gateway.RateLimits{Free: 20, Developer: 20}, Clock: func() time.Time { return at },
	}})
	finish := b.holdTurn(t, b.key, largeBatch())
	spent := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeInference)
	require.Eventually(t, func() bool {
		return b.post("/api/v1/responses", spent, map[string]any{"prompt": "small"}).status == http.StatusTooManyRequests
	}, 10*time.Second, time.Millisecond)

	_, s := b.streamAs(spent, "/api/v1/responses", map[string]any{"prompt": largePrompt})
	require.Len(t, s.Events, 1)
	require.Equal(t, "response.error", s.Events[0].Name)
	require.Contains(t, string(s.Events[0].Data), "requests per minute", "refused for its rate, not after a wait for its turn")
	require.Equal(t, http.StatusAccepted, finish())
}

// TestAResponsesTurnEndsOnceItIsPriced: a large request gives its account's
// place back once priced, so the account's next large request does not wait
// for its upstream call to end.
func TestAResponsesTurnEndsOnceItIsPriced(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: oneTurn})
	b.upstream.configure(func(s *scripted) { s.hang = true })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel) // runs before the server's, which waits for its requests
	body := func(stream bool) io.Reader {
		raw, err := json.Marshal(map[string]any{"prompt": largePrompt, "stream": stream})
		require.NoError(t, err)
		return bytes.NewReader(raw)
	}
	answered := async(func() int { return b.postBody(ctx, "/api/v1/responses", b.key, body(false)) })
	require.Eventually(t, func() bool { return b.upstream.callCount() == 1 }, 10*time.Second, time.Millisecond)
	streamed := async(func() int { return b.postBody(ctx, "/api/v1/responses", b.key, body(true)) })
	require.Eventually(t, func() bool { return b.upstream.callCount() == 2 }, 10*time.Second, time.Millisecond,
		"the stream is priced and sent while the first request's call runs")
	b.server.Abort()
	require.Equal(t, http.StatusServiceUnavailable, <-answered, "cut by the shutdown")
	require.Equal(t, http.StatusOK, <-streamed)
}

// TestARequestWaitingForItsTurnEndsWithTheGrace: once the shutdown's grace
// has ended (Abort), a large request that finds its account's places taken
// is answered SERVICE_UNAVAILABLE at once, nothing done, where it would have
// waited; the request holding the place goes on, and a free place is still
// taken.
func TestARequestWaitingForItsTurnEndsWithTheGrace(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: oneTurn})
	finish := b.holdTurn(t, b.key, largeBatch())
	b.server.Abort()

	for _, path := range []string{"/api/v1/batch", "/api/v1/responses"} {
		body := largeBatch()
		if path == "/api/v1/responses" {
			body = map[string]any{"prompt": largePrompt}
		}
		r := b.post(path, b.key, body)
		require.Equal(t, http.StatusServiceUnavailable, r.status, path)
		require.Equal(t, gateway.EServiceUnavailable, r.errorCode(t), path)
		require.Contains(t, r.message(t), "nothing was done", path)
		require.NotEmpty(t, r.header.Get("Retry-After"), path)
	}
	_, s := b.stream("/api/v1/responses", map[string]any{"prompt": largePrompt})
	require.Len(t, s.Events, 1)
	require.Contains(t, string(s.Events[0].Data), `"SERVICE_UNAVAILABLE"`)

	require.Equal(t, http.StatusAccepted, finish())
	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", b.key, largeBatch()).status)
}

// heldStore is the real store whose batch creations wait for release, each
// saying on entered that it came.
type heldStore struct {
	batch.Store
	entered chan struct{}
	release chan struct{}
}

func (s *heldStore) CreateBatch(ctx context.Context, nb store.NewBatch) (store.CreateResult, error) {
	s.entered <- struct{}{}
	<-s.release
	return s.Store.CreateBatch(ctx, nb)
}

// TestAnAccountsTurnEndsOnceItsBatchIsPriced: storing a batch is not held to
// the account's turn, so a large creation waiting for the database does not
// keep the account's next one from being read and priced.
func TestAnAccountsTurnEndsOnceItsBatchIsPriced(t *testing.T) {
	t.Parallel()
	held := &heldStore{entered: make(chan struct{}), release: make(chan struct{})}
	release := sync.OnceFunc(func() { close(held.release) })
	b := setupWith(t, options{server: func(c *server.Config) {
		c.TurnPlaces = 1
		c.TurnWait = 5 * time.Second
		svc := c.Batches.(*batch.Service)
		held.Store, svc.Store = svc.Store, held
	}})
	t.Cleanup(release) // runs before the server's, which waits for its requests
	raw, err := json.Marshal(largeBatch())
	require.NoError(t, err)
	var replies []<-chan int
	for range 2 {
		replies = append(replies, async(func() int {
			return b.postBody(context.Background(), "/api/v1/batch", b.key, bytes.NewReader(raw))
		}))
		select {
		case <-held.entered:
		case status := <-replies[len(replies)-1]:
			require.FailNow(t, "a creation ended before it was stored", "status %d", status)
		}
	}
	release()
	for _, r := range replies {
		require.Equal(t, http.StatusAccepted, <-r)
	}
}
