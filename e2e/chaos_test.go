package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/pglocal"
)

// replicaPool is the replicas a chaos run sends its load to, changed as it
// kills and restarts them.
type replicaPool struct {
	mu       sync.Mutex
	replicas []*gateway
	all      []*gateway // every replica ever started, for their logs
}

// pick is a replica at random.
func (p *replicaPool) pick() *gateway {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.replicas[rand.IntN(len(p.replicas))]
}

// replace puts g in the place of the i-th replica.
func (p *replicaPool) replace(i int, g *gateway) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.replicas[i] = g
}

// ledger is what one account's clients saw during a chaos run.
type ledger struct {
	account  string
	mu       sync.Mutex
	received received
	lost     int               // requests whose reply a client never had whole (a batch's items each)
	batches  map[string]string // id → the prefix of its items' prompts
	// unanswered is the batches created five times over without an
	// answer: each may be stored, once.
	unanswered int
	statuses   map[string]int
}

// note counts a call's outcome, the usage a client received, the requests
// whose replies were lost, and a batch created (its id and prefix).
func (l *ledger) note(status string, u *api.RungUsage, lost int, batch ...string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.statuses[status]++
	if u != nil {
		l.received.add(*u)
	}
	l.lost += lost
	if len(batch) == 2 {
		l.batches[batch[0]] = batch[1]
	}
}

var chaosSeq atomic.Int64

// post sends body (nil: none) to a random replica's path with key and the
// extra header's names and values, for as long as ctx lasts.
func post(ctx context.Context, client *http.Client, pool *replicaPool, path, key string, body any, header ...string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, pool.pick().base+path, nil)
	if err != nil {
		return nil, err
	}
	if body != nil {
		raw, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(raw)), int64(len(raw))
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "Bearer "+key)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return client.Do(req)
}

// chaosCall sends one random request of the load to a random replica and
// notes what came back: a JSON reply, a stream, or a batch. A tenth of the
// JSON requests are given up within 100 ms, and a fifth of the streams
// after their first event: their replies are lost.
func chaosCall(client *http.Client, pool *replicaPool, key string, l *ledger) {
	n := chaosSeq.Add(1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	kind := rand.IntN(10)
	switch {
	case kind >= 8:
		chaosBatch(client, pool, key, l, n)
		return
	case kind >= 4:
		stream := map[string]any{"prompt": fmt.Sprintf("chaos stream %d", n), "max_output_rungs": 200, "stream": true}
		resp, err := post(ctx, client, pool, "/api/v1/responses", key, stream)
		if err != nil {
			l.note("transport", nil, 1)
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			all, _ := io.ReadAll(resp.Body)
			l.note(fmt.Sprintf("stream %d %s", resp.StatusCode, errorCode(all)), nil, 0)
			return
		}
		if rand.IntN(5) == 0 {
			for sc := bufio.NewScanner(resp.Body); sc.Scan(); {
				if strings.HasPrefix(sc.Text(), "data: ") {
					break
				}
			}
			cancel()
			l.note("stream left", nil, 1)
			return
		}
		usage, failed, err := streamOutcome(resp)
		switch {
		case usage != nil:
			l.note("stream completed", usage, 0)
		case err != nil:
			l.note("stream cut", nil, 1)
		default:
			l.note("stream error "+failed, nil, 0)
		}
		return
	case kind == 0:
		time.AfterFunc(time.Duration(rand.IntN(100))*time.Millisecond, cancel)
	}
	usage, status := jsonCall(ctx, client, pool, key, fmt.Sprintf("chaos json %d", n))
	switch {
	case usage != nil:
		l.note("json "+status, usage, 0)
	case status == "lost" && ctx.Err() != nil:
		l.note("json left", nil, 1)
	default:
		l.note("json "+status, nil, lostOf(status))
	}
}

// lostOf is the requests whose replies were lost of a call that ended so
// (jsonCall).
func lostOf(status string) int {
	if status == "lost" {
		return 1
	}
	return 0
}

// jsonCall sends a JSON request of prompt with key to a random replica and
// says how it ended: the usage of a reply served, and its status with the
// code of an error ("503 SERVICE_UNAVAILABLE"), or "lost" when the reply
// never came whole.
func jsonCall(ctx context.Context, client *http.Client, pool *replicaPool, key, prompt string) (*api.RungUsage, string) {
	resp, err := post(ctx, client, pool, "/api/v1/responses", key, map[string]any{"prompt": prompt, "max_output_rungs": 200})
	if err != nil {
		return nil, "lost"
	}
	defer resp.Body.Close()
	all, err := io.ReadAll(resp.Body)
	var r api.Response
	switch {
	case err != nil:
		return nil, "lost"
	case resp.StatusCode == http.StatusOK && json.Unmarshal(all, &r) == nil:
		u := rungs(r.Usage)
		return &u, "200"
	}
	return nil, fmt.Sprintf("%d %s", resp.StatusCode, errorCode(all))
}

// chaosBatch creates a batch of 1–20 items with an Idempotency-Key, sent
// again (to any replica) while its reply is lost or says the database is
// away, up to five times; a fifth of the batches created are cancelled at
// once.
func chaosBatch(client *http.Client, pool *replicaPool, key string, l *ledger, n int64) {
	prefix := fmt.Sprintf("chaos batch %d", n)
	reqs := prompts(prefix, 1+rand.IntN(20))
	for _, r := range reqs {
		r["max_output_rungs"] = 200
	}
	outcome := ""
	for range 5 {
		resp, err := post(context.Background(), client, pool, "/api/v1/batch", key, map[string]any{"requests": reqs}, "Idempotency-Key", strings.ReplaceAll(prefix, " ", "-"))
		if err != nil {
			outcome = "transport"
			time.Sleep(300 * time.Millisecond)
			continue
		}
		all, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		var b api.Batch
		switch {
		case err != nil:
			outcome = "cut"
		case resp.StatusCode == http.StatusServiceUnavailable:
			outcome = "503 " + errorCode(all)
		case (resp.StatusCode == http.StatusAccepted || resp.StatusCode == http.StatusOK) && json.Unmarshal(all, &b) == nil:
			l.note(fmt.Sprintf("batch %d", resp.StatusCode), nil, 0, b.Id.String(), prefix)
			if rand.IntN(5) == 0 {
				if r, err := post(context.Background(), client, pool, "/api/v1/batch/"+b.Id.String()+"/cancel", key, nil); err == nil {
					r.Body.Close()
				}
			}
			return
		default:
			l.note(fmt.Sprintf("batch %d %s", resp.StatusCode, errorCode(all)), nil, 0)
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
	l.note("batch unanswered, last "+outcome, nil, len(reqs))
	l.mu.Lock()
	defer l.mu.Unlock()
	l.unanswered++
}

// errorCode is the code of an error envelope, or "".
func errorCode(body []byte) string {
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	return e.Error.Code
}

// streamOutcome reads a stream to its end: the usage of its
// response.completed, or the code of its response.error when none came, or
// the error that cut it.
func streamOutcome(resp *http.Response) (*api.RungUsage, string, error) {
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	var failed string
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var c struct {
			api.StreamChunk
			Error *struct{ Code string } `json:"error"`
		}
		if json.Unmarshal([]byte(line), &c) != nil {
			continue
		}
		if c.Error != nil {
			failed = c.Error.Code
		}
		if c.Done && c.Usage != nil {
			return c.Usage, failed, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, failed, err
	}
	if failed == "" {
		return nil, "", fmt.Errorf("the stream ended with neither response.completed nor response.error")
	}
	return nil, failed, nil
}

// checker reads an account's batches and usage after a chaos run, with
// keys of its own (the load's may be at their rate limit), a fresh one every
// 500 requests, under the rate limit however many batches there are.
type checker struct {
	t           *testing.T
	db, account string
	current     string
	used        int
}

// key is the key for the next request.
func (c *checker) key() string {
	if c.used%500 == 0 {
		c.current = strings.TrimSpace(mustCLI(c.t, c.db, "keys", "create", "--account", c.account))
	}
	c.used++
	return c.current
}

// doomedKey is a key of acme's that a chaos run revokes midway, and the
// JSON requests sent with it: none that starts a second after the
// revocation may be served, by any replica.
type doomedKey struct {
	key       string
	revokedAt time.Time // set before the requests stop, read after
	// served is when each request served started, the caller's until the
	// requests stop.
	served []time.Time
}

// call sends JSON requests with the key until stop, noting them in l and
// when each served one started.
func (d *doomedKey) call(client *http.Client, pool *replicaPool, l *ledger, stop chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-time.After(time.Duration(100+rand.IntN(200)) * time.Millisecond):
		}
		started := time.Now()
		usage, status := jsonCall(context.Background(), client, pool, d.key, fmt.Sprintf("chaos doomed %d", chaosSeq.Add(1)))
		l.note("doomed "+status, usage, lostOf(status))
		if usage != nil {
			d.served = append(d.served, started)
		}
	}
}

// revoke revokes the key, trying again while the database is starting up.
func (d *doomedKey) revoke(t *testing.T, db string) {
	for attempt := 0; ; attempt++ {
		_, err := cli(t, db, "keys", "revoke", d.key[:12])
		if err == nil {
			d.revokedAt = time.Now()
			return
		}
		require.Less(t, attempt, 50, "revoking the key: %v", err)
		time.Sleep(200 * time.Millisecond)
	}
}

// check requires that no request started a second after the revocation was
// served and, the chaos over, that each of the replicas refuses the key
// (the requests during the chaos may all have met a replica or the database
// away).
func (d *doomedKey) check(t *testing.T, replicas []*gateway) {
	require.False(t, d.revokedAt.IsZero(), "the key was revoked")
	for _, at := range d.served {
		require.False(t, at.After(d.revokedAt.Add(time.Second)), "a request started %s after the key was revoked was served", at.Sub(d.revokedAt))
	}
	for _, g := range replicas {
		d.refusedBy(t, g)
	}
}

// refusedBy requires that g answers a request with the key 401, asking
// again for up to 30 s while it answers 503 (the database coming back from
// the chaos's last act).
func (d *doomedKey) refusedBy(t *testing.T, g *gateway) {
	for deadline := time.Now().Add(30 * time.Second); ; {
		r := g.call(http.MethodPost, "/api/v1/responses", d.key, map[string]any{"prompt": "chaos doomed, after", "max_output_rungs": 200})
		if r.status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			require.Equal(t, http.StatusUnauthorized, r.status, "a replica answers a request with the revoked key: %s", r.body)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// chaosFor is how long TestChaos runs its load: GATEWAY_CHAOS, or 20s.
func chaosFor(t *testing.T) time.Duration {
	v := os.Getenv("GATEWAY_CHAOS")
	if v == "" {
		return 20 * time.Second
	}
	d, err := time.ParseDuration(v)
	require.NoError(t, err, "GATEWAY_CHAOS is a duration")
	return d
}

// chaosRun is the world of one TestChaos: its own PostgreSQL (stopped and
// crashed), its upstream and its replicas.
type chaosRun struct {
	t       *testing.T
	dir     string
	cluster *pglocal.Cluster
	b       *testBundle
	env     map[string]string
	pool    replicaPool
	// upstreams are the two providers of every model, primary (c.b.fake,
	// over HTTP/1.1) then backup (over HTTP/2 without TLS), in
	// GATEWAY_CONFIG.
	upstreams [2]*fakeupstream.Server
	// proxies are the replicas' ways to the database, which can lose their
	// connections (see act).
	proxies map[*gateway]*tcpproxy.Proxy
	// upstreamProxies are the replicas' ways to each provider, which can lose
	// their connections too.
	upstreamProxies [2]*tcpproxy.Proxy
}

// startChaos starts a durable PostgreSQL of the run's own (a crash must not
// lose a commit), migrates it, and starts three replicas.
func startChaos(t *testing.T) *chaosRun {
	c := &chaosRun{t: t}
	c.cluster, c.dir = ownCluster(t, true)
	parent := filepath.Dir(c.dir)
	for i := range c.upstreams {
		c.upstreams[i] = fakeupstream.New()
		t.Cleanup(c.upstreams[i].Close)
		c.upstreams[i].SetDelay(20 * time.Millisecond)
		c.upstreams[i].SetChunkDelay(5 * time.Millisecond)
		proxy, err := tcpproxy.Start(c.upstreams[i].Listener.Addr().String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		c.upstreamProxies[i] = proxy
	}
	c.b = &testBundle{db: c.cluster.URL("gw"), fake: c.upstreams[0]}
	c.b.key = strings.TrimSpace(mustCLI(t, c.b.db, "keys", "create", "--account", "acme"))
	config := filepath.Join(parent, "gateway.yaml")
	require.NoError(t, os.WriteFile(config, []byte(fmt.Sprintf(`providers:
  primary: {base_url: %s, timeout: 1s}
  backup: {base_url: %s, timeout: 1s, h2c: true}
models:
  instant: {targets: [primary/instant, backup/instant]}
  reasoning: {targets: [primary/reasoning, backup/reasoning]}
  elements: {targets: [primary/elements, backup/elements]}
`, "http://"+c.upstreamProxies[0].Addr()+"/v1", "http://"+c.upstreamProxies[1].Addr()+"/v1")), 0o644))
	c.proxies = map[*gateway]*tcpproxy.Proxy{}
	c.env = map[string]string{"GATEWAY_CONFIG": config, "GATEWAY_LEASE": "2s", "GATEWAY_DRAIN_CONCURRENCY": "4", "GATEWAY_SHUTDOWN_GRACE": "2s"}
	for range 3 {
		c.pool.replicas = append(c.pool.replicas, c.serve())
	}
	return c
}

// serve starts a replica, noted for its logs, that reaches the database
// through a proxy of its own.
func (c *chaosRun) serve() *gateway {
	direct := fmt.Sprintf("127.0.0.1:%d", c.cluster.Port())
	proxy, err := tcpproxy.Start(direct)
	require.NoError(c.t, err)
	c.t.Cleanup(func() { _ = proxy.Close() })
	env := maps.Clone(c.env)
	env["DATABASE_URL"] = strings.Replace(c.b.db, direct, proxy.Addr(), 1)
	g := start(c.t, env, "serve")
	c.proxies[g] = proxy
	c.pool.mu.Lock()
	defer c.pool.mu.Unlock()
	c.pool.all = append(c.pool.all, g)
	return g
}

// act does one random thing to the replicas, a provider or the database,
// and says what.
func (c *chaosRun) act() string {
	u := rand.IntN(3) / 2 // the primary two times in three
	t, fake, provider := c.t, c.upstreams[u], [...]string{"primary", "backup"}[u]
	i := rand.IntN(len(c.pool.replicas))
	switch rand.IntN(11) {
	case 0:
		victim := c.pool.replicas[i]
		require.NoError(t, victim.cmd.Process.Kill())
		<-victim.done
		victim.done <- nil
		c.pool.replace(i, c.serve())
		return "kill -9 a replica"
	case 1:
		_ = c.pool.replicas[i].stop()
		c.pool.replace(i, c.serve())
		return "stop a replica"
	case 2:
		fake.SetMode(fakeupstream.Down)
		time.Sleep(time.Second)
		fake.SetMode(fakeupstream.OK)
		return provider + " 503"
	case 3:
		fake.SetStatus(http.StatusInternalServerError)
		time.Sleep(500 * time.Millisecond)
		fake.SetStatus(0)
		return provider + " 500"
	case 4:
		fake.SetBreakAfter(2)
		time.Sleep(time.Second)
		fake.SetBreakAfter(0)
		return provider + " streams break"
	case 5:
		fake.SetDelay(1500 * time.Millisecond) // past the providers' timeout
		time.Sleep(2 * time.Second)
		fake.SetDelay(20 * time.Millisecond)
		return provider + " stalls"
	case 6:
		what := "database stopped"
		switch rand.IntN(3) {
		case 0:
			require.NoError(t, c.cluster.Stop())
		case 1:
			require.NoError(t, c.cluster.Crash())
			what = "database crashed"
		default:
			// Past the waits of requests and statements (5 s) at times.
			require.NoError(t, c.cluster.Freeze())
			time.Sleep(time.Duration(rand.IntN(7000)) * time.Millisecond)
			require.NoError(t, c.cluster.Thaw())
			return "database frozen"
		}
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Millisecond)
		var err error
		c.cluster, err = pglocal.Start(context.Background(), pglocal.Options{Dir: c.dir, Port: c.cluster.Port(), Durable: true})
		require.NoError(t, err)
		return what
	case 8:
		// The network loses a replica's connections open now, or every
		// replica's, without closing them; the server's keepalives close
		// its ends later.
		what, lost := "a replica's connections lost", c.pool.replicas[i:i+1]
		if rand.IntN(2) == 0 {
			what, lost = "every replica's connections lost", c.pool.replicas
		}
		for _, g := range lost {
			c.proxies[g].Cut()
		}
		time.Sleep(time.Duration(rand.IntN(12000)) * time.Millisecond)
		for _, g := range lost {
			c.proxies[g].Drop()
		}
		return what
	case 9:
		// The network loses the replicas' connections to a provider, calls
		// on them included; the provider's keepalives close its ends later.
		c.upstreamProxies[u].Cut()
		time.Sleep(time.Duration(rand.IntN(3000)) * time.Millisecond)
		c.upstreamProxies[u].Drop()
		return provider + "'s connections lost"
	case 7:
		fake.SetAlwaysStreaming(true)
		fake.SetLeftOpen(true)
		time.Sleep(1500 * time.Millisecond)
		fake.SetAlwaysStreaming(false)
		fake.SetLeftOpen(false)
		return provider + " streams every reply, left open"
	default:
		return "nothing"
	}
}

// TestChaos runs mixed load (JSON replies, streams, batches, cancels) over
// three replicas and two accounts, one of them with a budget cap it runs
// into, every model routed to a primary provider and then a backup, while
// replicas are killed (-9) and stopped, PostgreSQL is stopped, crashed and
// frozen, the network loses a replica's connections to it, or every
// replica's, or the replicas' connections to a provider, and a provider
// answers 503, fails with 500, breaks its streams, stalls past its timeout,
// and streams every reply (asked for whole or not) and leaves it open, and a
// key in use is revoked midway; then checks that no request was answered 500
// (or a stream failed INTERNAL), that no request with the revoked key that
// started a second after was served and each replica refuses it once the
// chaos is over and, from a fresh replica, that no prompt was processed
// twice by a provider, nor a batch item's by the two, every batch ended,
// each completed item ran once and failed or cancelled ones were billed
// nothing, each account's usage view is what its clients received plus at
// most the requests whose replies they lost, the ledger settled, the cap
// held, and no replica panicked. It runs for 20 s, or GATEWAY_CHAOS (make
// chaos).
func TestChaos(t *testing.T) {
	t.Parallel()
	c := startChaos(t)
	const tightCap = 4000
	mustCLI(t, c.b.db, "limits", "set", "--account", "acme", "--project", "default", "--budget-rungs", "1000000000")
	tight := strings.TrimSpace(mustCLI(t, c.b.db, "keys", "create", "--account", "tight"))
	mustCLI(t, c.b.db, "limits", "set", "--account", "tight", "--project", "default", "--budget-rungs", fmt.Sprint(tightCap))
	ledgers := map[string]*ledger{} // by key
	for key, account := range map[string]string{c.b.key: "acme", tight: "tight"} {
		ledgers[key] = &ledger{account: account, batches: map[string]string{}, statuses: map[string]int{}}
	}

	stop := make(chan struct{})
	var clients sync.WaitGroup
	client := &http.Client{Timeout: 90 * time.Second}
	for key, l := range ledgers {
		for range 3 { // about 8 calls a second a key, under its rate limit
			clients.Add(1)
			go func() {
				defer clients.Done()
				for {
					select {
					case <-stop:
						return
					case <-time.After(time.Duration(200+rand.IntN(300)) * time.Millisecond):
					}
					chaosCall(client, &c.pool, key, l)
				}
			}()
		}
	}
	doomed := &doomedKey{key: strings.TrimSpace(mustCLI(t, c.b.db, "keys", "create", "--account", "acme"))}
	clients.Add(1)
	go func() {
		defer clients.Done()
		doomed.call(client, &c.pool, ledgers[c.b.key], stop)
	}()
	actions := map[string]int{}
	run := chaosFor(t)
	for start := time.Now(); time.Since(start) < run; {
		time.Sleep(time.Duration(500+rand.IntN(2000)) * time.Millisecond)
		if doomed.revokedAt.IsZero() && time.Since(start) > run/2 {
			doomed.revoke(t, c.b.db)
			continue
		}
		actions[c.act()]++
	}
	close(stop)
	clients.Wait()
	t.Logf("chaos: %v", actions)
	doomed.check(t, c.pool.replicas)

	for _, g := range c.pool.replicas {
		_ = g.stop()
	}
	final := c.serve()
	checkers := map[*ledger]*checker{}
	results := map[*ledger][]api.BatchResults{}
	for _, l := range ledgers {
		checkers[l] = &checker{t: t, db: c.b.db, account: l.account}
		for id := range l.batches {
			results[l] = append(results[l], final.waitTerminalWith(checkers[l].key, id, 3*time.Minute))
		}
	}
	// Once every batch ended: a prompt is processed at most once by each
	// provider, and a batch item's by one of them at most (D12); an
	// interactive request may fall back to the backup after the primary
	// failed after dispatch.
	processed := map[string]int{}
	for _, u := range c.upstreams {
		mine := map[string]int{}
		for _, call := range u.Calls() {
			if !call.Refused {
				mine[call.Prompt]++
				processed[call.Prompt]++
			}
		}
		for p, n := range mine {
			require.LessOrEqual(t, n, 1, "prompt %q was processed %d times by one provider", p, n)
		}
	}
	require.Equal(t, len(c.upstreams[1].Calls()), c.upstreams[1].HTTP2Calls(), "the backup is called over HTTP/2")
	for p, n := range processed {
		if strings.HasPrefix(p, "chaos batch") {
			require.LessOrEqual(t, n, 1, "batch item %q was processed %d times", p, n)
		}
	}
	for _, l := range ledgers {
		outcomes := map[string]int{}
		for _, res := range results[l] {
			prefix := l.batches[res.BatchId.String()]
			for _, it := range res.Results {
				prompt := fmt.Sprintf("%s item %d", prefix, it.Index)
				outcome := string(it.Status)
				switch it.Status {
				case "completed":
					require.Equal(t, 1, processed[prompt], "a completed item ran once: %s", prompt)
					l.received.add(it.Usage)
				case "failed", "cancelled":
					require.Equal(t, api.RungUsage{}, it.Usage, "%s: %s item billed", prompt, it.Status)
					if it.Error != nil {
						outcome += " " + string(it.Error.Code)
					}
				default:
					t.Fatalf("%s is %s in a %s batch", prompt, it.Status, res.Status)
				}
				outcomes[outcome]++
			}
		}
		for status := range l.statuses {
			require.NotContains(t, status, " 400 ", "the load sends only valid requests")
			require.NotContains(t, status, " 500 ", "no failure is a 500, an outage of the database's included (D12)")
			require.NotContains(t, status, "INTERNAL", "no stream fails INTERNAL")
		}
		listed, unknown := 0, 0
		for after := ""; ; {
			page := expect[api.BatchList](t, final.call(http.MethodGet, "/api/v1/batches?limit=50"+after, checkers[l].key(), nil), http.StatusOK)
			for _, b := range page.Data {
				listed++
				if _, ok := l.batches[b.Id.String()]; !ok {
					unknown++
				}
			}
			if !page.HasMore {
				break
			}
			after = "&after=" + page.Data[len(page.Data)-1].Id.String()
		}
		require.Equal(t, len(l.batches), listed-unknown)
		require.LessOrEqual(t, unknown, l.unanswered, "a batch sent again with its Idempotency-Key is stored once")
		var v api.UsageView
		require.Eventually(t, func() bool {
			v = final.usage(checkers[l].key())
			return v.Daily.ChargedRungs == v.Totals.TotalRungs && v.Budget.ReservedRungs == 0
		}, time.Minute, 200*time.Millisecond, "the ledger settles: %+v", v)
		t.Logf("%s: calls %v; items %v; received %+v, lost %d; usage view %+v", l.account, l.statuses, outcomes, l.received.UsageTotals, l.lost, v.Totals)
		require.Equal(t, v.Totals.TotalRungs, v.Budget.SpentRungs)
		require.GreaterOrEqual(t, v.Totals.Requests, l.received.Requests)
		require.GreaterOrEqual(t, v.Totals.TotalRungs, l.received.TotalRungs)
		require.LessOrEqual(t, v.Totals.Requests-l.received.Requests, int64(l.lost), "only requests whose replies were lost are billed unseen")
		if l.account == "tight" {
			require.LessOrEqual(t, v.Budget.SpentRungs, int64(tightCap))
		}
	}
	logged := map[string]int{}
	for _, g := range c.pool.all {
		require.NotContains(t, g.stderr.String(), "panic")
		for _, line := range strings.Split(g.stderr.String(), "\n") {
			var e struct{ Level, Msg, Error string }
			if json.Unmarshal([]byte(line), &e) == nil && e.Level != "INFO" {
				logged[e.Level+" "+e.Msg]++
			}
		}
	}
	t.Logf("logged: %v", logged)
}
