package server_test

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"testing"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/server"
)

// BenchmarkCreateResponse is one non-streaming request through the whole server
// (auth, validation, pricing, commit) on a real PostgreSQL, with an instant upstream.
func BenchmarkCreateResponse(b *testing.B) {
	bundle := setupWith(b, options{
		rates:  ratelimit.Config{Limits: gateway.RateLimits{Free: 1 << 30, Developer: 1 << 30}},
		server: func(c *server.Config) { c.Logger = slog.New(slog.DiscardHandler) },
	})
	bundle.setLimits(b, ptr(int64(1<<50)), nil)
	body := []byte(`{"prompt": "benchmark prompt with a few words", "web_search": true}`)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			req, _ := http.NewRequest(http.MethodPost, bundle.http.URL+"/api/v1/responses", bytes.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+bundle.key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Fatalf("status %d", resp.StatusCode)
			}
		}
	})
}
