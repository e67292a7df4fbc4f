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
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
)

// sendBatch posts a batch creation whose body is read from body, off the
// test's goroutine, and returns its status (0 when it could not be sent).
func (b *testBundle) sendBatch(key string, body io.Reader) <-chan int {
	status := make(chan int, 1)
	go func() {
		defer close(status)
		req, err := http.NewRequest(http.MethodPost, b.http.URL+"/api/v1/batch", body)
		if err != nil {
			return
		}
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := b.client.Do(req)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		status <- resp.StatusCode
	}()
	return status
}

// holdTurn starts a batch creation of key whose body stops halfway, and
// waits until it holds the account's one place: until the account's next
// creation is refused for its turn (the server's TurnWait must be short).
// Until then, the next ones may take the place before it, and are stored.
// finish sends the rest of the body and returns the creation's status.
func (b *testBundle) holdTurn(t *testing.T, key string, body any) (finish func() int) {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	slow, rest := io.Pipe()
	t.Cleanup(func() { _ = rest.CloseWithError(io.ErrUnexpectedEOF) }) // runs before the server's
	status := b.sendBatch(key, slow)
	_, err = rest.Write(raw[:len(raw)/2])
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r := b.post("/api/v1/batch", key, body)
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
// account, a creation whose body is still coming holds its account's place.
// The account's next creation waits for it and, past the wait, is refused
// RATE_LIMITED with nothing stored; another account's creation does not wait.
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
	body := map[string]any{"requests": items(2)}
	finish := b.holdTurn(t, b.key, body)

	refused := b.postWith("/api/v1/batch", b.key, body, http.Header{"Idempotency-Key": {"turned-away"}})
	require.Equal(t, http.StatusTooManyRequests, refused.status)
	require.Equal(t, gateway.ERateLimited, refused.errorCode(t))
	require.Equal(t, "5", refused.header.Get("Retry-After"))
	require.Contains(t, refused.message(t), "1 at a time")

	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", other, body).status,
		"another account's creation must not wait for this account's place")

	require.Equal(t, http.StatusAccepted, finish())
	require.Equal(t, http.StatusAccepted,
		b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(3)}, http.Header{"Idempotency-Key": {"turned-away"}}).status,
		"the place is free again, and the refused creation's key was never stored")
}

// TestACreationWaitingForItsTurnEndsWithTheGrace: once the shutdown's grace
// has ended (Abort), a creation that finds its account's places taken is
// answered SERVICE_UNAVAILABLE at once, nothing stored, where it would have
// waited; the creation holding the place goes on, and a free place is still
// taken.
func TestACreationWaitingForItsTurnEndsWithTheGrace(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: oneTurn})
	body := map[string]any{"requests": items(2)}
	finish := b.holdTurn(t, b.key, body)
	b.server.Abort()

	r := b.post("/api/v1/batch", b.key, body)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, gateway.EServiceUnavailable, r.errorCode(t))
	require.Contains(t, r.message(t), "nothing was stored")
	require.NotEmpty(t, r.header.Get("Retry-After"))

	require.Equal(t, http.StatusAccepted, finish())
	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", b.key, body).status)
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
// the account's turn, so a creation waiting for the database does not keep
// the account's next creation from being read and priced.
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
	raw, err := json.Marshal(map[string]any{"requests": items(2)})
	require.NoError(t, err)
	var replies []<-chan int
	for range 2 {
		replies = append(replies, b.sendBatch(b.key, bytes.NewReader(raw)))
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
