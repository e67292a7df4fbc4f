package server_test

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync/atomic"
	"testing"
	"time"

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

// BenchmarkBatchResults reads the results of a batch of 100 completed items
// of 64 KiB of text each (6.4 MiB) through the whole server. B/op counts what
// the server and the reading client allocate; peak-live-MiB is the most the
// process's heap held live, as the collections during the run found it,
// beyond what it held before: a reply built whole holds the batch's texts
// several times over; one written a page at a time, about a page.
func BenchmarkBatchResults(b *testing.B) {
	bundle := setupWith(b, options{
		rates:  ratelimit.Config{Limits: gateway.RateLimits{Free: 1 << 30, Developer: 1 << 30}},
		server: func(c *server.Config) { c.Logger = slog.New(slog.DiscardHandler) },
	})
	id := bundle.completedBatch(b, 100, strings.Repeat("x", 64<<10))
	b.SetBytes(100 * 64 << 10)
	runtime.GC()
	before := heapLive()
	var peak atomic.Uint64
	done := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(100 * time.Microsecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if h := heapLive(); h > peak.Load() {
					peak.Store(h)
				}
			}
		}
	}()
	for b.Loop() {
		req, _ := http.NewRequest(http.MethodGet, bundle.http.URL+"/api/v1/batch/"+id+"/results", nil)
		req.Header.Set("Authorization", "Bearer "+bundle.key)
		resp, err := bundle.client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || n < 100*64<<10 {
			b.Fatalf("status %d, %d bytes", resp.StatusCode, n)
		}
	}
	close(done)
	<-sampled
	b.ReportMetric(float64(max(peak.Load(), before)-before)/(1<<20), "peak-live-MiB")
}

// heapLive is the heap's live bytes as the last collection marked them.
func heapLive() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
