// Command load measures the latency the gateway adds: it drives the
// non-streaming responses route and the same fake upstream directly, side by
// side in one run, with an open-loop load at fixed request rates, and prints
// req/s and p50/p90/p99 for both and their difference.
//
// It starts everything it needs (see benchenv): a private PostgreSQL with
// production durability, the fake upstream, and the gateway binary.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
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
)

func main() {
	binary := flag.String("binary", "bin/gateway", "gateway binary")
	rates := flag.String("rates", "500,1000", "request rates to measure (req/s)")
	duration := flag.Duration("duration", 10*time.Second, "measured time per rate and target")
	warmup := flag.Duration("warmup", 2*time.Second, "unmeasured load before each measurement")
	flag.Parse()
	if err := run(*binary, *rates, *duration, *warmup); err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
}

func run(binary, rateList string, duration, warmup time.Duration) error {
	env, err := benchenv.Start(binary)
	if err != nil {
		return err
	}
	defer env.Close()
	fake := fakeupstream.New()
	defer fake.Close()
	vars, key, err := env.Fresh("load", fake.BaseURL())
	if err != nil {
		return err
	}
	base, err := env.Serve(vars)
	if err != nil {
		return err
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute}}
	prompt := "Summarise the benefits of metering inference in rungs for a platform team."
	direct := target{
		name: "upstream direct",
		url:  fake.BaseURL() + "/chat/completions",
		body: []byte(`{"model":"instant","max_completion_tokens":200,"messages":[{"role":"user","content":"` + prompt + `"}]}`),
	}
	viaGateway := target{
		name:   "through gateway",
		url:    base + "/api/v1/responses",
		body:   []byte(`{"prompt":"` + prompt + `","max_output_rungs":200}`),
		header: http.Header{"Authorization": {"Bearer " + key}},
	}

	fmt.Printf("gateway vs. upstream direct, open loop, %s per rate (after %s warm-up), %d cores\n\n", duration, warmup, runtime.NumCPU())
	fmt.Println("| rate (req/s) | target | achieved req/s | errors | p50 | p90 | p99 |")
	fmt.Println("|---|---|---|---|---|---|---|")
	for _, field := range strings.Split(rateList, ",") {
		rate, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || rate <= 0 {
			return fmt.Errorf("bad rate %q", field)
		}
		var results [2]result
		for i, t := range []target{direct, viaGateway} {
			drive(client, t, rate, warmup)
			results[i] = drive(client, t, rate, duration)
			fmt.Printf("| %d | %s | %.0f | %d | %s | %s | %s |\n", rate, t.name, results[i].achieved, results[i].errors,
				ms(results[i].pct(50)), ms(results[i].pct(90)), ms(results[i].pct(99)))
		}
		fmt.Printf("| %d | **added by gateway** | | | %s | %s | %s |\n", rate,
			ms(results[1].pct(50)-results[0].pct(50)), ms(results[1].pct(90)-results[0].pct(90)), ms(results[1].pct(99)-results[0].pct(99)))
	}
	return nil
}

type target struct {
	name   string
	url    string
	body   []byte
	header http.Header
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
func drive(client *http.Client, t target, rate int, d time.Duration) result {
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
			req, _ := http.NewRequest(http.MethodPost, t.url, bytes.NewReader(t.body))
			req.Header.Set("Content-Type", "application/json")
			for k, v := range t.header {
				req.Header[k] = v
			}
			begin := time.Now()
			resp, err := client.Do(req)
			ok := err == nil && resp.StatusCode == http.StatusOK
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
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
	res.achieved = float64(len(res.latencies)) / time.Since(startAll).Seconds()
	slices.Sort(res.latencies)
	return res
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }
