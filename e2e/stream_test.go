package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/fakeupstream"
)

// stream posts a streamed request and returns its validated head and events.
func (g *gateway) stream(key string, body map[string]any) (reply, apitest.Stream) {
	g.t.Helper()
	body["stream"] = true
	r := g.call(http.MethodPost, "/api/v1/responses", key, body)
	require.Equal(g.t, http.StatusOK, r.status)
	s := apitest.ParseEvents(g.t, bytes.NewReader(r.body))
	apitest.ValidateEvents(g.t, s)
	return r, s
}

// reportedUsage is the usage, in rungs of instant (multiplier 1), of the
// counts the fake upstream reports for prompt.
func reportedUsage(prompt string) *api.RungUsage {
	pt, ct := fakeupstream.Usage(prompt)
	return &api.RungUsage{InputRungs: int64(pt), OutputRungs: int64(ct), TotalRungs: int64(pt + ct)}
}

func names(s apitest.Stream) []string {
	out := make([]string, len(s.Events))
	for i, e := range s.Events {
		out[i] = e.Name
	}
	return out
}

func TestStreamEndToEnd(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	prompt := "stream this answer please"

	r, s := g.stream(b.key, map[string]any{"prompt": prompt})
	require.NotEmpty(t, r.header.Get("x-service-input-rungs"))
	require.Empty(t, r.header.Get("x-service-total-rungs"))
	pieces := fakeupstream.StreamPieces(prompt)
	// One delta per piece, one for the evidence, then the completion.
	require.Len(t, s.Events, len(pieces)+2)
	var text strings.Builder
	for i, e := range s.Events[:len(s.Events)-1] {
		require.Equal(t, "response.output_text.delta", e.Name)
		var c api.StreamChunk
		e.Decode(t, &c)
		require.Equal(t, i, c.Index)
		text.WriteString(c.Content)
	}
	require.Equal(t, fakeupstream.Reply(prompt), text.String())
	var final api.StreamChunk
	s.Events[len(s.Events)-1].Decode(t, &final)
	require.True(t, final.Done)
	require.Equal(t, reportedUsage(prompt), final.Usage)

	// The evidence that arrived in the stream is served afterwards.
	ev := g.call(http.MethodGet, "/api/v1/sources/"+final.RequestId.String(), b.key, nil)
	require.Equal(t, http.StatusOK, ev.status)
	require.Len(t, ev.object(t)["sources"], 1)

	// A stream that cited nothing has empty evidence, served as well.
	b.fake.SetCitations(false)
	_, s = g.stream(b.key, map[string]any{"prompt": prompt})
	require.Len(t, s.Events, len(pieces)+1, "no evidence event")
	s.Events[len(s.Events)-1].Decode(t, &final)
	require.True(t, final.Done)
	ev = g.call(http.MethodGet, "/api/v1/sources/"+final.RequestId.String(), b.key, nil)
	require.Equal(t, http.StatusOK, ev.status, string(ev.body))
	require.Equal(t, []any{}, ev.object(t)["sources"])
}

// h2cClient speaks HTTP/2 without TLS (prior knowledge), as a load balancer
// does to its backends.
func h2cClient(t *testing.T) *http.Client {
	h2c := &http.Transport{Protocols: new(http.Protocols)}
	h2c.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(h2c.CloseIdleConnections)
	return &http.Client{Transport: h2c}
}

// TestH2C: with GATEWAY_H2C a load balancer may speak HTTP/2 without TLS to
// the gateway (many requests on one connection); JSON replies and streams
// arrive over it, and HTTP/1.1 is still served. Without it, HTTP/2 is refused.
func TestH2C(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h2c := h2cClient(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_H2C": "true"})
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "over one"})
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, 1, r.proto)

	g.client = h2c
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "over two"})
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, 2, r.proto)
	require.Equal(t, fakeupstream.Reply("over two"), r.object(t)["content"])
	r, s := g.stream(b.key, map[string]any{"prompt": "stream over two"})
	require.Equal(t, 2, r.proto)
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)

	plain := serve(t, b.db, b.fake.BaseURL(), nil)
	req, err := http.NewRequest(http.MethodGet, plain.base+"/healthz", nil)
	require.NoError(t, err)
	_, err = h2c.Do(req)
	require.Error(t, err, "HTTP/2 without TLS is off unless asked for")
}

// TestH2CStreamsFinishAcrossShutdown: HTTP/2 streams detached from their
// handlers' stacks when SIGTERM arrives finish within the grace, whole, and
// the replica then exits cleanly.
func TestH2CStreamsFinishAcrossShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetSlow("h2 streamed in flight", 2*time.Second)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_H2C": "true", "GATEWAY_SHUTDOWN_GRACE": "20s", "GATEWAY_DRAIN_DELAY": "200ms"})
	g.client = h2cClient(t)
	wait := streamsUntilEnd(t, g, b.key, "h2 streamed in flight", 2)
	// Past DetachAfter: the streams run off their handlers' stacks.
	require.Eventually(t, func() bool { return len(b.fake.Calls()) == 2 }, 10*time.Second, 10*time.Millisecond)
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, g.cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, <-g.done, "a clean exit: %s", g.stderr.String())
	g.done <- nil
	for _, body := range wait() {
		require.Contains(t, string(body), "event: response.completed", "streams in flight at SIGTERM finish")
		require.NotContains(t, string(body), "event: response.error")
	}
}

// TestH2CSlowBodyStallsNoOtherStream: over HTTP/2 from a load balancer, many
// clients share a connection. A body that trickles in is cut at the body
// timeout with 408 in the envelope, and the other requests multiplexed on the
// same connection are served meanwhile.
func TestH2CSlowBodyStallsNoOtherStream(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_H2C": "true", "GATEWAY_BODY_TIMEOUT": "500ms"})
	g.client = h2cClient(t)

	body, feed := io.Pipe()
	t.Cleanup(func() { _ = feed.Close() })
	req, err := http.NewRequest(http.MethodPost, g.base+"/api/v1/responses", body)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	slow := make(chan *http.Response, 1)
	go func() {
		resp, err := g.client.Do(req)
		if err != nil {
			close(slow)
			return
		}
		slow <- resp
	}()
	_, err = feed.Write([]byte(`{"prompt":`))
	require.NoError(t, err)

	// The first write is on the wire once the slow request's connection is
	// up; a second request is multiplexed on it and served.
	var reused bool
	trace := &httptrace.ClientTrace{GotConn: func(c httptrace.GotConnInfo) { reused = c.Reused }}
	fast, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), http.MethodPost, g.base+"/api/v1/responses",
		strings.NewReader(`{"prompt": "beside a slow one"}`))
	require.NoError(t, err)
	fast.Header.Set("Authorization", "Bearer "+b.key)
	fast.Header.Set("Content-Type", "application/json")
	resp, err := g.client.Do(fast)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, 2, resp.ProtoMajor)
	require.True(t, reused, "on the slow request's connection")
	require.NoError(t, resp.Body.Close())

	var ok bool
	select {
	case resp, ok = <-slow:
		require.True(t, ok, "the slow request gets a reply")
	case <-time.After(15 * time.Second): // half the default body timeout: the one set is 500ms
		t.Fatal("the slow body was not cut at GATEWAY_BODY_TIMEOUT")
	}
	defer resp.Body.Close()
	require.Equal(t, http.StatusRequestTimeout, resp.StatusCode)
	var env api.ErrorEnvelope
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&env))
	require.Equal(t, api.ErrorCode("REQUEST_TIMEOUT"), env.Error.Code)
}

func TestStreamFailures(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)

	// Validation: an error event after a 200 head, no completion.
	_, s := g.stream(b.key, map[string]any{"prompt": ""})
	require.Equal(t, []string{"response.error"}, names(s))

	// The upstream refuses at the start.
	b.fake.SetMode(fakeupstream.Down)
	_, s = g.stream(b.key, map[string]any{"prompt": "p"})
	require.Equal(t, []string{"response.error"}, names(s))
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)

	// The upstream drops the connection after two chunks.
	b.fake.SetMode(fakeupstream.OK)
	b.fake.SetBreakAfter(2)
	_, s = g.stream(b.key, map[string]any{"prompt": "one two three four"})
	require.Equal(t, []string{"response.output_text.delta", "response.output_text.delta", "response.error", "response.completed"}, names(s))
	var final api.StreamChunk
	s.Events[3].Decode(t, &final)
	require.Positive(t, final.Usage.OutputRungs, "the output received is billed")

	// Each error is counted by its code, though each stream's head said 200.
	m := g.scrape()
	require.Contains(t, m, `gateway_stream_errors_total{code="EMPTY_PROMPT"} 1`)
	require.Contains(t, m, `gateway_stream_errors_total{code="INFERENCE_BUSY"} 2`)
	require.Contains(t, m, `gateway_stream_errors_total{code="INTERNAL"} 0`)
}

// TestAStreamFromAnUpstreamThatDoesNotStream: an upstream that answers a
// stream's call with one JSON completion still answers the stream: its text
// in one delta, its evidence, and the completion billed from its usage.
func TestAStreamFromAnUpstreamThatDoesNotStream(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetNoStreaming(true)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	prompt := "answer this in one piece"

	_, s := g.stream(b.key, map[string]any{"prompt": prompt})
	require.Equal(t, []string{"response.output_text.delta", "response.completed"}, names(s))
	var delta, final api.StreamChunk
	s.Events[0].Decode(t, &delta)
	require.Equal(t, fakeupstream.Reply(prompt), delta.Content)
	require.NotNil(t, delta.Sources)
	require.Len(t, *delta.Sources, 1)
	s.Events[1].Decode(t, &final)
	require.True(t, final.Done)
	require.Equal(t, reportedUsage(prompt), final.Usage)
	usage := g.call(http.MethodGet, "/api/v1/usage", b.key, nil).object(t)
	require.Equal(t, float64(reportedUsage(prompt).TotalRungs), usage["totals"].(map[string]any)["total_rungs"], "billed as the completion reported")
}

// TestUpstreamQuirksAreRead: the real binary reads an upstream's replies by
// what they hold. An upstream that labels its streams application/json and
// its completions text/event-stream serves streams and JSON replies as any
// other, billed from its usage; one that streams a reply asked for whole
// answers the JSON request, billed from the tokenizer's count (it sent no
// usage, which the target's metric counts); one that ends its streams without [DONE], after their
// finish_reason, serves them whole, and so does one that leaves them open
// after it, sending keep-alives, one that spreads its events over several
// data: lines, and one that sends keep-alives as data. The usage view holds
// exactly what was sent.
func TestUpstreamQuirksAreRead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMislabelled(true)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	prompt := "label this wrongly"

	_, s := g.stream(b.key, map[string]any{"prompt": prompt})
	last := s.Events[len(s.Events)-1]
	require.Equal(t, "response.completed", last.Name)
	var final api.StreamChunk
	last.Decode(t, &final)
	require.Equal(t, reportedUsage(prompt), final.Usage)
	var text strings.Builder
	for _, e := range s.Events[:len(s.Events)-1] {
		require.Equal(t, "response.output_text.delta", e.Name)
		var delta api.StreamChunk
		e.Decode(t, &delta)
		text.WriteString(delta.Content)
	}
	require.Equal(t, fakeupstream.Reply(prompt), text.String())
	require.Greater(t, len(s.Events), 2, "the stream came in pieces")

	respond := func() api.Response {
		return expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt}), http.StatusOK)
	}
	whole := respond()
	require.Equal(t, fakeupstream.Reply(prompt), whole.Content)
	require.Equal(t, reportedUsage(prompt).TotalRungs, whole.Usage.TotalRungs)

	b.fake.SetMislabelled(false)
	b.fake.SetAlwaysStreaming(true)
	streamed := respond()
	require.Equal(t, fakeupstream.Reply(prompt), streamed.Content)
	require.Len(t, streamed.Sources, 1)
	require.Positive(t, streamed.Usage.OutputRungs, "counted by the tokenizer")

	// completed streams the prompt, which must complete, billed from the
	// usage the upstream reported, as a stream with [DONE] is.
	completed := func(quirk string) *api.RungUsage {
		_, s := g.stream(b.key, map[string]any{"prompt": prompt})
		require.NotContains(t, names(s), "response.error", quirk)
		last := s.Events[len(s.Events)-1]
		require.Equal(t, "response.completed", last.Name, quirk)
		var chunk api.StreamChunk
		last.Decode(t, &chunk)
		require.Equal(t, final.Usage, chunk.Usage, quirk)
		return chunk.Usage
	}
	b.fake.SetAlwaysStreaming(false)
	b.fake.SetNoDone(true)
	undone := completed("no [DONE]")
	b.fake.SetLeftOpen(true)
	open := completed("finished, then keep-alives and never an end")
	b.fake.SetLeftOpen(false)
	b.fake.SetNoDone(false)
	b.fake.SetSpread(true)
	spread := completed("events spread over lines")
	b.fake.SetSpread(false)
	b.fake.SetWrappedKeepAlives(true)
	wrapped := completed("keep-alives sent as data")

	require.Equal(t, 1.0, metricValue(t, g.scrape(), `gateway_upstream_usage_unreported_total{provider="upstream",upstream_model="instant"}`),
		"the one reply without usage, the one streamed whole")

	totals := g.usage(b.key).Totals
	require.Equal(t, int64(7), totals.Requests)
	require.Equal(t, final.Usage.TotalRungs+whole.Usage.TotalRungs+streamed.Usage.TotalRungs+undone.TotalRungs+open.TotalRungs+spread.TotalRungs+wrapped.TotalRungs, totals.TotalRungs)
}

func TestStreamKeepAliveWithSlowUpstream(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Twenty beats of silence: a busy machine that runs the keep-alive timer
	// late still sends three.
	b.fake.SetDelay(time.Second)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_SSE_KEEPALIVE": "50ms"})
	_, s := g.stream(b.key, map[string]any{"prompt": "slow"})
	require.GreaterOrEqual(t, s.Comments, 3, "keep-alives while the upstream is silent")
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
}

// TestWaitingStreamsKeepSmallStacks guards what a stream waiting for its
// upstream's first token holds in goroutine stacks: its own goroutine, whose
// stack stays at 8 KiB because it waits shallow enough (a frame added under
// the upstream call can double it), and, over HTTP/2 from the client, its
// handler's goroutine waiting at the top of its stack, which the runtime
// shrinks; the watch on an HTTP/1.1 client holds none (epoll). It counts the
// replica's stack memory (the Go collector's go_memstats_stack_inuse_bytes,
// after a collection) before and with the streams open, over HTTP/1.1 and
// HTTP/2 (h2c) upstreams: 8.5 and 12 KiB a stream (HTTP/2 adds a goroutine
// of its client's), where 16 KiB stacks would make them 16.5 and 20; over
// HTTP/2 from the client 11, and 17 when the stream stays on its handler's
// goroutine.
func TestWaitingStreamsKeepSmallStacks(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		h2c, inbound2 bool    // the upstream, the client speak HTTP/2
		bound         float64 // stack bytes a stream, at most
	}{{"HTTP1", false, false, 13 << 10}, {"H2C", true, false, 16 << 10}, {"H2CFromClient", false, true, 13 << 10}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			g := serve(t, b.db, b.fake.BaseURL(), map[string]string{
				"GATEWAY_UPSTREAM_H2C": strconv.FormatBool(c.h2c), "GATEWAY_H2C": strconv.FormatBool(c.inbound2),
				"GATEWAY_UPSTREAM_TIMEOUT": "10m", "GATEWAY_PPROF": "true",
			})
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: -1}}
			if c.inbound2 {
				client = h2cClient(t)
			}
			defer client.CloseIdleConnections()
			g.client = client
			stacks := func() float64 {
				// Stacks shrink in collections.
				resp, err := http.Get(g.metrics + "/debug/pprof/heap?gc=1")
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, resp.StatusCode, "the profiler is served, as GATEWAY_PPROF asks")
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				return metricValue(t, g.scrape(), "go_memstats_stack_inuse_bytes")
			}
			for range 5 {
				g.stream(b.key, map[string]any{"prompt": "warm up"})
			}
			before := stacks()

			const streams = 200
			b.fake.SetDelay(time.Hour)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			heads := make(chan error, streams)
			for range streams {
				go func() {
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/api/v1/responses", strings.NewReader(`{"prompt":"wait","stream":true}`))
					if err != nil {
						heads <- err
						return
					}
					req.Header.Set("Authorization", "Bearer "+b.key)
					req.Header.Set("Content-Type", "application/json")
					resp, err := client.Do(req)
					heads <- err
					if err == nil {
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				}()
			}
			for range streams {
				require.NoError(t, <-heads)
			}
			require.Eventually(t, func() bool { return b.fake.PeakInFlight() >= streams }, 10*time.Second, 10*time.Millisecond)
			// Once past DetachAfter every stream is detached, its handler
			// gone or waiting at the top.
			var perStream float64
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
				if perStream = (stacks() - before) / streams; perStream <= c.bound {
					break
				}
			}
			t.Logf("%.1f KiB of stacks a waiting stream", perStream/1024)
			require.LessOrEqual(t, perStream, c.bound, "stack bytes a waiting stream")
		})
	}
}
