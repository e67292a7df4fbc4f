// Command drain measures batch draining: items per second for 1, 2 and 4
// replicas draining the same queue with an instant upstream, and the latency
// from a batch's creation to its first item reaching the upstream on an idle
// replica. With -rounds above 1 the replica counts are measured in turn that
// many times, and the median of each is printed: on a shared machine, runs
// minutes apart differ more than the counts compared.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rungworks/gateway/bench/internal/benchenv"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/wordtext"
	"github.com/rungworks/gateway/store"
)

func main() {
	binary := flag.String("binary", "bin/gateway", "gateway binary")
	replicaList := flag.String("replicas", "1,2,4", "replica counts to measure")
	batches := flag.Int("batches", 100, "batches per run")
	items := flag.Int("items", 100, "items a batch (1 to 100)")
	probes := flag.Int("probes", 30, "single-item batches for the dispatch latency (0: not measured)")
	rounds := flag.Int("rounds", 1, "times each replica count is measured, in turn")
	warmup := flag.Int("warmup", 20, "batches drained before each measured run, not counted")
	accounts := flag.Int("accounts", 1, "accounts the batches are spread over, in turn (each claim shares out its items among the accounts with work)")
	capped := flag.Bool("capped", false, "give each account's project a budget cap (one that every item fits), so that each claimed item reserves its estimate")
	uncited := flag.Bool("uncited", false, "replies cite no source (as most replies without a web search), so their evidence is empty")
	outputBytes := flag.Int("output-bytes", 0, "outputs of about this many bytes of words, as a model's often are (the fake upstream echoes the prompt, which holds them); 0: a few words")
	flag.Parse()
	if *items < 1 || *items > 100 {
		fmt.Fprintln(os.Stderr, "drain: -items must be 1 to 100")
		os.Exit(2)
	}
	if err := run(*binary, *replicaList, *probes, *rounds, runOptions{batches: *batches, items: *items, warmup: *warmup, accounts: *accounts, capped: *capped, uncited: *uncited, outputBytes: *outputBytes}); err != nil {
		fmt.Fprintln(os.Stderr, "drain:", err)
		os.Exit(1)
	}
}

// runOptions shape each drain run: batches of items measured, after warmup
// drained, spread over accounts, whose projects are capped when capped is
// set, answered without citations when uncited is, with outputs of about
// outputBytes when it is set.
type runOptions struct {
	batches, items, warmup, accounts, outputBytes int
	capped, uncited                               bool
}

func run(binary, replicaList string, probes, rounds int, o runOptions) error {
	var counts []int
	for _, field := range strings.Split(replicaList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || n < 1 {
			return fmt.Errorf("bad replica count %q", field)
		}
		counts = append(counts, n)
	}
	if rounds < 1 || o.warmup < 0 || o.accounts < 1 || probes < 0 || o.outputBytes < 0 || o.outputBytes > 64<<10 {
		return fmt.Errorf("bad round count %d, warm-up %d, account count %d, probe count %d or output size %d (0 to 65536)", rounds, o.warmup, o.accounts, probes, o.outputBytes)
	}
	env, err := benchenv.Start(binary)
	if err != nil {
		return err
	}
	defer env.Close()
	fake := fakeupstream.New()
	defer fake.Close()
	fake.SetCitations(!o.uncited)

	output := "a few words"
	if o.outputBytes > 0 {
		output = fmt.Sprintf("%d bytes", o.outputBytes)
	}
	fmt.Printf("batch drain, instant upstream, %d batches × %d items of %d accounts%s%s, outputs of %s, per run after %d not counted and the tables analyzed, %d cores\n\n",
		o.batches, o.items, o.accounts, benchenv.CappedNote(o.capped), benchenv.CitedNote(o.uncited), output, o.warmup, runtime.NumCPU())
	fmt.Println("| round | replicas | items | seconds (creating) | items/s | CPU/item gateway (creating) | CPU/item PostgreSQL (creating) | WAL flushes/item | WAL records/item |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	rates := map[int][]float64{}
	for round := 1; round <= rounds; round++ {
		for _, n := range counts {
			r, err := drain(env, fake, n, round, o)
			if err != nil {
				return err
			}
			rate := float64(r.items) / r.seconds
			rates[n] = append(rates[n], rate)
			fmt.Printf("| %d | %d | %d | %.2f (%.2f) | %.0f | %s (%s) | %s (%s) | %.3f | %.1f |\n", round, n, r.items, r.seconds, r.created.seconds, rate,
				benchenv.PerUnit(r.gatewayCPU, r.items), benchenv.PerUnit(r.created.gatewayCPU, r.items), benchenv.PerUnit(r.postgresCPU, r.items), benchenv.PerUnit(r.created.postgresCPU, r.items),
				float64(r.activity.WALSyncs)/float64(r.items), float64(r.activity.WALRecords)/float64(r.items))
		}
	}
	for _, n := range counts[1:] {
		fmt.Printf("\n%s\n", paired(rates, counts[0], n))
	}
	if rounds > 1 {
		fmt.Println("\n| replicas | median items/s | lowest | highest |")
		fmt.Println("|---|---|---|---|")
		for _, n := range counts {
			v := slices.Sorted(slices.Values(rates[n]))
			fmt.Printf("| %d | %.0f | %.0f | %.0f |\n", n, median(v), v[0], v[len(v)-1])
		}
	}

	if probes == 0 {
		return nil
	}
	p50, p99, err := dispatchLatency(env, fake, probes)
	if err != nil {
		return err
	}
	fmt.Printf("\ncreated → first item at the upstream, idle replica, %d batches: p50 %.1f ms, p99 %.1f ms\n", probes, p50, p99)
	return nil
}

// paired compares, round by round, the rates of n replicas with those of base
// replicas measured just before them: the goal is that more replicas never
// drain slower.
func paired(rates map[int][]float64, base, n int) string {
	ratios := make([]string, len(rates[n]))
	notSlower := 0
	for i, r := range rates[n] {
		ratios[i] = fmt.Sprintf("%.2f", r/rates[base][i])
		if r >= rates[base][i] {
			notSlower++
		}
	}
	return fmt.Sprintf("%d replicas against %d, items/s round by round: × %s (as fast or faster in %d of %d)",
		n, base, strings.Join(ratios, ", "), notSlower, len(ratios))
}

// result is one drain run: the items, the seconds from the first creation to
// the last batch completed, and the CPU the gateway replicas and PostgreSQL
// spent in that time; created is the same until the last batch was created
// (the replicas drain while batches are being created). activity is what the
// server wrote in the run: WAL flushes (durable commits, as the server grouped
// them) and WAL records, which, unlike times, do not depend on how busy the
// machine is.
type result struct {
	phase
	created  phase
	activity store.Activity
}

type phase struct {
	items                   int
	seconds                 float64
	gatewayCPU, postgresCPU time.Duration
}

// since is the phase from start and the CPU times before to now.
func since(start time.Time, items int, pids []int, gatewayBefore, postgresBefore time.Duration) (phase, error) {
	p := phase{items: items, seconds: time.Since(start).Seconds()}
	gateway, postgres, err := benchenv.CPU(pids...)
	p.gatewayCPU, p.postgresCPU = gateway-gatewayBefore, postgres-postgresBefore
	return p, err
}

// drain creates the batches through n replicas and times until all are
// terminal, in a database of its own.
func drain(env *benchenv.Env, fake *fakeupstream.Server, replicas, round int, o runOptions) (result, error) {
	defer env.StopServers()
	vars, key, err := env.Fresh(fmt.Sprintf("drain_%d_%d", replicas, round), fake.BaseURL())
	if err != nil {
		return result{}, err
	}
	accounts, keys, err := benchenv.Tenants(vars, key, o.accounts)
	if err != nil {
		return result{}, err
	}
	if o.capped {
		if err := benchenv.CapBudgets(vars, accounts); err != nil {
			return result{}, err
		}
	}
	bases := make([]string, replicas)
	pids := make([]int, replicas)
	for i := range bases {
		p, err := env.ServeProcess(vars)
		if err != nil {
			return result{}, err
		}
		bases[i], pids[i] = p.Base, p.PID
	}
	requests := make([]map[string]any, o.items)
	words := ""
	if o.outputBytes > 0 {
		words = " " + wordtext.Random(o.outputBytes)
	}
	for i := range requests {
		// The output ceiling holds the echoed prompt's words, a token each
		// (a word and its space take two bytes at least), within the
		// model's limit (32,000 rungs).
		requests[i] = map[string]any{"prompt": fmt.Sprintf("drain benchmark item %d", i) + words, "max_output_rungs": 50 + o.outputBytes/4}
	}
	body, _ := json.Marshal(map[string]any{"requests": requests})
	// Warm-up, not measured: replicas that have drained before, with their
	// database connections open and their plans and tables loaded, as a
	// replica serving for a while is.
	warm, err := create(bases, keys, body, o.warmup)
	if err != nil {
		return result{}, err
	}
	if err := await(bases[0], warm); err != nil {
		return result{}, err
	}
	st, err := benchenv.OpenStore(vars)
	if err != nil {
		return result{}, err
	}
	defer st.Pool().Close()
	// The queue is empty now, as after any drain, when autovacuum analyzes
	// the tables a drain changed: the batches measured arrive at a queue
	// whose statistics say it is empty.
	if err := st.AnalyzeQueue(context.Background()); err != nil {
		return result{}, err
	}
	activityBefore, err := benchenv.Activity(st)
	if err != nil {
		return result{}, err
	}
	gatewayBefore, postgresBefore, err := benchenv.CPU(pids...)
	if err != nil {
		return result{}, err
	}

	start := time.Now()
	created, err := create(bases, keys, body, o.batches)
	if err != nil {
		return result{}, err
	}
	var r result
	if r.created, err = since(start, o.batches*o.items, pids, gatewayBefore, postgresBefore); err != nil {
		return result{}, err
	}
	if err := await(bases[0], created); err != nil {
		return result{}, err
	}
	if r.phase, err = since(start, o.batches*o.items, pids, gatewayBefore, postgresBefore); err != nil {
		return result{}, err
	}
	after, err := benchenv.Activity(st)
	r.activity = after.Since(activityBefore)
	return r, err
}

// batch is a batch created, and the key of its account.
type batch struct{ id, key string }

// create makes n batches of body at once, through the replicas and with the
// keys in turn, and returns them.
func create(bases, keys []string, body []byte, n int) ([]batch, error) {
	batches := make([]batch, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var b struct {
				ID string `json:"id"`
			}
			key := keys[i%len(keys)]
			if err := post(bases[i%len(bases)]+"/api/v1/batch", key, body, &b); err != nil {
				errs <- err
				return
			}
			batches[i] = batch{id: b.ID, key: key}
		}()
	}
	wg.Wait()
	close(errs)
	return batches, <-errs
}

// await waits until every batch is completed.
func await(base string, batches []batch) error {
	for _, bt := range batches {
		for {
			var b struct{ Status string }
			if err := get(base+"/api/v1/batch/"+bt.id, bt.key, &b); err != nil {
				return err
			}
			if b.Status == "completed" {
				break
			}
			if b.Status == "failed" || b.Status == "expired" || b.Status == "cancelled" {
				return fmt.Errorf("batch %s ended %s", bt.id, b.Status)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

// dispatchLatency creates one-item batches on an idle replica and measures
// until the upstream sees each.
func dispatchLatency(env *benchenv.Env, fake *fakeupstream.Server, probes int) (p50, p99 float64, err error) {
	defer env.StopServers()
	vars, key, err := env.Fresh("dispatch", fake.BaseURL())
	if err != nil {
		return 0, 0, err
	}
	base, err := env.Serve(vars)
	if err != nil {
		return 0, 0, err
	}
	var latencies []float64
	for i := range probes {
		prompt := fmt.Sprintf("dispatch probe %d", i)
		body, _ := json.Marshal(map[string]any{"requests": []any{map[string]any{"prompt": prompt}}})
		sent := time.Now()
		if err := post(base+"/api/v1/batch", key, body, nil); err != nil {
			return 0, 0, err
		}
		arrived, err := waitForCall(fake, prompt, 10*time.Second)
		if err != nil {
			return 0, 0, fmt.Errorf("probe %d: %w", i, err)
		}
		latencies = append(latencies, float64(arrived.Sub(sent).Microseconds())/1000)
		time.Sleep(200 * time.Millisecond) // idle again
	}
	slices.Sort(latencies)
	return latencies[len(latencies)/2], latencies[len(latencies)*99/100], nil
}

// median is the middle of sorted values (the mean of the two middle ones).
func median(sorted []float64) float64 {
	n := len(sorted)
	return (sorted[(n-1)/2] + sorted[n/2]) / 2
}

// waitForCall waits until the upstream received prompt and returns when.
func waitForCall(fake *fakeupstream.Server, prompt string, within time.Duration) (time.Time, error) {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		for _, c := range fake.Calls() {
			if c.Prompt == prompt {
				return c.At, nil
			}
		}
		time.Sleep(time.Millisecond)
	}
	return time.Time{}, fmt.Errorf("never reached the upstream")
}

func post(url, key string, body []byte, out any) error {
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	return do(req, out)
}

func get(url, key string, out any) error {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer "+key)
	return do(req, out)
}

func do(req *http.Request, out any) error {
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var e map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&e)
		return fmt.Errorf("%s %s: %d %v", req.Method, req.URL.Path, resp.StatusCode, e)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}
