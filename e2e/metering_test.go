package e2e

import (
	"bufio"
	"context"
	"encoding/csv"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/testdb"
)

func (g *gateway) usage(key string) api.UsageView {
	g.t.Helper()
	return expect[api.UsageView](g.t, g.call(http.MethodGet, "/api/v1/usage", key, nil), http.StatusOK)
}

// awaitAMinutesFirstHalf waits, past the 45th second, for the next minute,
// so that requests sent at once fall in one rate window.
func awaitAMinutesFirstHalf() {
	if s := time.Now().Second(); s > 45 {
		time.Sleep(time.Duration(61-s) * time.Second)
	}
}

// TestRateLimitHoldsAcrossReplicas: three replicas counting one key from
// their own slices admit its limit per minute together, never more.
func TestRateLimitHoldsAcrossReplicas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := map[string]string{"GATEWAY_RATE_LIMIT": "10"}
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env)}
	awaitAMinutesFirstHalf()
	var ok, limited atomic.Int64
	var wg sync.WaitGroup
	for i := range 45 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := replicas[i%3].call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
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
	require.Equal(t, int64(10), ok.Load(), "three replicas admit N per minute, not 3N")
	require.Equal(t, int64(35), limited.Load())
}

// TestAStoppedReplicaGivesBackItsRateSlices: a replica stopped with part of
// a key's minute leased and unused gives it back as it stops, for the
// others to admit: the key's limit is served whole that minute.
func TestAStoppedReplicaGivesBackItsRateSlices(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const limit = 64 // a first slice is a sixteenth: 4
	env := map[string]string{"GATEWAY_RATE_LIMIT": strconv.Itoa(limit)}
	stopping, staying := serve(t, b.db, b.fake.BaseURL(), env), serve(t, b.db, b.fake.BaseURL(), env)
	awaitAMinutesFirstHalf()
	ask := func(g *gateway) int {
		return g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"}).status
	}
	require.Equal(t, http.StatusOK, ask(stopping))
	require.NoError(t, stopping.stop())

	var ok, limited atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 10 {
				switch status := ask(staying); status {
				case http.StatusOK:
					ok.Add(1)
				case http.StatusTooManyRequests:
					limited.Add(1)
				default:
					t.Errorf("unexpected status %d", status)
				}
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(limit-1), ok.Load(), "the stopped replica's unused slice is served by the other")
	require.Equal(t, int64(80-limit+1), limited.Load())
}

// TestAStoppedReplicaGivesBackItsQuotaSlices: a replica stopped while it
// holds a slice of the daily ceiling folds it back as it stops: under a
// ceiling of two requests' estimates, the other replica serves the second
// request at once rather than after the slice's lease.
func TestAStoppedReplicaGivesBackItsQuotaSlices(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// An estimate is the prompt's token and 1,000 output rungs.
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--daily-rungs", "2002")
	stopping, staying := serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)
	ask := func(g *gateway) reply {
		return g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p", "max_output_rungs": 1000})
	}
	require.Equal(t, http.StatusOK, ask(stopping).status)
	require.NoError(t, stopping.stop())
	for i := range 2 {
		r := ask(staying)
		require.Equal(t, http.StatusOK, r.status, "request %d: %s", i, r.body)
	}
}

// TestLimitsHoldUnderConcurrency: 200 concurrent requests against a project
// budget, or a daily ceiling, that fits 10, over one and over three replicas,
// with an upstream that reports far more usage than it could have produced:
// exactly 10 are served, and the spend passes the limit only by what the
// clamped counts exceed the estimates (D5, D11), with the usage view equal to
// what the callers received.
func TestLimitsHoldUnderConcurrency(t *testing.T) {
	t.Parallel()
	limits := []struct {
		name, flag string
		status     int
		code       string
	}{
		{"budget", "--budget-rungs", http.StatusPaymentRequired, "BUDGET_EXCEEDED"},
		{"daily", "--daily-rungs", http.StatusTooManyRequests, "RATE_LIMITED"},
	}
	for _, n := range []int{1, 3} {
		for _, limit := range limits {
			t.Run(fmt.Sprintf("%s/replicas=%d", limit.name, n), func(t *testing.T) {
				t.Parallel()
				if limit.name == "daily" {
					// The day's charges must all fall in one UTC day.
					if left := time.Until(time.Now().UTC().Truncate(24 * time.Hour).Add(24 * time.Hour)); left < 30*time.Second {
						time.Sleep(left + time.Second)
					}
				}
				b := setup(t)
				// Each request reserves its prompt estimate plus 1000 output rungs: the limit fits 10.
				prompt := "how many fit"
				mustCLI(t, b.db, "limits", "set", "--account", "acme", limit.flag, "10050")
				replicas := make([]*gateway, n)
				for i := range replicas {
					replicas[i] = serve(t, b.db, b.fake.BaseURL(), nil)
				}
				b.fake.SetDelay(3 * time.Second) // every admission happens before any settlement
				b.fake.SetHostile(prompt, fakeupstream.Hostile{Content: "answer", PromptTokens: 1 << 40, CompletionTokens: 1 << 40})

				var ok, refused, received atomic.Int64
				var wg sync.WaitGroup
				for i := range 200 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						r := replicas[i%n].call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt, "max_output_rungs": 1000})
						switch r.status {
						case http.StatusOK:
							ok.Add(1)
							received.Add(expect[api.Response](t, r, http.StatusOK).Usage.TotalRungs)
						case limit.status:
							refused.Add(1)
							require.Equal(t, limit.code, r.code(t))
						default:
							t.Errorf("unexpected status %d: %s", r.status, r.body)
						}
					}()
				}
				wg.Wait()
				require.Equal(t, int64(10), ok.Load())
				require.Equal(t, int64(190), refused.Load())
				v := replicas[0].usage(b.key)
				spent, limitRungs := v.Budget.SpentRungs, v.Daily.CeilingRungs
				if limit.name == "budget" {
					require.NotNil(t, v.Budget.CapRungs)
					limitRungs = *v.Budget.CapRungs
				}
				require.Equal(t, int64(10050), limitRungs)
				// Input is clamped to the bytes sent plus 16 per message: 28 here.
				require.LessOrEqual(t, spent, limitRungs+ok.Load()*28, "the limit, plus what the clamped counts exceed the estimates")
				require.Equal(t, received.Load(), v.Totals.TotalRungs)
				require.Equal(t, ok.Load(), v.Totals.Requests)
				require.Equal(t, v.Totals.TotalRungs, spent)
				require.Equal(t, v.Totals.TotalRungs, v.Daily.ChargedRungs)
			})
		}
	}
}

// TestRevokedKeyIsRefusedByEveryReplica: a key both replicas have cached is
// refused by both once it is revoked.
func TestRevokedKeyIsRefusedByEveryReplica(t *testing.T) {
	t.Parallel()
	b := setup(t)
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	for _, g := range replicas {
		require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/api/v1/usage", b.key, nil).status)
	}
	mustCLI(t, b.db, "keys", "revoke", b.key[:12])
	for _, g := range replicas {
		require.Eventually(t, func() bool {
			return g.call(http.MethodGet, "/api/v1/usage", b.key, nil).status == http.StatusUnauthorized
		}, 5*time.Second, 20*time.Millisecond, "a revoked key is refused")
	}
}

// TestRevokedAccountIsRefusedByEveryReplica: gateway keys revoke --account
// cuts a tenant off on every replica that has its keys cached, whatever
// their project; another tenant goes on.
func TestRevokedAccountIsRefusedByEveryReplica(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tenant := []string{
		strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "abuser")),
		strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "abuser", "--project", "web")),
	}
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	for _, g := range replicas {
		for _, key := range append([]string{b.key}, tenant...) {
			require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/api/v1/usage", key, nil).status)
		}
	}
	_, said, err := cliIn(t, t.TempDir(), map[string]string{"DATABASE_URL": b.db}, "keys", "revoke", "--account", "abuser")
	require.NoError(t, err, said)
	require.Equal(t, "revoked 2 active key(s)\n", said)
	for _, g := range replicas {
		for _, key := range tenant {
			require.Eventually(t, func() bool {
				return g.call(http.MethodGet, "/api/v1/usage", key, nil).status == http.StatusUnauthorized
			}, 5*time.Second, 20*time.Millisecond, "a revoked account's key is refused")
		}
		require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/api/v1/usage", b.key, nil).status, "another account's key")
	}

	for _, args := range [][]string{{}, {b.key[:12], "--account", "acme"}, {"--project", "default"}} {
		_, err = cli(t, b.db, append([]string{"keys", "revoke"}, args...)...)
		require.ErrorContains(t, err, "name a key (KEY_PREFIX_OR_ID) or an account", "%v", args)
	}
	_, err = cli(t, b.db, "keys", "revoke", "--account", "acme", "--project", "nowhere")
	require.ErrorContains(t, err, `no such project "nowhere" in account "acme"`)
}

// TestLoweredLimitsTakeEffectAtOnce: a daily ceiling or a project's budget
// lowered below what is spent refuses the next requests on every replica
// within moments, though each holds a slice of the old limit leased for
// longer.
func TestLoweredLimitsTakeEffectAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	replicas := []*gateway{serve(t, b.db, b.fake.BaseURL(), nil), serve(t, b.db, b.fake.BaseURL(), nil)}
	ask := func(g *gateway) reply {
		return g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "within limits", "max_output_rungs": 50})
	}
	for _, lowered := range []struct {
		name    string
		limit   []string // the arguments of `limits set` that name it
		code    string
		refused int
	}{
		{name: "the daily ceiling", limit: []string{"--daily-rungs"}, code: "RATE_LIMITED", refused: http.StatusTooManyRequests},
		{name: "the project's budget", limit: []string{"--project", "default", "--budget-rungs"}, code: "BUDGET_EXCEEDED", refused: http.StatusPaymentRequired},
	} {
		set := func(rungs string) {
			mustCLI(t, b.db, slices.Concat([]string{"limits", "set", "--account", "acme"}, lowered.limit, []string{rungs})...)
		}
		set("100000000")
		for _, g := range replicas {
			require.Equal(t, http.StatusOK, ask(g).status, "%s: served from a slice", lowered.name)
		}
		set("1")
		for _, g := range replicas {
			var r reply
			require.Eventually(t, func() bool {
				r = ask(g)
				return r.status != http.StatusOK
			}, 5*time.Second, 20*time.Millisecond, "%s lowered is the limit well within the slices' lease", lowered.name)
			require.Equal(t, lowered.refused, r.status, "%s: %s", lowered.name, r.body)
			require.Equal(t, lowered.code, r.code(t))
		}
		set("100000000")
	}
}

// TestKilledReplicasSlicesComeBack: a replica killed while it holds the whole
// budget in slices keeps it from the others only until its lease runs out;
// nothing it ran without answering is billed, and the usage view stays equal
// to what callers received.
func TestKilledReplicasSlicesComeBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--budget-rungs", "3015")
	env := map[string]string{"GATEWAY_LEASE": "2s"}
	victim := serve(t, b.db, b.fake.BaseURL(), env)
	b.fake.SetSlow("hold", time.Minute)
	for range 3 {
		go func() {
			// Never answered: the replica dies first.
			req, err := http.NewRequest(http.MethodPost, victim.base+"/api/v1/responses", strings.NewReader(`{"prompt": "hold the budget", "max_output_rungs": 1000}`))
			if err != nil {
				return
			}
			req.Header.Set("Authorization", "Bearer "+b.key)
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
				t.Errorf("the killed replica answered: %d", resp.StatusCode)
			}
		}()
	}
	require.Eventually(t, func() bool { return len(b.fake.Calls()) == 3 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, victim.cmd.Process.Kill())

	survivor := serve(t, b.db, b.fake.BaseURL(), env)
	r := survivor.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "now", "max_output_rungs": 1000})
	require.Equal(t, http.StatusPaymentRequired, r.status, "the dead replica's slices still hold the cap")
	require.Eventually(t, func() bool {
		r = survivor.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "now", "max_output_rungs": 1000})
		return r.status == http.StatusOK
	}, 20*time.Second, 100*time.Millisecond, "the slices come back once their lease runs out")
	served := expect[api.Response](t, r, http.StatusOK)
	v := survivor.usage(b.key)
	require.Equal(t, int64(1), v.Totals.Requests, "the killed replica's unanswered calls are not billed")
	require.Equal(t, served.Usage.TotalRungs, v.Totals.TotalRungs)
	require.Equal(t, served.Usage.TotalRungs, v.Budget.SpentRungs)
	require.Equal(t, served.Usage.TotalRungs, v.Daily.ChargedRungs)
}

func TestUsageViewEqualsReceivedUsage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	var want received
	want.add(rungs(expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "json reply", "model": "elements"}), http.StatusOK).Usage))

	r, _ := g.stream(b.key, map[string]any{"prompt": "a streamed reply"})
	want.add(finalUsage(t, r.body))

	b.fake.SetBreakAfter(2)
	r, _ = g.stream(b.key, map[string]any{"prompt": "this one breaks off midway"})
	want.add(finalUsage(t, r.body))
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

	// The operator's report for billing counts the same, line by line.
	day := func(d int) string { return time.Now().UTC().AddDate(0, 0, d).Format("2006-01-02") }
	rows, err := csv.NewReader(strings.NewReader(mustCLI(t, b.db, "usage", "--csv", "--from", day(-1), "--to", day(1)))).ReadAll()
	require.NoError(t, err)
	require.Equal(t, []string{"account", "project", "day", "model", "entry_point", "requests", "input_rungs", "output_rungs", "total_rungs"}, rows[0])
	var reported api.UsageTotals
	models := map[string]bool{}
	for _, row := range rows[1:] {
		require.Equal(t, "acme", row[0])
		models[row[3]] = true
		for i, sum := range []*int64{&reported.Requests, &reported.InputRungs, &reported.OutputRungs, &reported.TotalRungs} {
			n, err := strconv.ParseInt(row[5+i], 10, 64)
			require.NoError(t, err)
			*sum += n
		}
	}
	require.Equal(t, v.Totals, reported)
	require.Equal(t, map[string]bool{"elements": true, "instant": true}, models)
	_, err = cli(t, b.db, "usage", "--account", "acmee")
	require.ErrorContains(t, err, `no such account "acmee"`, "a misspelt account is not one that used nothing")
}

// TestUsagePastTheRetentionIsKeptInSums: requests past the request retention
// (90 days by default) are folded into their days' sums by a replica's
// maintenance: the operator's report says what it said, and the usage view
// over whole hours the same; an end inside an hour that old is refused with
// 400 INVALID_REQUEST. Time passes by moving the requests served, and their
// sums by minute, 100 days back, while no replica runs.
func TestUsagePastTheRetentionIsKeptInSums(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	for i := range 5 {
		r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": fmt.Sprintf("question %d", i), "model": []string{"instant", "reasoning"}[i%2]})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
	}
	require.NoError(t, g.stop())
	pool := testdb.Connect(t, b.db)
	for _, statement := range []string{
		`UPDATE requests SET created_at = created_at - interval '100 days', completed_at = completed_at - interval '100 days'`,
		`UPDATE usage_minutes SET minute = minute - interval '100 days'`,
	} {
		_, err := pool.Exec(context.Background(), statement)
		require.NoError(t, err)
	}
	then := time.Now().UTC().AddDate(0, 0, -100)
	report := func() string {
		day := func(t time.Time, d int) string { return t.AddDate(0, 0, d).Format("2006-01-02") }
		return mustCLI(t, b.db, "usage", "--csv", "--from", day(then, -1), "--to", day(then, 1))
	}
	before := report()
	rows, err := csv.NewReader(strings.NewReader(before)).ReadAll()
	require.NoError(t, err)
	var reported api.UsageTotals
	for _, row := range rows[1:] {
		for i, sum := range []*int64{&reported.Requests, &reported.InputRungs, &reported.OutputRungs, &reported.TotalRungs} {
			n, err := strconv.ParseInt(row[5+i], 10, 64)
			require.NoError(t, err)
			*sum += n
		}
	}
	require.Equal(t, int64(5), reported.Requests, before)

	g = serve(t, b.db, b.fake.BaseURL(), nil)
	require.Eventually(t, func() bool {
		var left int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM requests`).Scan(&left))
		return left == 0
	}, 20*time.Second, 100*time.Millisecond, "the replica folds the old requests into their days")
	require.Equal(t, before, report())
	period := "/api/v1/usage?" + url.Values{
		"start": {then.Truncate(time.Hour).Add(-24 * time.Hour).Format(time.RFC3339)},
		"end":   {then.Truncate(time.Hour).Add(24 * time.Hour).Format(time.RFC3339)},
	}.Encode()
	v := expect[api.UsageView](t, g.call(http.MethodGet, period, b.key, nil), http.StatusOK)
	require.Equal(t, reported, v.Totals, "the view over whole hours, from their sums")

	inside := "/api/v1/usage?" + url.Values{"start": {then.Truncate(time.Hour).Add(-90 * time.Minute).Format(time.RFC3339)}}.Encode()
	r := g.call(http.MethodGet, inside, b.key, nil)
	require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
	require.Equal(t, "INVALID_REQUEST", r.code(t))
	require.Contains(t, string(r.body), "usage older than 90 days (the request retention) is kept by the hour")
}
