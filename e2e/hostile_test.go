package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/metering"
)

// received adds up usage objects a client was sent.
type received struct{ api.UsageTotals }

func (r *received) add(u api.RungUsage) {
	r.Requests++
	r.InputRungs += u.InputRungs
	r.OutputRungs += u.OutputRungs
	r.TotalRungs += u.TotalRungs
}

func (r *received) items(res api.BatchResults) {
	for _, it := range res.Results {
		if it.Status == "completed" {
			r.add(it.Usage)
		}
	}
}

// rungs is the part of a reply's usage that a usage view sums.
func rungs(u api.Usage) api.RungUsage {
	return api.RungUsage{InputRungs: u.InputRungs, OutputRungs: u.OutputRungs, TotalRungs: u.TotalRungs}
}

// finalUsage is the usage of a stream's response.completed event.
func finalUsage(t *testing.T, body []byte) api.RungUsage {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(string(body)), "\n")
	var c api.StreamChunk
	require.NoError(t, json.Unmarshal([]byte(strings.TrimPrefix(lines[len(lines)-1], "data: ")), &c), string(body))
	require.True(t, c.Done, string(body))
	return *c.Usage
}

// settledExactly waits for the reconciler, then checks the ledger of key's
// account: the usage view equals what its clients received, every daily
// charge is reconciled to it, and nothing stays reserved.
func settledExactly(t *testing.T, g *gateway, key string, want received) {
	t.Helper()
	var v api.UsageView
	require.Eventually(t, func() bool {
		v = g.usage(key)
		return v.Daily.ChargedRungs == v.Totals.TotalRungs && v.Budget.ReservedRungs == 0
	}, 20*time.Second, 100*time.Millisecond, "the ledger settles: %+v", v)
	require.Equal(t, want.UsageTotals, v.Totals)
}

// TestHostileUpstreamStopsNoOneElse pins D11: an upstream that answers one
// account with U+0000 in its text and absurd token counts cannot stop another
// account's batch, requests or usage view, nor its own account's, nor the
// replica's shutdown.
func TestHostileUpstreamStopsNoOneElse(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bystander := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "bystander"))
	mustCLI(t, b.db, "limits", "set", "--account", "bystander", "--project", "default", "--budget-rungs", "100000000")
	b.fake.SetHostile("HOSTILE", fakeupstream.Hostile{
		Content: "bad\x00output", SourceTitle: "ti\x00tle", PromptTokens: 1 << 62, CompletionTokens: 1 << 62,
	})
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_SHUTDOWN_GRACE": "2s"})

	hostile := g.createBatch(b.key, prompts("HOSTILE", 10))
	clean := g.createBatch(bystander, prompts("clean", 10))

	var mine, theirs received
	resp := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "HOSTILE json", "max_output_rungs": 50, "web_search": true}), http.StatusOK)
	require.Equal(t, "badoutput", resp.Content, "U+0000 is removed before it is sent or stored")
	require.Equal(t, int64(50), resp.Usage.OutputRungs, "output is clamped to the ceiling sent")
	require.Equal(t, "title", resp.Sources[0].Title)
	mine.add(rungs(resp.Usage))
	src := g.call(http.MethodGet, resp.SourcesUrl, b.key, nil)
	require.Equal(t, http.StatusOK, src.status, "its evidence was stored")

	sr, _ := g.stream(b.key, map[string]any{"prompt": "HOSTILE stream", "max_output_rungs": 70})
	u := finalUsage(t, sr.body)
	require.Equal(t, int64(70), u.OutputRungs)
	mine.add(u)

	resp = expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", bystander, map[string]any{"prompt": "clean json"}), http.StatusOK)
	theirs.add(rungs(resp.Usage))
	sr, _ = g.stream(bystander, map[string]any{"prompt": "clean stream"})
	theirs.add(finalUsage(t, sr.body))

	resClean := g.waitTerminal(bystander, clean.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), resClean.Status)
	for _, it := range resClean.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
		require.True(t, strings.HasPrefix(*it.Content, "echo: clean item"), *it.Content)
	}
	theirs.items(resClean)

	resHostile := g.waitTerminal(b.key, hostile.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), resHostile.Status)
	for _, it := range resHostile.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
		require.Equal(t, "badoutput", *it.Content)
		require.Equal(t, int64(16000), it.Usage.OutputRungs, "32000 output tokens at most, at the batch rate")
	}
	mine.items(resHostile)

	settledExactly(t, g, bystander, theirs)
	settledExactly(t, g, b.key, mine)

	start := time.Now()
	require.NoError(t, g.stop())
	require.Less(t, time.Since(start), 2*time.Second+10*time.Second, "shutdown ends within the grace and a few seconds")
}

// TestUpstreamRepliesAreBounded pins the bounds of what an upstream sends
// back (D11): a reply citing a thousand sources, each quoting its whole text
// (several megabytes of reply, were each sent), is sent and stored with the
// first hundred, their fields cut; a reply with more text than its output
// tokens can hold fails (503, nothing billed), and a stream of it breaks off
// there, its text up to the bound billed and the usage sent. Batch items
// alike. Each bound passed is counted.
func TestUpstreamRepliesAreBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("CITES", fakeupstream.Hostile{
		Content: strings.Repeat("a cited word ", 1000), SourceTitle: strings.Repeat("T", 5000), Citations: 1000,
		PromptTokens: 10, CompletionTokens: 10,
	})
	b.fake.SetHostile("FLOOD", fakeupstream.Hostile{Content: strings.Repeat("x", 1000), Repeat: 100, PromptTokens: 10, CompletionTokens: 10})
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	var mine received
	batch := g.createBatch(b.key, []map[string]any{
		{"prompt": "CITES item", "max_output_rungs": 4000}, {"prompt": "FLOOD item", "max_output_rungs": 10},
	})

	checkSources := func(sources []api.Source) {
		t.Helper()
		require.Len(t, sources, 100, "the first hundred sources")
		for i, s := range sources {
			require.Equal(t, fmt.Sprintf("https://example.org/doc/%d", i), s.Url)
			require.Len(t, s.Title, 1024)
		}
	}
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "CITES json", "max_output_rungs": 4000})
	resp := expect[api.Response](t, r, http.StatusOK)
	require.Less(t, len(r.body), 400<<10, "the reply is not the size of a thousand copies of its text")
	checkSources(resp.Sources)
	require.Len(t, *resp.Sources[0].Snippet, 2048, "a snippet is cut")
	mine.add(rungs(resp.Usage))
	ev := expect[api.Sources](t, g.call(http.MethodGet, resp.SourcesUrl, b.key, nil), http.StatusOK)
	require.Equal(t, resp.Sources, ev.Sources, "the evidence stored is the evidence sent")

	_, s := g.stream(b.key, map[string]any{"prompt": "CITES stream", "max_output_rungs": 4000})
	var streamed []api.Source
	for _, e := range s.Events[:len(s.Events)-1] {
		var c api.StreamChunk
		e.Decode(t, &c)
		if c.Sources != nil {
			streamed = append(streamed, *c.Sources...)
		}
	}
	checkSources(streamed)
	var done api.StreamChunk
	s.Events[len(s.Events)-1].Decode(t, &done)
	require.True(t, done.Done)
	mine.add(*done.Usage)

	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "FLOOD json", "max_output_rungs": 10})
	require.Equal(t, http.StatusServiceUnavailable, r.status, "100 KB of text for 10 tokens is no reply: %s", r.body)
	require.Contains(t, string(r.body), "INFERENCE_BUSY")

	_, s = g.stream(b.key, map[string]any{"prompt": "FLOOD stream", "max_output_rungs": 10})
	require.Equal(t, "response.error", s.Events[len(s.Events)-2].Name, "the stream breaks off")
	require.Contains(t, string(s.Events[len(s.Events)-2].Data), "INFERENCE_BUSY")
	var text strings.Builder
	for _, e := range s.Events[:len(s.Events)-2] {
		var c api.StreamChunk
		e.Decode(t, &c)
		text.WriteString(c.Content)
	}
	require.Equal(t, strings.Repeat("x", 10*256), text.String(), "the text up to the bound of 10 tokens, no more")
	s.Events[len(s.Events)-1].Decode(t, &done)
	require.True(t, done.Done)
	require.Equal(t, int64(10), done.Usage.OutputRungs, "the text sent is billed, at most the tokens asked for")
	mine.add(*done.Usage)

	res := g.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchItemStatus("completed"), res.Results[0].Status)
	ev = expect[api.Sources](t, g.call(http.MethodGet, "/api/v1/sources/"+res.Results[0].RequestId.String(), b.key, nil), http.StatusOK)
	checkSources(ev.Sources)
	require.Equal(t, api.BatchItemStatus("failed"), res.Results[1].Status)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), res.Results[1].Error.Code)
	require.Zero(t, res.Results[1].Usage.TotalRungs)
	mine.items(res)

	settledExactly(t, g, b.key, mine)
	require.Eventually(t, func() bool {
		m := g.scrape()
		// Streamed sources cite no span of the text: no snippet to cut.
		for bound, n := range map[string]int{"sources": 3, "title": 3, "snippet": 2, "text": 3, "url": 0} {
			want := fmt.Sprintf(`gateway_upstream_reply_cuts_total{bound=%q,provider="upstream",upstream_model="instant"} %d`, bound, n)
			if !strings.Contains(m, want) {
				t.Logf("missing %s", want)
				return false
			}
		}
		return true
	}, 10*time.Second, 100*time.Millisecond)
}

// TestUsageReportedAsNothingIsCounted: an upstream that reports no tokens
// for its replies (servers that send zeros, or their counts under other
// names) does not make them free: the tokenizer counts each side reported
// as nothing, in a reply, a stream and a batch item alike, and the metric
// of clamped counts says so.
func TestUsageReportedAsNothingIsCounted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("FREE", fakeupstream.Hostile{Content: "these words were free until now"})
	g := serve(t, b.db, b.fake.BaseURL(), nil)

	var mine received
	resp := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "FREE json"}), http.StatusOK)
	require.Positive(t, resp.Usage.InputRungs)
	require.Positive(t, resp.Usage.OutputRungs)
	mine.add(rungs(resp.Usage))

	sr, _ := g.stream(b.key, map[string]any{"prompt": "FREE stream"})
	u := finalUsage(t, sr.body)
	require.Equal(t, resp.Usage.InputRungs, u.InputRungs, "prompts of as many tokens")
	require.Equal(t, resp.Usage.OutputRungs, u.OutputRungs, "the same words")
	mine.add(u)

	batch := g.createBatch(b.key, prompts("FREE", 1))
	res := g.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchItemStatus("completed"), res.Results[0].Status)
	require.Positive(t, res.Results[0].Usage.OutputRungs)
	mine.items(res)

	settledExactly(t, g, b.key, mine)
	m := g.scrape()
	for _, side := range []string{"input", "output"} {
		require.Equal(t, 3.0, metricValue(t, m, fmt.Sprintf(`gateway_upstream_usage_clamped_total{model="instant",side=%q}`, side)), side)
	}
}

// TestThinkingIsBilledWhenNoUsageIs: a reasoning model's thinking is output
// its upstream charges for. When the upstream reports no count of it (zeros,
// or a stream cut short after the model thought), the tokenizer counts it
// with the text, once though it came under two names, in a reply and a
// stream alike; the thinking itself is never sent.
func TestThinkingIsBilledWhenNoUsageIs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const answer, thinking = "the sky is blue", "Rayleigh scattering: shorter wavelengths scatter more, so the sky looks blue."
	b.fake.SetHostile("PLAIN", fakeupstream.Hostile{Content: answer})
	b.fake.SetHostile("THINKS", fakeupstream.Hostile{Content: answer, Reasoning: thinking})
	b.fake.SetHostile("CUT", fakeupstream.Hostile{Content: answer, Reasoning: thinking, Repeat: 2})
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)

	var mine received
	reply := func(prompt string) api.RungUsage {
		resp := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt}), http.StatusOK)
		require.Equal(t, answer, resp.Content)
		u := rungs(resp.Usage)
		mine.add(u)
		return u
	}
	plain, thinks := reply("PLAIN"), reply("THINKS")
	require.Equal(t, plain.OutputRungs+int64(tok.CountUpTo(thinking, 1000)), thinks.OutputRungs, "instant's multiplier is 1")

	sr, _ := g.stream(b.key, map[string]any{"prompt": "THINKS"})
	require.NotContains(t, string(sr.body), "Rayleigh")
	u := finalUsage(t, sr.body)
	require.Equal(t, thinks, u)
	mine.add(u)

	b.fake.SetBreakAfter(1) // after the thinking and the first answer
	sr, _ = g.stream(b.key, map[string]any{"prompt": "CUT"})
	require.Contains(t, string(sr.body), "response.error")
	u = finalUsage(t, sr.body)
	require.Equal(t, thinks.OutputRungs, u.OutputRungs, "the thinking and the text sent")
	mine.add(u)

	settledExactly(t, g, b.key, mine)
}

// TestAStreamsUsageInPartsIsBilledAsReported: an upstream that reports a
// stream's usage in parts (the prompt's count first, the completion's alone
// at the end, then the cached tokens alone, as a translation of Anthropic's
// events does) is billed the counts it reported, not the tokenizer's, and
// the usage view settles exactly.
func TestAStreamsUsageInPartsIsBilledAsReported(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const prompt = "PARTS: a prompt long enough for the input count reported to pass no bound"
	b.fake.SetHostile("PARTS", fakeupstream.Hostile{Content: "an answer reported in parts", PromptTokens: 50, CompletionTokens: 9, UsageInParts: true})
	g := serve(t, b.db, b.fake.BaseURL(), nil)

	sr, _ := g.stream(b.key, map[string]any{"prompt": prompt})
	u := finalUsage(t, sr.body)
	require.Equal(t, api.RungUsage{InputRungs: 50, OutputRungs: 9, TotalRungs: 59}, u, "instant's multiplier is 1")
	var mine received
	mine.add(u)
	settledExactly(t, g, b.key, mine)
}

// TestAStreamKeptOpenWithoutOutputEnds: an upstream that sends a stream's
// first words and then only keep-alive lines, never its end, cannot hold the
// stream (its reservation, its connections) past GATEWAY_UPSTREAM_STREAM_LIMIT:
// the stream breaks off there as any mid-stream failure, billed for the
// words sent, and the ledger settles.
func TestAStreamKeptOpenWithoutOutputEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetHostile("STALL", fakeupstream.Hostile{Content: "first words", KeepAlive: 20 * time.Millisecond})
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_UPSTREAM_STREAM_LIMIT": "1s"})

	_, s := g.stream(b.key, map[string]any{"prompt": "STALL stream"})
	require.Equal(t, []string{"response.output_text.delta", "response.error", "response.completed"}, names(s))
	var c api.StreamChunk
	s.Events[0].Decode(t, &c)
	require.Equal(t, "first words", c.Content)
	var env api.ErrorEnvelope
	s.Events[1].Decode(t, &env)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), env.Error.Code)
	var done api.StreamChunk
	s.Events[2].Decode(t, &done)
	require.True(t, done.Done)
	require.Positive(t, done.Usage.OutputRungs, "the words sent are billed")

	var mine received
	mine.add(*done.Usage)
	settledExactly(t, g, b.key, mine)
}

// TestHeadersAreBounded: a request's headers past 64 KiB are refused with
// 431, and a client that does not finish sending its headers within 10 s is
// let go; the replica serves others meanwhile.
func TestHeadersAreBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	addr := strings.TrimPrefix(g.base, "http://")

	req, err := http.NewRequest(http.MethodGet, g.base+"/api/v1/usage", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("X-Padding", strings.Repeat("p", 100<<10))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, resp.StatusCode)

	slow, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer slow.Close()
	_, err = slow.Write([]byte("GET /api/v1/usage HTTP/1.1\r\nHost: gateway\r\n"))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/api/v1/usage", b.key, nil).status, "others are served meanwhile")
	require.NoError(t, slow.SetReadDeadline(time.Now().Add(30*time.Second)))
	_, err = io.ReadAll(slow)
	require.NoError(t, err, "the connection is closed by the replica, not by the deadline")
}
