package server_test

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/server"
)

// TestLongRepliesAreCompressed: a reply of server.CompressMinBytes or more
// is gzipped when its request accepts gzip, by name, by its alias x-gzip or
// by *, with a weight above 0, and inflates to the reply sent uncompressed;
// one that does not accept it (identity alone, another coding, gzip weighed
// 0, a weight that is no number) is sent as it is. Shorter replies, errors and event
// streams are never compressed, whether they end before they are detached
// from their handlers or after, nor is a document's 304; every reply says it
// varies by Accept-Encoding. Over HTTP/1.1 and HTTP/2. Unless turned on
// (Config.Compress), nothing is.
func TestLongRepliesAreCompressed(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		b := setupWith(t, options{h2c: h2c, server: func(c *server.Config) { c.Compress = true }})
		get := func(path, accept string) reply {
			var h http.Header
			if accept != "" {
				h = http.Header{"Accept-Encoding": {accept}}
			}
			return b.doWith(http.MethodGet, path, b.key, "", nil, h)
		}
		plain := get("/openapi.json", "identity")
		require.Equal(t, http.StatusOK, plain.status)
		require.Greater(t, len(plain.body), server.CompressMinBytes, "the document is long")
		for accept, compressed := range map[string]bool{
			"gzip":                       true,
			"gzip, deflate, br, zstd":    true,
			"br;q=1.0, GZIP;q=0.5":       true,
			"x-gzip":                     true,
			"*":                          true,
			"identity;q=0.5, *;q=0.1":    true,
			"gzip;q=0":                   false,
			"gzip;q=0.000, *":            false,
			"*;q=0":                      false,
			"br":                         false,
			"identity":                   false,
			"gzip;q=high":                false,
			"gzip;q=-1, *":               false,
			"gzip;q=NaN":                 false,
			" gzip ; q = 0.8 ":           true,
			"deflate, gzip;q=1, *;q=0.1": true,
		} {
			r := get("/openapi.json", accept)
			require.Equal(t, http.StatusOK, r.status, accept)
			require.Contains(t, r.header.Values("Vary"), "Accept-Encoding", accept)
			require.Equal(t, map[bool]string{true: "gzip"}[compressed], r.header.Get("Content-Encoding"), accept)
			require.Equal(t, plain.body, r.body, "inflates to the reply itself: %s", accept)
		}
		// Short replies and errors go as they are.
		for _, path := range []string{"/api/v1/usage", "/api/v1/batches", "/api/v1/batch/nope", "/nowhere"} {
			r := get(path, "gzip")
			require.Empty(t, r.header.Get("Content-Encoding"), path)
			require.Contains(t, r.header.Values("Vary"), "Accept-Encoding", path)
		}
		// A HEAD says what its GET would.
		head := b.doWith(http.MethodHead, "/openapi.json", "", "", nil, http.Header{"Accept-Encoding": {"gzip"}})
		require.Equal(t, http.StatusOK, head.status)
		require.Equal(t, "gzip", head.header.Get("Content-Encoding"))
		// The document's tag is its content's, compressed or not; a
		// revalidation's 304 has no body to compress, and varies as its 200.
		tag := plain.header.Get("ETag")
		require.NotEmpty(t, tag)
		require.Equal(t, tag, get("/openapi.json", "gzip").header.Get("ETag"))
		notModified := b.doWith(http.MethodGet, "/openapi.json", "", "", nil, http.Header{"Accept-Encoding": {"gzip"}, "If-None-Match": {tag}})
		require.Equal(t, http.StatusNotModified, notModified.status)
		require.Empty(t, notModified.header.Get("Content-Encoding"))
		require.Empty(t, notModified.body)
		require.Contains(t, notModified.header.Values("Vary"), "Accept-Encoding")

		// A long output is compressed, a short one is not; a stream never is,
		// however long.
		long := strings.Repeat("a long prompt ", server.CompressMinBytes/10)
		for prompt, compressed := range map[string]bool{long: true, "short": false} {
			r := b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": prompt}, http.Header{"Accept-Encoding": {"gzip"}})
			require.Equal(t, http.StatusOK, r.status)
			require.Equal(t, map[bool]string{true: "gzip"}[compressed], r.header.Get("Content-Encoding"))
			require.Equal(t, "answer to "+prompt, r.json(t)["content"])
		}
		// The second stream outlasts DetachAfter: it goes on off its
		// handler, the compressing writer gone.
		for _, delay := range []time.Duration{0, 2 * server.DefaultDetachAfter} {
			b.upstream.configure(func(s *scripted) { s.firstDelay = delay })
			r := b.postWith("/api/v1/responses", b.key, map[string]any{"prompt": long, "stream": true}, http.Header{"Accept-Encoding": {"gzip"}})
			require.Equal(t, http.StatusOK, r.status)
			require.Equal(t, "text/event-stream", r.header.Get("Content-Type"))
			require.Empty(t, r.header.Get("Content-Encoding"), "events go as they are written")
			s := apitest.ParseEvents(t, bytes.NewReader(r.body))
			apitest.ValidateEvents(t, s)
			var content strings.Builder
			for _, c := range chunks(t, s) {
				content.WriteString(c.Content)
			}
			require.Equal(t, "answer to "+long, content.String())
		}
	}

	// Not turned on, nothing is compressed.
	b := setup(t, nil)
	r := b.doWith(http.MethodGet, "/openapi.json", "", "", nil, http.Header{"Accept-Encoding": {"gzip"}})
	require.Equal(t, http.StatusOK, r.status)
	require.Empty(t, r.header.Get("Content-Encoding"))
	require.Empty(t, r.header.Values("Vary"))
}
