package e2e

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
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
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "HOSTILE json", "max_output_rungs": 50, "web_search": true})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	var resp api.Response
	require.NoError(t, json.Unmarshal(r.body, &resp))
	require.Equal(t, "badoutput", resp.Content, "U+0000 is removed before it is sent or stored")
	require.Equal(t, int64(50), resp.Usage.OutputRungs, "output is clamped to the ceiling sent")
	require.Equal(t, "title", resp.Sources[0].Title)
	mine.add(api.RungUsage{InputRungs: resp.Usage.InputRungs, OutputRungs: resp.Usage.OutputRungs, TotalRungs: resp.Usage.TotalRungs})
	src := g.call(http.MethodGet, resp.SourcesUrl, b.key, nil)
	require.Equal(t, http.StatusOK, src.status, "its evidence was stored")

	sr, _ := g.stream(b.key, map[string]any{"prompt": "HOSTILE stream", "max_output_rungs": 70})
	u := finalUsage(t, sr.body)
	require.Equal(t, int64(70), u.OutputRungs)
	mine.add(u)

	r = g.call(http.MethodPost, "/api/v1/responses", bystander, map[string]any{"prompt": "clean json"})
	require.Equal(t, http.StatusOK, r.status)
	require.NoError(t, json.Unmarshal(r.body, &resp))
	theirs.add(api.RungUsage{InputRungs: resp.Usage.InputRungs, OutputRungs: resp.Usage.OutputRungs, TotalRungs: resp.Usage.TotalRungs})
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
