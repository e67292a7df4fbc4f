// Command load measures what the gateway adds: it drives the non-streaming
// responses route and the same fake upstream directly, side by side in one
// run, with an open-loop load at fixed request rates, and prints req/s and
// p50/p90/p99 for both and their difference, the CPU each request cost the
// gateway, PostgreSQL and this process, and the database commits, WAL flushes
// and WAL records per request; then the saturation point of both under a
// closed loop. Beside both it measures a bare proxy (bench/internal/floor), the least
// a gateway that bills what it answers must do, as the floor of that run.
//
// This process is the load's HTTP client and the fake upstream's HTTP server:
// driving the upstream directly, its CPU per request is what one Go process
// spends being the client and the server of one exchange on this machine,
// the least a proxy of the same exchange can spend.
//
// It starts everything it needs (see benchenv): a private PostgreSQL with
// production durability, the fake upstream, and the gateway binary.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rungworks/gateway/bench/internal/benchenv"
	"github.com/rungworks/gateway/bench/internal/floor"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/proccpu"
	"github.com/rungworks/gateway/store"
)

func main() {
	floor.ServeIfAsked()
	binary := flag.String("binary", "bin/gateway", "gateway binary")
	rates := flag.String("rates", "250,500,1000,2000", "request rates to measure (req/s)")
	duration := flag.Duration("duration", 10*time.Second, "measured time per rate and target")
	warmup := flag.Duration("warmup", 2*time.Second, "unmeasured load before each measurement")
	connections := flag.Int("connections", 64, "closed-loop connections for the saturation point (0: skip)")
	h2c := flag.Bool("h2c", false, "speak HTTP/2 without TLS to the gateway (GATEWAY_H2C), as a load balancer may")
	promptBytes := flag.Int("prompt-bytes", 0, "prompts of about this many bytes of words, a different one each request (0: one short prompt)")
	tenants := flag.Int("tenants", 1, "accounts the requests are spread over, each with its key, in turn")
	limitChanges := flag.Duration("limit-changes", 0, "while measuring the gateway, change one tenant's daily ceiling this often, a tenant after another (0: never)")
	capped := flag.Bool("capped", false, "give each tenant's project a budget cap (one that no request reaches), so that each request reserves its estimate on it")
	uncited := flag.Bool("uncited", false, "replies cite no source (as most replies without a web search), so their evidence is empty")
	withFloor := flag.Bool("floor", true, "also measure a bare proxy that commits a row a request before it answers (see bench/internal/floor)")
	backlog := flag.Int("backlog", 0, "requests of the first tenant completed 100 days ago, past the request retention, stored before the gateway starts: its maintenance folds them while the load is measured")
	flag.Parse()
	o := options{duration: *duration, warmup: *warmup, connections: *connections, h2c: *h2c, promptBytes: *promptBytes,
		tenants: *tenants, limitChanges: *limitChanges, capped: *capped, uncited: *uncited, floor: *withFloor, backlog: *backlog}
	if err := run(*binary, *rates, o); err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
}

// options shape a run: see the flags of the same names.
type options struct {
	duration, warmup, limitChanges    time.Duration
	connections, promptBytes, tenants int
	backlog                           int
	h2c, capped, uncited, floor       bool
}

func run(binary, rateList string, o options) error {
	env, err := benchenv.Start(binary)
	if err != nil {
		return err
	}
	defer env.Close()
	fake := fakeupstream.New()
	defer fake.Close()
	fake.SetCitations(!o.uncited)
	// Kept, the calls of a run grow this process's heap to a hundred
	// megabytes and more, and its collections, taking a core for a tenth of
	// a second every few seconds by the end, would be measured as the
	// gateway's tail.
	fake.SetUnrecorded(true)
	vars, key, err := env.Fresh("load", fake.BaseURL(), "GATEWAY_H2C="+strconv.FormatBool(o.h2c))
	if err != nil {
		return err
	}
	accounts, keys, err := benchenv.Tenants(vars, key, o.tenants)
	if err != nil {
		return err
	}
	if o.capped {
		if err := benchenv.CapBudgets(vars, accounts); err != nil {
			return err
		}
	}
	st, err := benchenv.OpenStore(vars)
	if err != nil {
		return err
	}
	defer st.Pool().Close()
	if err := storeBacklog(st, accounts[0], o.backlog); err != nil {
		return err
	}
	gateway, err := env.ServeProcess(vars)
	if err != nil {
		return err
	}
	base, pid := gateway.Base, gateway.PID
	started := time.Now()

	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute}}
	gatewayClient, protocol := client, "HTTP/1.1"
	if o.h2c {
		transport := &http.Transport{Protocols: new(http.Protocols)}
		transport.Protocols.SetUnencryptedHTTP2(true)
		gatewayClient, protocol = &http.Client{Transport: transport}, "HTTP/2 (h2c)"
	}
	prompts := []string{"Summarise the benefits of metering inference in rungs for a platform team."}
	if o.promptBytes > 0 {
		prompts = wordPrompts(o.promptBytes, 256)
	}
	// The gateway's CPU column shows, for the upstream driven directly,
	// what the idle gateway spent meanwhile; for the bare proxy, the proxy's.
	direct := target{name: "upstream direct", client: client, url: fake.BaseURL() + "/chat/completions", pid: pid}
	viaGateway := target{name: "through gateway", client: gatewayClient, url: base + "/api/v1/responses", keys: keys, pid: pid}
	for _, prompt := range prompts {
		direct.bodies = append(direct.bodies, []byte(`{"model":"instant","max_completion_tokens":200,"messages":[{"role":"user","content":"`+prompt+`"}]}`))
		viaGateway.bodies = append(viaGateway.bodies, []byte(`{"prompt":"`+prompt+`","max_output_rungs":200}`))
	}
	targets, floorNote := []target{direct, viaGateway}, ""
	if o.floor {
		bare, err := floor.Start(vars, fake.BaseURL())
		if err != nil {
			return err
		}
		defer bare.Stop()
		viaFloor := target{name: "through a bare proxy", client: client, url: bare.Base + "/", bodies: viaGateway.bodies, pid: bare.PID}
		targets = []target{direct, viaFloor, viaGateway}
		floorNote = " and a bare proxy (HTTP/1.1, a committed row a request)"
	}

	backlogNote := ""
	if o.backlog > 0 {
		backlogNote = fmt.Sprintf(", a backlog of %d requests past the retention folded meanwhile", o.backlog)
	}
	fmt.Printf("gateway (%s) vs. upstream direct%s, open loop, %s per rate (after %s warm-up), %d cores, %d tenants%s%s%s\n\n",
		protocol, floorNote, o.duration, o.warmup, runtime.NumCPU(), len(keys), benchenv.CappedNote(o.capped), benchenv.CitedNote(o.uncited), backlogNote)
	fmt.Println("| rate (req/s) | target | achieved req/s | errors | p50 | p90 | p99 | CPU/req gateway (or bare proxy) | CPU/req PostgreSQL | CPU/req load + fake upstream | commits/req | WAL flushes/req | WAL records/req |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, field := range strings.Split(rateList, ",") {
		rate, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || rate <= 0 {
			return fmt.Errorf("bad rate %q", field)
		}
		results := make([]result, len(targets))
		for i, t := range targets {
			drive(t, rate, o.warmup)
			before, err := sample(st, t.pid)
			if err != nil {
				return err
			}
			stop := func() error { return nil }
			if t.name == viaGateway.name && o.limitChanges > 0 {
				stop = changeLimits(st, accounts, o.limitChanges)
			}
			results[i] = drive(t, rate, o.duration)
			if err := stop(); err != nil {
				return err
			}
			after, err := sample(st, t.pid)
			if err != nil {
				return err
			}
			cost := after.since(before, len(results[i].latencies)+results[i].errors)
			fmt.Printf("| %d | %s | %.0f | %d | %s | %s | %s | %s |\n", rate, t.name, results[i].achieved, results[i].errors,
				ms(results[i].pct(50)), ms(results[i].pct(90)), ms(results[i].pct(99)), cost)
		}
		for i, t := range targets[1:] {
			fmt.Printf("| %d | **%s** | | | %s | %s | %s | | | | | | |\n", rate, benchenv.AddedBy(t.name),
				ms(results[i+1].pct(50)-results[0].pct(50)), ms(results[i+1].pct(90)-results[0].pct(90)), ms(results[i+1].pct(99)-results[0].pct(99)))
		}
	}
	if o.backlog > 0 {
		if err := reportBacklog(st, o.backlog, time.Since(started)); err != nil {
			return err
		}
	}
	if o.connections > 0 {
		fmt.Printf("\nsaturation, closed loop, %d connections, %s each\n\n", o.connections, o.duration)
		fmt.Println("| target | req/s | errors | p50 | p99 |")
		fmt.Println("|---|---|---|---|---|")
		for _, t := range targets {
			saturate(t, o.connections, o.warmup)
			r := saturate(t, o.connections, o.duration)
			fmt.Printf("| %s | %.0f | %d | %s | %s |\n", t.name, r.achieved, r.errors, ms(r.pct(50)), ms(r.pct(99)))
		}
	}
	return nil
}

// storeBacklog stores n requests of account completed 100 days ago, a
// millisecond apart, past the default request retention (90 days), as a
// database of months of requests holds them when a release with the
// retention first starts on it.
func storeBacklog(st *store.Store, account string, n int) error {
	if n == 0 {
		return nil
	}
	_, err := st.Pool().Exec(context.Background(), `
		INSERT INTO requests (id, account_id, project_id, model, entry_point, status,
		                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
		SELECT gen_random_uuid(), a.id, p.id, 'instant', 'responses', 'completed', 10, 20, 10, 20, 30, t, t
		  FROM accounts a
		  JOIN projects p ON p.account_id = a.id AND p.name = 'default',
		       LATERAL (SELECT now() - interval '100 days' + i * interval '1 millisecond' AS t FROM generate_series(1, $2::integer) i) g
		 WHERE a.name = $1`, account, n)
	if err != nil {
		return fmt.Errorf("error storing a backlog of old requests: %w", err)
	}
	// What the insert leaves to do (its vacuum, a checkpoint of what it
	// wrote) is done now, not while the load is measured.
	if _, err := st.Pool().Exec(context.Background(), `VACUUM ANALYZE requests`); err != nil {
		return fmt.Errorf("error vacuuming the backlog: %w", err)
	}
	if _, err := st.Pool().Exec(context.Background(), `CHECKPOINT`); err != nil {
		return fmt.Errorf("error checkpointing the backlog: %w", err)
	}
	return nil
}

// reportBacklog prints how much of a backlog of n requests (storeBacklog)
// the gateway folded in the time it has run.
func reportBacklog(st *store.Store, n int, ran time.Duration) error {
	var left int
	err := st.Pool().QueryRow(context.Background(),
		`SELECT count(*) FROM requests WHERE completed_at < now() - interval '90 days'`).Scan(&left)
	if err != nil {
		return fmt.Errorf("error counting the backlog left: %w", err)
	}
	fmt.Printf("\nthe backlog: %d of %d requests folded in the gateway's first %s, %.0f a second\n",
		n-left, n, ran.Round(time.Second), float64(n-left)/ran.Seconds())
	return nil
}

// changeLimits sets the daily ceiling of one account after another, every
// interval, as an operator's changes would, until the returned function is
// called; that returns the first error.
func changeLimits(st *store.Store, accounts []string, every time.Duration) func() error {
	done := make(chan struct{})
	errs := make(chan error, 1)
	go func() {
		defer close(errs)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			ceiling := int64(1_000_000_000_000 + n) // a new value each time: a change is announced
			if err := st.SetLimits(context.Background(), store.SetLimitsParams{Account: accounts[n%len(accounts)], DailyRungs: &ceiling}); err != nil {
				errs <- fmt.Errorf("error changing limits: %w", err)
				return
			}
		}
	}()
	return func() error {
		close(done)
		return <-errs
	}
}

// counters are the cumulative costs a measurement takes the difference of.
type counters struct {
	gatewayCPU, postgresCPU, loadCPU time.Duration
	activity                         store.Activity
}

func sample(st *store.Store, pid int) (counters, error) {
	var c counters
	var err error
	if c.activity, err = benchenv.Activity(st); err != nil {
		return c, err
	}
	if c.gatewayCPU, c.postgresCPU, err = benchenv.CPU(pid); err != nil {
		return c, err
	}
	c.loadCPU, err = proccpu.Of(os.Getpid())
	return c, err
}

// since formats the cost per request of n requests between b and c.
func (c counters) since(b counters, n int) string {
	if n == 0 {
		return "| | | | |"
	}
	a := c.activity.Since(b.activity)
	return fmt.Sprintf("%s | %s | %s | %.2f | %.2f | %.1f", benchenv.PerUnit(c.gatewayCPU-b.gatewayCPU, n), benchenv.PerUnit(c.postgresCPU-b.postgresCPU, n),
		benchenv.PerUnit(c.loadCPU-b.loadCPU, n), float64(a.Commits)/float64(n), float64(a.WALSyncs)/float64(n), float64(a.WALRecords)/float64(n))
}

// saturate sends requests back to back on n connections for d.
func saturate(t target, n int, d time.Duration) result {
	var mu sync.Mutex
	var res result
	var wg sync.WaitGroup
	start := time.Now()
	for c := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := c; time.Since(start) < d; k += n {
				begin := time.Now()
				ok := send(t, k)
				elapsed := time.Since(begin)
				mu.Lock()
				if ok {
					res.latencies = append(res.latencies, elapsed)
				} else {
					res.errors++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	res.achieved = float64(len(res.latencies)) / time.Since(start).Seconds()
	slices.Sort(res.latencies)
	return res
}

// send makes the target's nth request and reports whether it succeeded.
func send(t target, n int) bool {
	req, _ := http.NewRequest(http.MethodPost, t.url, bytes.NewReader(t.bodies[n%len(t.bodies)]))
	req.Header.Set("Content-Type", "application/json")
	if len(t.keys) > 0 {
		req.Header.Set("Authorization", "Bearer "+t.keys[n%len(t.keys)])
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// target is where requests go; its requests carry its bodies, and its keys
// (if any), in turn.
type target struct {
	name   string
	client *http.Client
	url    string
	bodies [][]byte
	keys   []string
	// pid is the process whose CPU the gateway column shows.
	pid int
}

// wordPrompts returns n prompts of about size bytes each, different stretches
// of text made of common words and of words the tokenizer splits.
func wordPrompts(size, n int) []string {
	words := strings.Fields(`the of and to in is that for it as was with be by on not he this are or his from at which
		but have an they you were her she there would their we him been has when who will more no if out so said what up
		its about into than them can only other new some could time these two may then do first any my now such like our
		gateway metering rungs budget ceiling replica stream batch upstream PostgreSQL ledger tokenizer idempotency
		summarise reconciliation throughput latency percentile asynchronous multiplexed observability`)
	rng := rand.New(rand.NewPCG(5, 6))
	prompts := make([]string, n)
	for i := range prompts {
		var b strings.Builder
		for b.Len() < size {
			b.WriteString(words[rng.IntN(len(words))])
			if rng.IntN(10) == 0 {
				b.WriteString(". ")
			} else {
				b.WriteByte(' ')
			}
		}
		prompts[i] = b.String()
	}
	return prompts
}

type result struct {
	latencies []time.Duration
	errors    int
	achieved  float64
}

func (r result) pct(p float64) time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	i := int(float64(len(r.latencies)-1) * p / 100)
	return r.latencies[i]
}

// drive sends requests at a fixed rate for d, each on its own goroutine, so a
// slow reply never delays the next request (no coordinated omission).
func drive(t target, rate int, d time.Duration) result {
	var mu sync.Mutex
	var res result
	var wg sync.WaitGroup
	interval := time.Second / time.Duration(rate)
	startAll := time.Now()
	for n := 0; ; n++ {
		due := startAll.Add(time.Duration(n) * interval)
		if due.Sub(startAll) >= d {
			break
		}
		time.Sleep(time.Until(due))
		wg.Add(1)
		go func() {
			defer wg.Done()
			begin := time.Now()
			ok := send(t, n)
			elapsed := time.Since(begin)
			mu.Lock()
			defer mu.Unlock()
			if !ok {
				res.errors++
				return
			}
			res.latencies = append(res.latencies, elapsed)
		}()
	}
	wg.Wait()
	// Over d at least: a d shorter than the interval sends one request,
	// whose own time is not the rate.
	res.achieved = float64(len(res.latencies)) / max(d, time.Since(startAll)).Seconds()
	slices.Sort(res.latencies)
	return res
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
