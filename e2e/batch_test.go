package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
)

func prompts(prefix string, n int) []map[string]any {
	out := make([]map[string]any, n)
	for i := range out {
		out[i] = map[string]any{"prompt": fmt.Sprintf("%s item %d", prefix, i)}
	}
	return out
}

func (g *gateway) createBatch(key string, requests []map[string]any) api.Batch {
	g.t.Helper()
	return expect[api.Batch](g.t, g.call(http.MethodPost, "/api/v1/batch", key, map[string]any{"requests": requests}), http.StatusAccepted)
}

// batch reads batch id.
func (g *gateway) batch(key, id string) api.Batch {
	g.t.Helper()
	return expect[api.Batch](g.t, g.call(http.MethodGet, "/api/v1/batch/"+id, key, nil), http.StatusOK)
}

// finished requires batch id, ended, to count its items as res shows them,
// its usage their sum, and its times in their order: created, started (when
// an item ran), completed.
func (g *gateway) finished(key string, res api.BatchResults) api.Batch {
	g.t.Helper()
	b := g.batch(key, res.BatchId.String())
	require.Equal(g.t, res.Status, b.Status)
	counts := map[api.BatchItemStatus]int{}
	for _, it := range res.Results {
		counts[it.Status]++
	}
	require.Equal(g.t, len(res.Results), b.TotalRequests)
	require.Equal(g.t, []int{counts["completed"], counts["failed"], counts["cancelled"]}, []int{b.CompletedRequests, b.FailedRequests, b.CancelledRequests})
	require.Equal(g.t, sumItems(res), b.Usage.TotalRungs)
	require.NotNil(g.t, b.CompletedAt)
	if counts["completed"]+counts["failed"] > 0 {
		require.NotNil(g.t, b.StartedAt)
		require.False(g.t, b.StartedAt.Before(b.CreatedAt), "started %s, created %s", b.StartedAt, b.CreatedAt)
		require.False(g.t, b.CompletedAt.Before(*b.StartedAt), "completed %s, started %s", b.CompletedAt, b.StartedAt)
	}
	return b
}

func (g *gateway) results(key, id string) api.BatchResults {
	g.t.Helper()
	return expect[api.BatchResults](g.t, g.call(http.MethodGet, "/api/v1/batch/"+id+"/results", key, nil), http.StatusOK)
}

func terminal(s api.BatchStatus) bool {
	return s == "completed" || s == "failed" || s == "cancelled" || s == "expired"
}

// waitTerminal polls until the batch is terminal and returns its results.
func (g *gateway) waitTerminal(key, id string, within time.Duration) api.BatchResults {
	g.t.Helper()
	return g.waitTerminalWith(func() string { return key }, id, within)
}

// waitTerminalWith is waitTerminal polling with the key keys gives for each
// request.
func (g *gateway) waitTerminalWith(keys func() string, id string, within time.Duration) api.BatchResults {
	g.t.Helper()
	deadline := time.Now().Add(within)
	for {
		res := g.results(keys(), id)
		if terminal(res.Status) {
			return res
		}
		if time.Now().After(deadline) {
			g.t.Fatalf("batch %s still %s after %s: %+v", id, res.Status, within, res.Results)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// callsPerPrompt counts the upstream calls of each prompt.
func callsPerPrompt(f *fakeupstream.Server) map[string]int {
	out := map[string]int{}
	for _, c := range f.Calls() {
		out[c.Prompt]++
	}
	return out
}

func sumItems(results ...api.BatchResults) (total int64) {
	for _, r := range results {
		for _, it := range r.Results {
			total += it.Usage.TotalRungs
		}
	}
	return total
}

func TestBatchesDrainAcrossReplicas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(5 * time.Millisecond)
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	other := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "other"))

	var ids []string
	for i := range 5 {
		ids = append(ids, replicas[i%3].createBatch(b.key, prompts(fmt.Sprintf("batch %d", i), 20)).Id.String())
	}
	var all []api.BatchResults
	for i, id := range ids {
		res := replicas[(i+1)%3].waitTerminal(b.key, id, 60*time.Second)
		require.Equal(t, api.BatchStatus("completed"), res.Status)
		for _, it := range res.Results {
			require.Equal(t, api.BatchItemStatus("completed"), it.Status)
			require.Equal(t, fakeupstream.Reply(fmt.Sprintf("batch %d item %d", i, it.Index)), *it.Content)
		}
		all = append(all, res)
		g := replicas[(i+2)%3]
		g.finished(b.key, res)
		// Another account sees nothing of it.
		r := replicas[i%3].call(http.MethodGet, "/api/v1/batch/"+id, other, nil)
		require.Equal(t, http.StatusNotFound, r.status)
	}
	calls := callsPerPrompt(b.fake)
	require.Len(t, calls, 100)
	for p, n := range calls {
		require.Equal(t, 1, n, "prompt %q reached the upstream %d times", p, n)
	}
	v := replicas[0].usage(b.key)
	require.Equal(t, sumItems(all...), v.Totals.TotalRungs, "the usage view equals the sum of item usage")
	require.Equal(t, int64(100), v.Totals.Requests)

	// The batch discount applies: half the interactive price, rounded up per side.
	pt, ct := fakeupstream.Usage("batch 0 item 0")
	first := all[0].Results[0].Usage
	require.Equal(t, api.RungUsage{InputRungs: int64(pt+1) / 2, OutputRungs: int64(ct+1) / 2, TotalRungs: int64(pt+1)/2 + int64(ct+1)/2}, first)
}

// TestBatchSurvivesKill9 kills replicas without warning while they run items:
// three replicas with two slots each, so kills land on running items, and
// several kills. Each prompt reaches the upstream at most once, a killed
// replica's items are INTERRUPTED (never run again), and the ledger is exact.
func TestBatchSurvivesKill9(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--project", "default", "--budget-rungs", "100000000")
	b.fake.SetDelay(400 * time.Millisecond)
	env := map[string]string{"GATEWAY_LEASE": "2s", "GATEWAY_DRAIN_CONCURRENCY": "2"}
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env)}
	batch := replicas[0].createBatch(b.key, prompts("crash", 80)) // outlasts the kills: each waits for items in flight

	const kills = 4
	for k := range kills {
		seen := len(b.fake.Calls())
		require.Eventually(t, func() bool { return len(b.fake.Calls()) >= seen+2 }, 10*time.Second, 10*time.Millisecond, "items in flight")
		victim := replicas[k%len(replicas)]
		require.NoError(t, victim.cmd.Process.Kill())
		<-victim.done
		victim.done <- nil
		replicas[k%len(replicas)] = serve(t, b.db, b.fake.BaseURL(), env)
	}

	survivor := replicas[len(replicas)-1]
	res := survivor.waitTerminal(b.key, batch.Id.String(), 90*time.Second)
	interrupted := 0
	calls := callsPerPrompt(b.fake)
	var want received
	for _, it := range res.Results {
		switch it.Status {
		case "completed":
			require.Equal(t, 1, calls[fmt.Sprintf("crash item %d", it.Index)], "a completed item ran exactly once")
			want.add(it.Usage)
		case "failed":
			require.Equal(t, api.ErrorCode("INTERRUPTED"), it.Error.Code)
			require.Equal(t, api.RungUsage{}, it.Usage, "an interrupted item is not billed")
			interrupted++
		default:
			t.Fatalf("item %d is %s", it.Index, it.Status)
		}
	}
	require.Positive(t, interrupted, "kills landed on running items")
	// A victim holds, per slot, an item at the upstream and one whose outcome
	// waits in the completer's buffer, plus the group being committed (with a
	// 400 ms upstream, never more than its two slots' worth): 3 × 2 per kill.
	require.LessOrEqual(t, interrupted, 3*2*kills, "at most the victims' items not yet committed")
	atMostOnce(t, b.fake, "crash")
	settledExactly(t, survivor, b.key, want)

	// A restarted replica finds nothing left to do.
	restarted := serve(t, b.db, b.fake.BaseURL(), env)
	require.Equal(t, res, restarted.results(b.key, batch.Id.String()))
}

func TestBatchWaitsOutAnUpstreamOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMode(fakeupstream.Down)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	batch := g.createBatch(b.key, prompts("outage", 10))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 3 }, 10*time.Second, 20*time.Millisecond, "the drainer probes")
	res := g.results(b.key, batch.Id.String())
	for _, it := range res.Results {
		require.Contains(t, []api.BatchItemStatus{"queued", "in_progress"}, it.Status, "nothing fails for an outage")
	}
	b.fake.SetMode(fakeupstream.OK)
	res = g.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
	}
	require.Equal(t, sumItems(res), g.usage(b.key).Totals.TotalRungs, "items retried after the outage are billed once")
}

// TestBatchWaitsOutASlow503: an upstream that answers 503 only after a long
// wait (an overloaded proxy's queue timing out) did not process the call:
// the batch's items wait in the queue, none failed for it, and an
// interactive request meanwhile is INFERENCE_BUSY and billed nothing; once
// the upstream is back, every item completes, billed once.
func TestBatchWaitsOutASlow503(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMode(fakeupstream.Down)
	b.fake.SetDelay(700 * time.Millisecond)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	batch := g.createBatch(b.key, prompts("slow outage", 6))
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "meanwhile"})
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 4 }, 20*time.Second, 20*time.Millisecond, "the drainer probes")
	for _, it := range g.results(b.key, batch.Id.String()).Results {
		require.Contains(t, []api.BatchItemStatus{"queued", "in_progress"}, it.Status, "nothing fails for a slow 503")
	}
	require.Zero(t, g.usage(b.key).Totals.TotalRungs)

	b.fake.SetMode(fakeupstream.OK)
	b.fake.SetDelay(0)
	res := g.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status)
	}
	require.Equal(t, sumItems(res), g.usage(b.key).Totals.TotalRungs, "items retried after the outage are billed once")
}

func TestBatchExpires(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMode(fakeupstream.Down)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_BATCH_WINDOW": "1s"})
	batch := g.createBatch(b.key, prompts("late", 3))
	require.Equal(t, batch.CreatedAt.Add(time.Second), batch.ExpiresAt)
	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("expired"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("cancelled"), it.Status)
	}
	final := g.finished(b.key, res)
	require.Equal(t, api.ErrorCode("BATCH_EXPIRED"), final.Error.Code)
	require.Zero(t, g.usage(b.key).Daily.ChargedRungs, "unrun items give their estimates back")
}

func TestBatchCancelInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(800 * time.Millisecond)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_DRAIN_CONCURRENCY": "2"})
	batch := g.createBatch(b.key, prompts("cancel", 8))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 2 }, 10*time.Second, 10*time.Millisecond)
	cancelling := expect[api.Batch](t, g.call(http.MethodPost, "/api/v1/batch/"+batch.Id.String()+"/cancel", b.key, nil), http.StatusOK)
	require.Equal(t, api.BatchStatus("cancelling"), cancelling.Status)

	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("cancelled"), res.Status)
	completed := 0
	for _, it := range res.Results {
		if it.Status == "completed" {
			completed++
			require.Positive(t, it.Usage.TotalRungs, "items in flight finish and are billed")
		} else {
			require.Equal(t, api.BatchItemStatus("cancelled"), it.Status)
		}
	}
	require.Equal(t, 2, completed)
	g.finished(b.key, res)
	require.Len(t, b.fake.Calls(), 2, "nothing else was dispatched")
	require.Equal(t, sumItems(res), g.usage(b.key).Totals.TotalRungs)

	// A batch just created cancels too: cancelled at once if still queued,
	// cancelling if the drainer has started it already (the store's tests
	// hold each case apart).
	next := g.createBatch(b.key, prompts("next", 3))
	cancelled := expect[api.Batch](t, g.call(http.MethodPost, "/api/v1/batch/"+next.Id.String()+"/cancel", b.key, nil), http.StatusOK)
	require.Contains(t, []api.BatchStatus{"cancelled", "cancelling"}, cancelled.Status)
	require.Equal(t, api.BatchStatus("cancelled"), g.waitTerminal(b.key, next.Id.String(), 30*time.Second).Status)
}

func TestBatchBudgetExhausted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Each item reserves about 50 rungs (its prompt and 100 output rungs at half price).
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--budget-rungs", "160")
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_DRAIN_CONCURRENCY": "1"})
	requests := prompts("budget", 6)
	for _, r := range requests {
		r["max_output_rungs"] = 100
	}
	batch := g.createBatch(b.key, requests)
	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	completed, refused := 0, 0
	for _, it := range res.Results {
		switch it.Status {
		case "completed":
			completed++
		case "failed":
			require.Equal(t, api.ErrorCode("BUDGET_EXCEEDED"), it.Error.Code)
			require.Equal(t, api.RungUsage{}, it.Usage)
			refused++
		}
	}
	require.Positive(t, completed)
	require.Positive(t, refused)
	require.Equal(t, 6, completed+refused)
	g.finished(b.key, res)
	v := g.usage(b.key)
	require.LessOrEqual(t, v.Budget.SpentRungs, *v.Budget.CapRungs)
}

// TestARunningItemReservesItsBudget: while a capped project's batch item
// runs, the usage view shows its estimate reserved (interactive requests'
// slices are not shown there); once it completes, its cost spent and
// nothing reserved.
func TestARunningItemReservesItsBudget(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--budget-rungs", "100000")
	b.fake.SetSlow("reserved", 2*time.Second)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	batch := g.createBatch(b.key, prompts("reserved", 1))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) == 1 }, 10*time.Second, 10*time.Millisecond)
	v := g.usage(b.key)
	require.Positive(t, v.Budget.ReservedRungs)
	require.Zero(t, v.Budget.SpentRungs)

	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	v = g.usage(b.key)
	require.Zero(t, v.Budget.ReservedRungs)
	require.Equal(t, sumItems(res), v.Budget.SpentRungs)
}

func TestBatchIdempotencyAcrossReplicas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMode(fakeupstream.Reject)
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	body := map[string]any{"requests": prompts("idem", 2)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	ids := map[string]int{}
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g := replicas[i%2]
			req, _ := http.NewRequest(http.MethodPost, g.base+"/api/v1/batch", jsonBody(t, body))
			req.Header.Set("Authorization", "Bearer "+b.key)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "create-once")
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			var got api.Batch
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
			mu.Lock()
			ids[got.Id.String()+fmt.Sprint(resp.StatusCode)]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, ids, 2, "one 202 and the rest 200, all with the same batch: %v", ids)
	for k, n := range ids {
		if k[len(k)-3:] == "202" {
			require.Equal(t, 1, n)
		}
	}
	list := replicas[0].call(http.MethodGet, "/api/v1/batches", b.key, nil)
	require.Len(t, list.object(t)["data"], 1)

	// The upstream rejected every item: they fail with its reason, and so does the batch.
	var id string
	for k := range ids {
		id = k[:36]
	}
	res := replicas[1].waitTerminal(b.key, id, 30*time.Second)
	require.Equal(t, api.BatchStatus("failed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), it.Error.Code)
		require.Contains(t, it.Error.Message, "content policy violation")
	}
}

// TestOperatorListsAndCancelsBatches: gateway batches list shows every
// account's batches, newest first, with their project and progress, and
// filters them; gateway batches cancel cancels a batch of any account, or
// every open batch of one, as its owner would, which the owner then reads
// through the API.
func TestOperatorListsAndCancelsBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "other", "--project", "research"))
	// The batches wait for their upstream; then no replica runs.
	b.fake.SetMode(fakeupstream.Down)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	first := g.createBatch(b.key, prompts("acme", 2)).Id.String()
	second := g.createBatch(other, prompts("other", 3)).Id.String()
	third := g.createBatch(other, prompts("other", 1)).Id.String()
	require.NoError(t, g.stop())

	rows := func(args ...string) [][]string {
		t.Helper()
		var out [][]string
		for _, line := range strings.Split(strings.TrimSpace(mustCLI(t, b.db, append([]string{"batches", "list"}, args...)...)), "\n") {
			out = append(out, strings.Fields(line))
		}
		require.Equal(t, []string{"ID", "ACCOUNT", "PROJECT", "STATUS", "DONE", "COMPLETED", "FAILED", "CANCELLED", "RUNGS", "CREATED", "EXPIRES", "ERROR"}, out[0])
		return out[1:]
	}
	open := []string{"queued", "in_progress"}
	listed := rows()
	require.Len(t, listed, 3)
	require.Equal(t, []string{third, second}, []string{listed[0][0], listed[1][0]}, "newest first")
	listed = listed[1:]
	require.Equal(t, []string{second, "other", "research"}, listed[0][:3])
	require.Contains(t, open, listed[0][3])
	require.Equal(t, []string{"0/3", "0", "0", "0", "0"}, listed[0][4:9])
	require.Equal(t, "-", listed[0][11], "no error")
	require.Equal(t, []string{first, "acme", "default"}, listed[1][:3])
	require.Equal(t, [][]string{listed[1]}, rows("--account", "acme", "--status", "open"))
	limited := rows("--limit", "1")
	require.Len(t, limited, 1)
	require.Equal(t, third, limited[0][0])
	limited = rows("--limit", "1", "--before", third)
	require.Len(t, limited, 1)
	require.Equal(t, second, limited[0][0], "the next page")
	require.Empty(t, rows("--before", first), "past the last page")
	require.Empty(t, rows("--status", "completed,failed"))

	_, said, err := cliIn(t, t.TempDir(), map[string]string{"DATABASE_URL": b.db}, "batches", "cancel", second)
	require.NoError(t, err, said)
	require.Equal(t, "cancelled\n", said, "no item of it was running")
	cancelled := rows("--status", "cancelled")
	require.Len(t, cancelled, 1)
	require.Equal(t, []string{second, "other", "research", "cancelled", "3/3", "0", "0", "3"}, cancelled[0][:8])
	_, err = cli(t, b.db, "batches", "cancel", second)
	require.ErrorContains(t, err, "a batch that is cancelled cannot be cancelled")
	// Every open batch of an account at once: the one left of other.
	lines, said, err := cliIn(t, t.TempDir(), map[string]string{"DATABASE_URL": b.db}, "batches", "cancel", "--account", "other")
	require.NoError(t, err, said)
	require.Equal(t, third+" cancelled\n", lines)
	require.Equal(t, "1 cancelled, 0 cancelling, 0 not cancelled\n", said)
	lines, said, err = cliIn(t, t.TempDir(), map[string]string{"DATABASE_URL": b.db}, "batches", "cancel", "--account", "other")
	require.NoError(t, err, said)
	require.Equal(t, []string{"", "0 cancelled, 0 cancelling, 0 not cancelled\n"}, []string{lines, said})
	for _, args := range [][]string{{}, {first, "--account", "acme"}} {
		_, err = cli(t, b.db, append([]string{"batches", "cancel"}, args...)...)
		require.ErrorContains(t, err, "name a batch (BATCH_ID) or an account (--account A), not both", "%v", args)
	}
	_, err = cli(t, b.db, "batches", "cancel", "--account", "nobody")
	require.ErrorContains(t, err, `no such account "nobody"`)
	_, err = cli(t, b.db, "batches", "cancel", "b-123")
	require.ErrorContains(t, err, `want a batch id (a UUID, as batches list shows), got "b-123"`)
	_, err = cli(t, b.db, "batches", "list", "--status", "done")
	require.ErrorContains(t, err, "--status: want statuses among queued, in_progress, cancelling, completed, failed, cancelled, expired, or open")
	_, err = cli(t, b.db, "batches", "list", "--limit", "0")
	require.ErrorContains(t, err, "--limit: want 1 to 10000")
	_, err = cli(t, b.db, "batches", "list", "--before", "b-123")
	require.ErrorContains(t, err, `--before: want a batch id (a UUID, as batches list shows), got "b-123"`)
	_, err = cli(t, b.db, "batches", "list", "--account", "acme-typo")
	require.ErrorContains(t, err, `no such account "acme-typo"`)

	// Its owner reads the batches cancelled, every item with them; the other
	// account's batch is untouched.
	b.fake.SetMode(fakeupstream.OK)
	g = serve(t, b.db, b.fake.BaseURL(), nil)
	for _, id := range []string{second, third} {
		res := g.results(other, id)
		require.Equal(t, api.BatchStatus("cancelled"), res.Status)
		for _, it := range res.Results {
			require.Equal(t, api.BatchItemStatus("cancelled"), it.Status)
		}
	}
	require.Equal(t, api.BatchStatus("completed"), g.waitTerminal(b.key, first, 60*time.Second).Status)
}

// TestTurnsAsConfigured: GATEWAY_TURN_PLACES and GATEWAY_TURN_WAIT set how
// many of an account's large requests a replica prices at once and how long
// the next one waits. With two places (one by default on the two cores the
// replica is given), held by creations whose bodies are still coming, the
// account's next large creation waits the 2 s configured (long beside the
// milliseconds another creation may hold a place before the held ones take
// theirs) and is refused for its turn; the held ones are created once their
// bodies arrive.
func TestTurnsAsConfigured(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GOMAXPROCS": "2", "GATEWAY_TURN_PLACES": "2", "GATEWAY_TURN_WAIT": "2s"})
	large := map[string]any{"requests": []map[string]any{{"prompt": strings.Repeat("word ", 14_000)}}}
	raw, err := json.Marshal(large)
	require.NoError(t, err)

	held := make([]net.Conn, 2)
	for i := range held {
		held[i], err = net.Dial("tcp", strings.TrimPrefix(g.base, "http://"))
		require.NoError(t, err)
		defer held[i].Close()
		_, err = fmt.Fprintf(held[i], "POST /api/v1/batch HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
			b.key, len(raw), raw[:len(raw)/2])
		require.NoError(t, err)
	}

	// Until the held creations have their places, the next ones may take
	// one first.
	var message string
	require.Eventually(t, func() bool {
		r := g.call(http.MethodPost, "/api/v1/batch", b.key, large)
		if r.status != http.StatusTooManyRequests {
			return false
		}
		message = r.object(t)["error"].(map[string]any)["message"].(string)
		return strings.Contains(message, "for its turn")
	}, 20*time.Second, 10*time.Millisecond)
	require.Contains(t, message, "priced 2 at a time")
	require.Contains(t, message, "waited 2s")

	for _, conn := range held {
		_, err = conn.Write(raw[len(raw)/2:])
		require.NoError(t, err)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusAccepted, resp.StatusCode)
	}
}
