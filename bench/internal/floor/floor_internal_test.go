package floor

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// testBundle is a bare proxy in front of a fake upstream, on a database of
// its own.
type testBundle struct {
	ctx      context.Context
	upstream *fakeupstream.Server
	proxy    *proxy
	url      string
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	ctx := context.Background()
	upstream := fakeupstream.New()
	t.Cleanup(upstream.Close)
	p, err := newProxy(ctx, testdb.EmptyURL(t), upstream.BaseURL())
	require.NoError(t, err)
	t.Cleanup(p.pool.Close)
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	return &testBundle{ctx: ctx, upstream: upstream, proxy: p, url: srv.URL}
}

// post sends body and returns the status and the whole reply.
func (b *testBundle) post(t *testing.T, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(b.url+"/", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	reply, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(reply)
}

// rows counts the rows committed and their tokens.
func (b *testBundle) rows(t *testing.T) (n, tokens int64) {
	t.Helper()
	require.NoError(t, b.proxy.pool.QueryRow(b.ctx, `SELECT count(*), coalesce(sum(total_tokens), 0) FROM bench_floor`).Scan(&n, &tokens))
	return n, tokens
}

// TestTheBareProxyCommitsWhatItAnswers: the floor does the work it stands
// for, a committed row a request with the upstream's token counts, whole
// and streamed, and nothing for a call that failed.
func TestTheBareProxyCommitsWhatItAnswers(t *testing.T) {
	t.Parallel()
	b := setup(t)

	status, reply := b.post(t, `{"prompt":"hello","max_output_rungs":20}`)
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, reply, `"content":"echo: hello"`)
	n, tokens := b.rows(t)
	require.Equal(t, int64(1), n)
	require.Positive(t, tokens, "the upstream's usage is what the row keeps")

	status, reply = b.post(t, `{"prompt":"hello","max_output_rungs":20,"stream":true}`)
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, reply, `"content":"echo`, "the upstream's events are passed on")
	require.Contains(t, reply, "data: [DONE]")
	require.NotContains(t, reply, "event: error")
	n, streamed := b.rows(t)
	require.Equal(t, int64(2), n)
	require.Greater(t, streamed, tokens, "the stream's usage, from its last event, is kept too")

	b.upstream.SetStatus(http.StatusServiceUnavailable)
	status, _ = b.post(t, `{"prompt":"hello","max_output_rungs":20}`)
	require.Equal(t, http.StatusBadGateway, status)
	status, reply = b.post(t, `{"prompt":"hello","max_output_rungs":20,"stream":true}`)
	require.Equal(t, http.StatusOK, status, "a stream's head goes first")
	require.Contains(t, reply, "event: error")
	n, _ = b.rows(t)
	require.Equal(t, int64(2), n, "a failed call commits nothing")
}
