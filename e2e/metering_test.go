package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
)

func (g *gateway) usage(key string) api.UsageView {
	g.t.Helper()
	r := g.call(http.MethodGet, "/api/v1/usage", key, nil)
	require.Equal(g.t, http.StatusOK, r.status, string(r.body))
	var v api.UsageView
	require.NoError(g.t, json.Unmarshal(r.body, &v))
	return v
}

func TestRateLimitHoldsAcrossReplicas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := map[string]string{"GATEWAY_RATE_LIMIT": "10"}
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env)}
	// Wait for a fresh minute's first half, so the burst stays in one window.
	if s := time.Now().Second(); s > 50 {
		time.Sleep(time.Duration(61-s) * time.Second)
	}
	var ok, limited atomic.Int64
	var wg sync.WaitGroup
	for i := range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := replicas[i%2].call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
			switch r.status {
			case http.StatusOK:
				ok.Add(1)
			case http.StatusTooManyRequests:
				limited.Add(1)
				require.Equal(t, "RATE_LIMITED", r.code(t))
			default:
				t.Errorf("unexpected status %d: %s", r.status, r.body)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(10), ok.Load(), "two replicas admit N per minute, not 2N")
	require.Equal(t, int64(20), limited.Load())
}

func TestBudgetHoldsUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Each request reserves its prompt estimate plus 1000 output rungs: the cap fits 10.
	prompt := "how many fit"
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--budget-rungs", "10050")
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	b.fake.SetDelay(50 * time.Millisecond) // keep reservations outstanding together

	var ok, refused atomic.Int64
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := replicas[i%2].call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt, "max_output_rungs": 1000})
			switch r.status {
			case http.StatusOK:
				ok.Add(1)
			case http.StatusPaymentRequired:
				refused.Add(1)
				require.Equal(t, "BUDGET_EXCEEDED", r.code(t))
			default:
				t.Errorf("unexpected status %d: %s", r.status, r.body)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(200), ok.Load()+refused.Load())
	require.GreaterOrEqual(t, ok.Load(), int64(10))
	v := replicas[0].usage(b.key)
	require.NotNil(t, v.Budget.CapRungs)
	require.LessOrEqual(t, v.Budget.SpentRungs, *v.Budget.CapRungs, "committed spend never passes the cap")
	require.Zero(t, v.Budget.ReservedRungs, "every reservation was settled or released")
	require.Equal(t, ok.Load(), v.Totals.Requests)
	require.Equal(t, v.Totals.TotalRungs, v.Budget.SpentRungs)
}

func TestUsageViewEqualsReceivedUsage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	var want api.UsageTotals
	add := func(u api.RungUsage) {
		want.Requests++
		want.InputRungs += u.InputRungs
		want.OutputRungs += u.OutputRungs
		want.TotalRungs += u.TotalRungs
	}

	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "json reply", "model": "elements"})
	var resp api.Response
	require.NoError(t, json.Unmarshal(r.body, &resp))
	add(api.RungUsage{InputRungs: resp.Usage.InputRungs, OutputRungs: resp.Usage.OutputRungs, TotalRungs: resp.Usage.TotalRungs})

	final := func(s []byte) api.RungUsage {
		lines := strings.Split(strings.TrimSpace(string(s)), "\n")
		var c api.StreamChunk
		require.NoError(t, json.Unmarshal([]byte(strings.TrimPrefix(lines[len(lines)-1], "data: ")), &c))
		require.True(t, c.Done)
		return *c.Usage
	}
	r, _ = g.stream(b.key, map[string]any{"prompt": "a streamed reply"})
	add(final(r.body))

	b.fake.SetBreakAfter(2)
	r, _ = g.stream(b.key, map[string]any{"prompt": "this one breaks off midway"})
	add(final(r.body))
	b.fake.SetBreakAfter(0)

	// A client that leaves mid-stream is billed for what was produced.
	b.fake.SetChunkDelay(200 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/api/v1/responses", strings.NewReader(`{"prompt": "leaving early now", "stream": true}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	req.Header.Set("Content-Type", "application/json")
	resp2, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	reader := bufio.NewReader(resp2.Body)
	for {
		line, err := reader.ReadString('\n')
		require.NoError(t, err)
		if strings.HasPrefix(line, "data: ") {
			break
		}
	}
	cancel()
	resp2.Body.Close()
	require.Eventually(t, func() bool { return g.usage(b.key).Totals.Requests == want.Requests+1 }, 10*time.Second, 50*time.Millisecond)
	v := g.usage(b.key)
	disconnected := api.UsageTotals{
		Requests:    1,
		InputRungs:  v.Totals.InputRungs - want.InputRungs,
		OutputRungs: v.Totals.OutputRungs - want.OutputRungs,
		TotalRungs:  v.Totals.TotalRungs - want.TotalRungs,
	}
	require.Positive(t, disconnected.OutputRungs, "the output before the disconnect is billed")
	require.Less(t, disconnected.OutputRungs, int64(len(fakeupstream.StreamPieces("leaving early now"))), "but not the output never produced")

	b.fake.SetMode(fakeupstream.Down)
	g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "refused upstream"})

	v = g.usage(b.key)
	require.Equal(t, want.Requests+1, v.Totals.Requests)
	require.Equal(t, want.TotalRungs+disconnected.TotalRungs, v.Totals.TotalRungs)
	require.Equal(t, v.Totals.TotalRungs, v.Daily.ChargedRungs, "every daily charge was reconciled to actual")
	require.Zero(t, v.Budget.ReservedRungs)
}
