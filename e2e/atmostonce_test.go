package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/blackhole"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/pglocal"
)

// atMostOnce fails t when a prompt with prefix reached the upstream more than once.
func atMostOnce(t *testing.T, f *fakeupstream.Server, prefix string) {
	t.Helper()
	for p, n := range callsPerPrompt(f) {
		if strings.HasPrefix(p, prefix) {
			require.LessOrEqual(t, n, 1, "prompt %q reached the upstream %d times", p, n)
		}
	}
}

// TestDispatchedItemsAreNeverRetried pins D12: a timeout or a 5xx after the
// request was written fails the item INFERENCE_BUSY, once.
func TestDispatchedItemsAreNeverRetried(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetSlow("slow", 1500*time.Millisecond)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_UPSTREAM_TIMEOUT": "1s"})
	slow := g.createBatch(b.key, prompts("slow", 3))
	res := g.waitTerminal(b.key, slow.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("failed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), it.Error.Code)
		require.Equal(t, api.RungUsage{}, it.Usage)
	}

	b.fake.SetStatus(http.StatusBadGateway)
	broken := g.createBatch(b.key, prompts("badgateway", 3))
	res = g.waitTerminal(b.key, broken.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("failed"), res.Status)
	time.Sleep(2 * time.Second) // a retry would show by now
	for _, prefix := range []string{"slow", "badgateway"} {
		atMostOnce(t, b.fake, prefix)
	}
	require.Len(t, b.fake.Calls(), 6, "each prompt exactly once")
	settledExactly(t, g, b.key, received{})
}

// TestCancelDuringAnOutage pins D12: an item handed back while its batch is
// being cancelled ends cancelled, and no item of a cancelling or cancelled
// batch is claimed again, even once the upstream is back.
func TestCancelDuringAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetMode(fakeupstream.Down)
	b.fake.SetDelay(2 * time.Second)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	batch := g.createBatch(b.key, prompts("cancelme", 5))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 1 }, 10*time.Second, 10*time.Millisecond, "a probe is out")
	r := g.call(http.MethodPost, "/api/v1/batch/"+batch.Id.String()+"/cancel", b.key, nil)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("cancelled"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("cancelled"), it.Status)
	}
	before := len(b.fake.Calls())
	b.fake.SetMode(fakeupstream.OK)
	b.fake.SetDelay(0)
	time.Sleep(3 * time.Second)
	require.Equal(t, before, len(b.fake.Calls()), "nothing of a cancelled batch runs after the outage")
	require.Equal(t, res, g.results(b.key, batch.Id.String()))
	settledExactly(t, g, b.key, received{})
}

// TestBatchStaysQueuedUntilDispatched: while the upstream refuses connections
// no item is dispatched, so the batch stays queued (interface 3.1), and a
// cancel leaves no item queued or running.
func TestBatchStaysQueuedUntilDispatched(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	refused := "http://" + l.Addr().String() + "/v1"
	require.NoError(t, l.Close())
	g := serve(t, b.db, refused, nil)
	batch := g.createBatch(b.key, prompts("refused", 4))
	time.Sleep(2 * time.Second) // several probes
	res := g.results(b.key, batch.Id.String())
	require.Equal(t, api.BatchStatus("queued"), res.Status)
	r := g.call(http.MethodPost, "/api/v1/batch/"+batch.Id.String()+"/cancel", b.key, nil)
	require.Equal(t, http.StatusOK, r.status)
	res = g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("cancelled"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("cancelled"), it.Status)
	}
}

// TestShutdownPastGraceRunsNothingTwice pins D12: items still running when the
// grace ends are INTERRUPTED, not handed to another replica, and every open
// stream ends with response.error then response.completed carrying what was
// billed; the usage view equals what clients were sent.
func TestShutdownPastGraceRunsNothingTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--project", "default", "--budget-rungs", "100000000")
	b.fake.SetSlow("long", 6*time.Second)
	b.fake.SetChunkDelay(700 * time.Millisecond)
	env := map[string]string{"GATEWAY_SHUTDOWN_GRACE": "1s", "GATEWAY_DRAIN_CONCURRENCY": "8", "GATEWAY_LEASE": "3s"}
	victim := serve(t, b.db, b.fake.BaseURL(), env)
	batch := victim.createBatch(b.key, prompts("long", 6))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 6 }, 10*time.Second, 10*time.Millisecond, "all in flight at the victim")

	var wg sync.WaitGroup
	bodies := make([][]byte, 3)
	for i := range bodies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			bodies[i] = streamUntilEnd(t, victim, b.key, fmt.Sprintf("a stream that takes its time %d", i))
		}()
	}
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 9 }, 10*time.Second, 10*time.Millisecond)
	time.Sleep(time.Second) // some output is out
	survivor := serve(t, b.db, b.fake.BaseURL(), env)
	require.NoError(t, victim.stop())
	wg.Wait()

	var want received
	for _, body := range bodies {
		events := string(body)
		require.Contains(t, events, "event: response.error", "a stream cut by the shutdown says so")
		require.Contains(t, events, "INFERENCE_BUSY")
		require.Less(t, strings.Index(events, "event: response.error"), strings.Index(events, "event: response.completed"))
		want.add(finalUsage(t, body))
	}
	res := survivor.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("failed"), it.Status)
		require.Equal(t, api.ErrorCode("INTERRUPTED"), it.Error.Code)
	}
	time.Sleep(2 * time.Second)
	atMostOnce(t, b.fake, "long")
	settledExactly(t, survivor, b.key, want)
}

// streamUntilEnd posts a streamed request and reads its reply to the end.
func streamUntilEnd(t *testing.T, g *gateway, key, prompt string) []byte {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, g.base+"/api/v1/responses", strings.NewReader(fmt.Sprintf(`{"prompt": %q, "stream": true}`, prompt)))
	if err != nil {
		return nil
	}
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := g.httpClient().Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var out strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
	}
	return []byte(out.String())
}

// streamsUntilEnd starts n streams of prompt on g; wait returns their bodies
// once every one has ended.
func streamsUntilEnd(t *testing.T, g *gateway, key, prompt string, n int) (wait func() [][]byte) {
	bodies := make([][]byte, n)
	var wg sync.WaitGroup
	for i := range bodies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			bodies[i] = streamUntilEnd(t, g, key, prompt)
		}()
	}
	return func() [][]byte {
		wg.Wait()
		return bodies
	}
}

// TestAReplicaStartedWhileItsDatabaseIsAwayServesOnceItIsBack: a replica
// started while its database is down (a deploy during a database's restart)
// waits for it, saying so, and serves once it is back, instead of exiting
// into its supervisor's back-off.
func TestAReplicaStartedWhileItsDatabaseIsAwayServesOnceItIsBack(t *testing.T) {
	t.Parallel()
	cluster, dir := ownCluster(t, false)
	key := strings.TrimSpace(mustCLI(t, cluster.URL("gw"), "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	require.NoError(t, cluster.Stop())
	restarted := make(chan error, 1)
	go func() {
		time.Sleep(3 * time.Second) // the replica finds it away meanwhile
		// Stopped with the test (ownCluster).
		_, err := pglocal.Start(context.Background(), pglocal.Options{Dir: dir, Port: cluster.Port()})
		restarted <- err
	}()
	g := serve(t, cluster.URL("gw"), fake.BaseURL(), nil) // waits until it is ready
	require.NoError(t, <-restarted)
	require.Contains(t, g.stderr.String(), "the database is away at the start: waiting for it")
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "served"}).status)
}

// TestAReplicaDoesNotWaitForADatabaseThatRefusesIt: a database that refuses
// the connection's settings (here, a database name it does not have) stops
// a replica's start at once, with the server's word, not after the wait for
// a database away.
func TestAReplicaDoesNotWaitForADatabaseThatRefusesIt(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testdb.EmptyURL(t))
	require.NoError(t, err)
	u.Path = "/no_such_database"
	_, stderr, err := cliIn(t, "", map[string]string{"DATABASE_URL": u.String(), "GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_METRICS_LISTEN": "off"}, "serve")
	require.Error(t, err)
	require.Contains(t, stderr, `database "no_such_database" does not exist`)
	require.NotContains(t, stderr, "the database is away", "no try was made again")
}

// TestAReplicaAskedToStopWhileItWaitsForItsDatabaseStops: SIGTERM during
// the start's wait for a database away ends the replica at once, with a
// clean exit: a stop asked for, not a failure for its supervisor to count.
func TestAReplicaAskedToStopWhileItWaitsForItsDatabaseStops(t *testing.T) {
	t.Parallel()
	g := spawn(t, false, map[string]string{
		"DATABASE_URL":   "postgres://gateway@127.0.0.1:1/gateway?sslmode=disable", // nothing listens
		"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_METRICS_LISTEN": "off",
	}, "serve")
	waitForLine(t, g.stderr, "the database is away at the start: waiting for it")
	require.NoError(t, g.stop(), "a clean exit: %s", g.stderr.String())
	require.Contains(t, g.stderr.String(), `"msg":"asked to stop while opening the database at the start: stopped"`)
}

// TestAReplicaWhoseDatabaseStaysAwayExitsAfterItsWait: the start's wait
// for a database away is GATEWAY_DB_START_WAIT; past it the replica exits,
// naming it, with the last connection's error; the waits meanwhile are
// logged, each with its length; with 0 no try is made again. gateway dev
// given a DATABASE_URL waits for it alike.
func TestAReplicaWhoseDatabaseStaysAwayExitsAfterItsWait(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		command string
		wait    string
		waiting bool
	}{{"serve", "1s", true}, {"serve", "0s", false}, {"dev", "1s", true}} {
		_, stderr, err := cliIn(t, t.TempDir(), map[string]string{
			"DATABASE_URL":   "postgres://gateway@127.0.0.1:1/gateway?sslmode=disable", // nothing listens
			"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_METRICS_LISTEN": "off", "GATEWAY_DB_START_WAIT": c.wait,
		}, c.command)
		require.Error(t, err, "%s %s", c.command, c.wait)
		require.Contains(t, stderr, "gateway: the database stayed away for the start's wait, "+c.wait+" (GATEWAY_DB_START_WAIT): ", "%s %s", c.command, c.wait)
		require.Contains(t, stderr, "connection refused", "%s %s", c.command, c.wait)
		waits := strings.Count(stderr, `"msg":"the database is away at the start: waiting for it"`)
		if !c.waiting {
			require.Zero(t, waits, stderr)
			continue
		}
		require.Positive(t, waits, stderr)
		require.Contains(t, stderr, `"retry_in":"100ms","wait":"1s"`)
	}
}

// TestDatabaseRestartIsServiceUnavailable pins D12: while PostgreSQL restarts,
// requests get 503 SERVICE_UNAVAILABLE with Retry-After, never 500, and the
// gateway serves again once it is back. The error line of each refusal is
// sampled: fewer lines than refusals are written, and those written with
// their counts of the lines left out account for every refusal. The
// replica's metrics say it hears no notifications while the database is
// away, and that it does again once it is back. The loops that retry
// meanwhile (the listeners, the claims, the maintenance jobs) log the
// outage's beginning and its end, not each try.
func TestDatabaseRestartIsServiceUnavailable(t *testing.T) {
	t.Parallel()
	cluster, dir, key, g := ownGateway(t)
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "before"}).status)

	require.NoError(t, cluster.Stop())
	refused := 0
	for range logsample.Burst {
		r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "during"})
		require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
		require.Equal(t, "SERVICE_UNAVAILABLE", r.code(t))
		require.NotEmpty(t, r.header.Get("Retry-After"))
		r = g.call(http.MethodGet, "/api/v1/usage", key, nil)
		require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
		refused += 2
	}
	listening := func(on int) string { return fmt.Sprintf(`gateway_notifications_listening{listener="keys"} %d`, on) }
	require.Contains(t, g.scrape(), listening(0), "the replica says it hears no notifications")
	// Long enough for the loops that retry to have failed a few times.
	require.Eventually(t, func() bool {
		return metricValue(t, g.scrape(), `gateway_maintenance_failures_total{task="reconcile settlements"}`) >= 5
	}, 30*time.Second, 50*time.Millisecond)
	_, err := pglocal.Start(context.Background(), pglocal.Options{Dir: dir, Port: cluster.Port()}) // stopped with the test (ownCluster)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		status := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "after"}).status
		if status == http.StatusServiceUnavailable {
			refused++
		}
		return status == http.StatusOK
	}, 30*time.Second, 200*time.Millisecond)
	require.Eventually(t, func() bool { return strings.Contains(g.scrape(), listening(1)) }, 10*time.Second, 100*time.Millisecond)
	require.Positive(t, g.usage(key).Totals.Requests)

	// The loops that retried see the database back at their next try.
	resumed := []string{
		`"msg":"key change notifications resumed"`,
		`"msg":"batch notifications resumed"`,
		`"msg":"maintenance job runs again","job":"reconcile settlements"`,
	}
	require.Eventually(t, func() bool {
		logged := g.stderr.String()
		for _, msg := range resumed {
			if !strings.Contains(logged, msg) {
				return false
			}
		}
		return true
	}, 30*time.Second, 100*time.Millisecond, "every loop that retried runs again")

	require.NoError(t, g.stop()) // writes the counts of the windows still open
	lines, counted := 0, 0
	for _, line := range strings.Split(g.stderr.String(), "\n") {
		var entry struct {
			Msg        string `json:"msg"`
			Suppressed int    `json:"suppressed"`
		}
		if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "request failed" {
			lines++
			counted += max(entry.Suppressed, 1) // a line with a count is one of those it counts
		}
	}
	require.Less(t, lines, refused, "the refusals' error lines are sampled")
	require.Equal(t, refused, counted, "every refusal is written or counted")

	// The loops that retried wrote the outage's beginning (its first
	// failure, and its second when that one's error differs) and its end,
	// not a line a try.
	logged := g.stderr.String()
	for _, msg := range []string{
		`"msg":"key change notifications interrupted; authenticating every request against the database until they resume"`,
		`"msg":"batch notifications interrupted; polling until they resume"`,
		`"msg":"maintenance job failed","job":"reconcile settlements"`,
	} {
		require.Contains(t, logged, msg)
		require.LessOrEqual(t, strings.Count(logged, msg), 2, msg)
	}
	for _, msg := range resumed {
		require.Equal(t, 1, strings.Count(logged, msg), msg)
	}
	require.LessOrEqual(t, strings.Count(logged, `"msg":"error claiming batch items"`), 2)
}

// ownCluster starts a PostgreSQL of the test's own, with a migrated database
// "gw", to stop, crash or freeze (durable: a crash loses no commit); dir, its
// folder, starts it again. It is thawed and stopped when the test ends.
func ownCluster(t *testing.T, durable bool) (cluster *pglocal.Cluster, dir string) {
	t.Helper()
	parent, err := os.MkdirTemp("", "gateway-pg-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(parent) })
	require.NoError(t, os.Chmod(parent, 0o755)) // the postgres user enters it when the tests run as root
	dir = filepath.Join(parent, "pg")
	cluster, err = pglocal.Start(context.Background(), pglocal.Options{Dir: dir, Durable: durable})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Thaw() // the cluster running now, restarted or not, is the one in dir
		_ = cluster.Stop()
	})
	require.NoError(t, cluster.CreateDatabase(context.Background(), "gw"))
	mustCLI(t, cluster.URL("gw"), "migrate")
	return cluster, dir
}

// ownGateway serves one replica, with a fake upstream, on an ownCluster (not
// durable), and returns a key of account acme.
func ownGateway(t *testing.T) (cluster *pglocal.Cluster, dir, key string, g *gateway) {
	t.Helper()
	cluster, dir = ownCluster(t, false)
	key = strings.TrimSpace(mustCLI(t, cluster.URL("gw"), "keys", "create", "--account", "acme"))
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	return cluster, dir, key, serve(t, cluster.URL("gw"), fake.BaseURL(), nil)
}

// TestADatabaseThatDoesNotAnswerIsServiceUnavailable pins D12 when
// PostgreSQL hangs (frozen: its connections accepted and never answered, as
// behind a network that drops its packets): every request is answered while
// it hangs, none held for as long as it does: 503 SERVICE_UNAVAILABLE with
// Retry-After (an unknown key's lookup, reads, a batch's creation, the
// readiness probe) or, for a response admitted from the replica's slices,
// its reply with its usage, stored once the database answers. Then what was
// sent is what is billed, and the batch sent again with its Idempotency-Key
// exists once.
func TestADatabaseThatDoesNotAnswerIsServiceUnavailable(t *testing.T) {
	t.Parallel()
	cluster, _, key, g := ownGateway(t)
	unknown := strings.TrimSpace(mustCLI(t, cluster.URL("gw"), "keys", "create", "--account", "acme")) // first used while the database hangs
	before := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "before"}), http.StatusOK)

	require.NoError(t, cluster.Freeze())
	batch := map[string]any{"requests": []map[string]any{{"prompt": "a batch sent while the database hangs"}}}
	idempotency := http.Header{"Idempotency-Key": {"frozen-1"}}
	type call struct {
		method, path, key string
		body              any
		header            http.Header
	}
	// The batch reads name an id that is no batch's (404 once the database
	// answers): they read the database all the same.
	calls := []call{
		{http.MethodGet, "/readyz", "", nil, nil},
		{http.MethodGet, "/api/v1/usage", key, nil, nil},
		{http.MethodGet, "/api/v1/usage", unknown, nil, nil},
		{http.MethodGet, "/api/v1/batches", key, nil, nil},
		{http.MethodGet, "/api/v1/batch/" + before.RequestId.String(), key, nil, nil},
		{http.MethodGet, "/api/v1/batch/" + before.RequestId.String() + "/results", key, nil, nil},
		{http.MethodGet, "/api/v1/sources/" + before.RequestId.String(), key, nil, nil},
		{http.MethodPost, "/api/v1/batch", key, batch, idempotency},
	}
	for i := range 4 {
		calls = append(calls, call{http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": fmt.Sprintf("during %d", i)}, nil})
	}
	type answer struct {
		call
		r reply
	}
	answers := make(chan answer, len(calls))
	for _, c := range calls {
		go func() { answers <- answer{c, g.callWith(c.method, c.path, c.key, c.body, c.header)} }()
	}
	var served, sent int64 // responses answered with their usage, and its rungs
	held := time.After(90 * time.Second)
	for range calls {
		var a answer
		select {
		case a = <-answers:
		case <-held:
			t.Fatal("a request is held by the database that does not answer")
		}
		what := a.method + " " + a.path
		if a.r.status == http.StatusOK && a.path == "/api/v1/responses" {
			res := expect[api.Response](t, a.r, http.StatusOK)
			served++
			sent += res.Usage.TotalRungs
			continue
		}
		require.Equal(t, http.StatusServiceUnavailable, a.r.status, "%s: %s", what, a.r.body)
		if a.path == "/readyz" {
			continue
		}
		require.Equal(t, "SERVICE_UNAVAILABLE", a.r.code(t), what)
		require.NotEmpty(t, a.r.header.Get("Retry-After"), what)
	}

	require.NoError(t, cluster.Thaw())
	var resent reply
	require.Eventually(t, func() bool {
		resent = g.callWith(http.MethodPost, "/api/v1/batch", key, batch, idempotency)
		return resent.status == http.StatusOK || resent.status == http.StatusAccepted
	}, 30*time.Second, 200*time.Millisecond)
	results := g.waitTerminal(key, resent.object(t)["id"].(string), 60*time.Second)
	require.Equal(t, api.BatchStatusCompleted, results.Status)
	list := g.call(http.MethodGet, "/api/v1/batches", key, nil)
	require.Len(t, list.object(t)["data"], 1, "the batch exists once")
	item := results.Results[0].Usage
	var v api.UsageView
	require.Eventually(t, func() bool {
		v = g.usage(key)
		return v.Totals.Requests == 2+served
	}, 30*time.Second, 200*time.Millisecond, "the responses sent with their usage are stored")
	require.Equal(t, before.Usage.TotalRungs+sent+item.TotalRungs, v.Totals.TotalRungs, "billed is what was sent")
	require.Zero(t, v.Budget.ReservedRungs)
}

// TestConnectionsTheNetworkLostAreReplaced: when the network loses the
// replica's connections to PostgreSQL without closing them (a NAT or
// firewall that forgot them, an address a failover moved), the replica
// notices within seconds and goes on with new ones: a key revoked meanwhile,
// whose notification the lost listening connection never delivers, is
// refused long before the cache's TTL (30 s) would have refused it, and
// requests and batches go on being served.
func TestConnectionsTheNetworkLostAreReplaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, proxy := testdb.Cuttable(t, b.db) // the replica's URL is the pool's, through the proxy
	g := serve(t, pool.Config().ConnString(), b.fake.BaseURL(), nil)
	victim := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "other"))
	for i := range 10 {
		require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": fmt.Sprint("before ", i)}).status)
	}
	require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/api/v1/usage", victim, nil).status, "the victim's key is cached")

	// The replica notices within 3 s; a transaction the loss caught holds
	// its row locks until the server ends it (store.IdleTransactionTimeout,
	// 10 s), and a call waiting on them fails after 5 s. The cache's TTL
	// would refuse the key only 30 s after it was cached.
	const lostWithin = 20 * time.Second
	require.Positive(t, proxy.Cut())
	mustCLI(t, b.db, "keys", "revoke", "--account", "other")
	require.Eventually(t, func() bool {
		return g.call(http.MethodGet, "/api/v1/usage", victim, nil).status == http.StatusUnauthorized
	}, lostWithin, 100*time.Millisecond, "the revoked key is refused")

	var r reply
	require.Eventually(t, func() bool {
		r = g.call(http.MethodPost, "/api/v1/batch", b.key, map[string]any{"requests": prompts("after", 3)})
		return r.status == http.StatusAccepted
	}, lostWithin, 100*time.Millisecond, "batches are taken")
	res := g.waitTerminal(b.key, r.object(t)["id"].(string), 30*time.Second)
	require.Equal(t, api.BatchStatusCompleted, res.Status)
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "after"}).status)
}

// TestProviderConnectionsTheNetworkLostAreReplaced loses the replica's
// HTTP/2 connection to its provider with a batch item's call on it: a ping
// goes unanswered, the connection is closed, the item fails after dispatch
// (never sent again, D12; billed nothing), and the next call goes on a new
// connection. Without the ping, the item and every call after it wait on
// the lost connection for the provider's timeout (a minute here).
func TestProviderConnectionsTheNetworkLostAreReplaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy, err := tcpproxy.Start(b.fake.Listener.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	file := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(`providers:
  up: {base_url: "http://%s/v1", timeout: 1m, h2c: true, ping_after: 200ms}
models:
  instant: {targets: [up/instant]}
`, proxy.Addr())), 0o600))
	g := start(t, map[string]string{"DATABASE_URL": b.db, "GATEWAY_CONFIG": file}, "serve")
	var want received
	respond := func(prompt string) {
		res := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt}), http.StatusOK)
		want.add(rungs(res.Usage))
	}
	respond("before")

	b.fake.SetSlow("lost", 3*time.Second) // its reply is sent after the loss, and lost
	batch := g.createBatch(b.key, prompts("lost", 1))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) == 2 }, 10*time.Second, 10*time.Millisecond, "the item's call is out")
	require.Equal(t, 1, proxy.Cut(), "the connection the calls share")
	res := g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchStatus("failed"), res.Status)
	require.Equal(t, api.ErrorCode("INFERENCE_BUSY"), res.Results[0].Error.Code)
	require.Equal(t, api.RungUsage{}, res.Results[0].Usage)

	respond("after")
	require.Equal(t, 2, b.fake.Connections(), "the next call went on a new connection")
	atMostOnce(t, b.fake, "lost")
	settledExactly(t, g, b.key, want)
}

// TestClientsTheNetworkLostAreLetGo loses the network to two clients (every
// packet the replica sends them dropped, probes included) while a JSON reply
// and a stream wait for their upstream calls: the replica finds each
// connection lost some 25 s after its client went silent or stopped
// acknowledging (lostpeer: keepalives for the JSON reply, which sends
// nothing while it waits; for the stream, its keep-alive events, sent
// every 15 s, left unacknowledged) and ends its upstream call, as when a
// client leaves.
// With Go's defaults the first took 2.5 minutes, and the second the
// kernel's retransmissions, some 15.
func TestClientsTheNetworkLostAreLetGo(t *testing.T) {
	t.Parallel()
	hole := blackhole.New(t)
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	b.fake.SetSlow("held", 10*time.Minute)
	client := &http.Client{Transport: &http.Transport{
		DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(hole.Addr())}}).DialContext,
	}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	for _, stream := range []bool{false, true} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/api/v1/responses",
			strings.NewReader(fmt.Sprintf(`{"prompt":"held %v","stream":%v}`, stream, stream)))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+b.key)
		req.Header.Set("Content-Type", "application/json")
		go func() {
			if resp, err := client.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		}()
	}
	require.Eventually(t, func() bool { return b.fake.InFlight() == 2 }, 10*time.Second, 10*time.Millisecond, "both calls are out")
	hole.Drop()
	require.Eventually(t, func() bool { return b.fake.InFlight() == 0 }, 90*time.Second, 100*time.Millisecond, "the replica ended both calls")
}
