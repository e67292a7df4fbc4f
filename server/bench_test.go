package server_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/wordtext"
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
			if status := bundle.postBody(context.Background(), "/api/v1/responses", bundle.key, bytes.NewReader(body)); status != http.StatusOK {
				b.Fatalf("status %d (0: no reply)", status)
			}
		}
	})
}

// BenchmarkBatchResults reads the results of a batch of 100 completed items
// of 64 KiB of text each (6.4 MiB of words in an order that never repeats,
// which gzip shrinks about as it shrinks natural text) through the whole server, as they are
// ("identity") and compressed by the server as the client accepts ("gzip":
// Go's client asks for it and inflates the reply). B/op counts what the server and the
// reading client allocate; peak-live-MiB is the most the process's heap
// held live, as the collections during the run found it, beyond what it
// held before: a reply built whole holds the batch's texts several times
// over; one written a page at a time, about a page.
func BenchmarkBatchResults(b *testing.B) {
	bundle := setupWith(b, options{
		rates:  ratelimit.Config{Limits: gateway.RateLimits{Free: 1 << 30, Developer: 1 << 30}},
		server: func(c *server.Config) { c.Logger = slog.New(slog.DiscardHandler); c.Compress = true },
	})
	id := bundle.completedBatch(b, 100, wordtext.Random(64<<10))
	for _, coding := range []string{"identity", "gzip"} {
		b.Run(coding, func(b *testing.B) {
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
				if coding == "identity" {
					req.Header.Set("Accept-Encoding", coding)
				}
				resp, err := bundle.client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				n, _ := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || n < 100*64<<10 || resp.Uncompressed != (coding == "gzip") {
					b.Fatalf("status %d, %d bytes, inflated %t", resp.StatusCode, n, resp.Uncompressed)
				}
			}
			close(done)
			<-sampled
			b.ReportMetric(float64(max(peak.Load(), before)-before)/(1<<20), "peak-live-MiB")
		})
	}
}

// heapLive is the heap's live bytes as the last collection marked them.
func heapLive() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// BenchmarkACreationBesideAFlood is one small batch creation of an account
// while another account floods the replica with creations of 100 distinct
// prompts of 99 KB (10 MB each, refused by its daily ceiling once priced),
// eight at a time: ns/op is how long the small creation takes. "turns" is
// the replica as it runs, with each account's creations read and priced in
// turns (DefaultTurnPlaces); "unbounded" gives every creation a place at
// once; "alone" has no flood. flood-creations/s is how many of the flood's
// creations were answered.
func BenchmarkACreationBesideAFlood(b *testing.B) {
	for _, tc := range []struct {
		name     string
		places   int
		flooders int
	}{{"alone", 0, 0}, {"turns", 0, 8}, {"unbounded", 1 << 20, 8}} {
		b.Run(tc.name, func(b *testing.B) {
			bundle := setupWith(b, options{
				rates: ratelimit.Config{Limits: gateway.RateLimits{Free: 1 << 30, Developer: 1 << 30}},
				server: func(c *server.Config) {
					c.Logger = slog.New(slog.DiscardHandler)
					c.TurnPlaces = tc.places
				},
			})
			bundle.setLimits(b, ptr(int64(1000)), nil)
			victim := bundle.newKey("globex", gateway.TierDeveloper, gateway.ScopeInference)
			flood := floodBodies(b, 4)
			ctx, stop := context.WithCancel(context.Background())
			var answered atomic.Int64
			var wg sync.WaitGroup
			for i := range tc.flooders {
				wg.Go(func() {
					for j := i; ctx.Err() == nil; j++ {
						if status := bundle.postBody(ctx, "/api/v1/batch", bundle.key, bytes.NewReader(flood[j%len(flood)])); status == http.StatusTooManyRequests {
							answered.Add(1)
						} else if ctx.Err() == nil {
							b.Errorf("a flood creation was answered %d", status)
						}
					}
				})
			}
			b.Cleanup(func() { stop(); wg.Wait() })
			for tc.flooders > 0 && answered.Load() == 0 {
				time.Sleep(10 * time.Millisecond)
			}
			small := []byte(`{"requests": [{"prompt": "a small batch", "max_output_rungs": 5}]}`)
			start, before := time.Now(), answered.Load()
			for b.Loop() {
				if status := bundle.postBody(context.Background(), "/api/v1/batch", victim, bytes.NewReader(small)); status != http.StatusAccepted {
					b.Fatalf("the small creation was answered %d", status)
				}
			}
			if tc.flooders > 0 {
				b.ReportMetric(float64(answered.Load()-before)/time.Since(start).Seconds(), "flood-creations/s")
			}
		})
	}
}

// floodBodies returns n batch bodies of 100 prompts of 99 KB each, of words
// of random letters: no two prompts alike, so that pricing each costs the
// tokenizer its full work.
func floodBodies(b *testing.B, n int) [][]byte {
	rng := rand.New(rand.NewPCG(1, 2))
	bodies := make([][]byte, n)
	for i := range bodies {
		var body bytes.Buffer
		body.WriteString(`{"requests": [`)
		for item := range 100 {
			if item > 0 {
				body.WriteByte(',')
			}
			body.WriteString(`{"prompt": "`)
			for end := body.Len() + 99_000; body.Len() < end; {
				for range 2 + rng.IntN(9) {
					body.WriteByte(byte('a' + rng.IntN(26)))
				}
				body.WriteByte(' ')
			}
			body.WriteString(`x"}`)
		}
		body.WriteString(`]}`)
		bodies[i] = body.Bytes()
	}
	return bodies
}
