// Command stream measures streaming: the first-token overhead of the gateway
// over the same fake upstream streamed directly, beside a bare proxy's (the
// floor of that run: bench/internal/floor), and the gateway's memory with
// many concurrent idle streams (each waiting on a silent upstream, with
// keep-alives running).
package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
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
	"syscall"
	"time"

	"github.com/rungworks/gateway/bench/internal/benchenv"
	"github.com/rungworks/gateway/bench/internal/floor"
	"github.com/rungworks/gateway/internal/fakeupstream"
)

func main() {
	floor.ServeIfAsked()
	binary := flag.String("binary", "bin/gateway", "gateway binary")
	requests := flag.Int("requests", 1000, "sequential streams for the first-token measurement (0: not measured)")
	warmup := flag.Int("warmup", 1000, "sequential streams before the first-token measurement, not counted")
	idle := flag.Int("idle", 10000, "concurrent idle streams for the memory measurement (0: not measured)")
	release := flag.Duration("release", time.Minute, "how long to follow RSS after the idle streams close")
	flag.Parse()
	if err := run(*binary, *warmup, *requests, *idle, *release); err != nil {
		fmt.Fprintln(os.Stderr, "stream:", err)
		os.Exit(1)
	}
}

func run(binary string, warmup, requests, idle int, release time.Duration) error {
	if warmup < 0 || requests < 0 || idle < 0 {
		return fmt.Errorf("bad warm-up %d, request count %d or idle stream count %d", warmup, requests, idle)
	}
	// An idle stream costs two descriptors in the gateway (client and upstream
	// connections) and two here (client, and the fake upstream's server side).
	// Raise the soft limit to the hard one; fit the streams under it.
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("raising the open-file limit: %w", err)
	}
	// Over HTTP/2 both ways streams share a few connections; otherwise each
	// costs a descriptor or two.
	fitting := idle
	if fit := int(lim.Max-1024) / 2; idle > fit {
		fmt.Printf("open-file limit %d: measuring %d idle streams instead of %d where each needs a connection\n\n", lim.Max, fit, idle)
		fitting = fit
	}
	env, err := benchenv.Start(binary)
	if err != nil {
		return err
	}
	defer env.Close()
	if requests > 0 {
		if err := firstToken(env, warmup, requests); err != nil {
			return err
		}
	}
	if idle == 0 {
		return nil
	}
	for _, p := range []protocols{{}, {upstream: true}, {upstream: true, tls: true}, {upstream: true, inbound: true}} {
		n := fitting
		if p.inbound {
			n = idle
		}
		if err := idleStreams(env, n, p, release); err != nil {
			return err
		}
	}
	return nil
}

// protocols says where HTTP/2 without TLS (h2c) is spoken: from the gateway to
// the upstream, and from the clients (a load balancer) to the gateway; and
// whether the clients speak HTTP/1.1 over TLS (GATEWAY_TLS_CERT).
type protocols struct{ upstream, inbound, tls bool }

func (p protocols) String() string {
	switch {
	case p.tls:
		return "HTTP/1.1 over TLS from the clients (GATEWAY_TLS_CERT), HTTP/2 upstream (h2c)"
	case p.inbound:
		return "HTTP/2 both ways (h2c from the clients, as a load balancer would, and to the upstream)"
	case p.upstream:
		return "HTTP/2 upstream (h2c, calls multiplexed)"
	}
	return "HTTP/1.1 upstream (a connection per call)"
}

// firstToken times n sequential streams, directly, through the bare proxy
// and through the gateway in turn, after warmup of each that are not
// counted: the replica's first requests fill its connection pools, caches
// and the tokenizer's tables.
func firstToken(env *benchenv.Env, warmup, n int) error {
	defer env.StopServers()
	fake := fakeupstream.New()
	defer fake.Close()
	vars, key, err := env.Fresh("first_token", fake.BaseURL())
	if err != nil {
		return err
	}
	base, err := env.Serve(vars)
	if err != nil {
		return err
	}
	prompt := "stream a short answer about rungs"
	direct := func() (*http.Request, string) {
		req, _ := http.NewRequest(http.MethodPost, fake.BaseURL()+"/chat/completions",
			strings.NewReader(`{"model":"instant","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":100,"messages":[{"role":"user","content":"`+prompt+`"}]}`))
		return req, `"content":"echo`
	}
	body := `{"stream":true,"max_output_rungs":100,"prompt":"` + prompt + `"}`
	gateway := func() (*http.Request, string) {
		req, _ := http.NewRequest(http.MethodPost, base+"/api/v1/responses", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		return req, "event: response.output_text.delta"
	}
	bare, err := floor.Start(vars, fake.BaseURL())
	if err != nil {
		return err
	}
	defer bare.Stop()
	// The bare proxy passes the upstream's events on as they are.
	viaFloor := func() (*http.Request, string) {
		req, _ := http.NewRequest(http.MethodPost, bare.Base+"/", strings.NewReader(body))
		return req, `"content":"echo`
	}
	targets := []struct {
		name  string
		build func() (*http.Request, string)
	}{{"upstream direct", direct}, {"through a bare proxy", viaFloor}, {"through gateway", gateway}}
	client := &http.Client{}
	results := make([][]time.Duration, len(targets))
	for i := 0; i < warmup+n; i++ {
		for j, t := range targets {
			req, marker := t.build()
			req.Header.Set("Content-Type", "application/json")
			d, err := timeToMarker(client, req, marker)
			if err != nil {
				return err
			}
			if i >= warmup {
				results[j] = append(results[j], d)
			}
		}
	}
	fmt.Printf("first token, %d sequential streams each after %d not counted, %d cores\n\n", n, warmup, runtime.NumCPU())
	fmt.Println("| target | p50 | p90 | p99 |")
	fmt.Println("|---|---|---|---|")
	for j, t := range targets {
		slices.Sort(results[j])
		fmt.Printf("| %s | %s | %s | %s |\n", t.name, ms(pct(results[j], 50)), ms(pct(results[j], 90)), ms(pct(results[j], 99)))
	}
	upstream := results[0]
	for j, t := range targets[1:] {
		r := results[j+1]
		fmt.Printf("| **%s** | %s | %s | %s |\n", benchenv.AddedBy(t.name), ms(pct(r, 50)-pct(upstream, 50)), ms(pct(r, 90)-pct(upstream, 90)), ms(pct(r, 99)-pct(upstream, 99)))
	}
	fmt.Println()
	return nil
}

// timeToMarker times a request until a line containing marker arrives.
func timeToMarker(client *http.Client, req *http.Request, marker string) (time.Duration, error) {
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.Contains(sc.Text(), marker) {
			d := time.Since(start)
			_, _ = io.Copy(io.Discard, resp.Body)
			return d, nil
		}
	}
	return 0, fmt.Errorf("no %q in the stream of %s", marker, req.URL)
}

func idleStreams(env *benchenv.Env, n int, p protocols, release time.Duration) error {
	defer env.StopServers()
	fake := fakeupstream.New()
	defer fake.Close()
	vars, key, err := env.Fresh(fmt.Sprintf("idle_streams_%v_%v_%v", p.upstream, p.inbound, p.tls), fake.BaseURL(), "GATEWAY_SSE_KEEPALIVE=5s", "GATEWAY_UPSTREAM_TIMEOUT=10m",
		fmt.Sprintf("GATEWAY_UPSTREAM_H2C=%v", p.upstream), fmt.Sprintf("GATEWAY_H2C=%v", p.inbound))
	if err != nil {
		return err
	}
	transport := &http.Transport{MaxIdleConnsPerHost: -1}
	if p.tls {
		dir, err := os.MkdirTemp("", "gateway-bench-tls-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		served, err := benchenv.TLS(dir)
		if err != nil {
			return err
		}
		vars = append(vars, served...)
		transport.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} // the benchmark's own certificate
	}
	gateway, err := env.ServeProcess(vars)
	if err != nil {
		return err
	}
	base, pid := gateway.Base, gateway.PID
	if p.inbound {
		transport.Protocols = new(http.Protocols)
		transport.Protocols.SetUnencryptedHTTP2(true)
	}
	client := &http.Client{Transport: transport}
	body := []byte(`{"stream":true,"prompt":"wait with me","max_output_rungs":100}`)
	// Idle is a replica that has served: a few streams to the end first, so
	// that what it builds on first use (the tokenizer's tables) is counted in
	// its idle size, not against the streams.
	for range 10 {
		if err := drain(client, base, key, body); err != nil {
			return err
		}
	}
	fake.SetDelay(time.Hour) // from now on the upstream never answers: every stream stays idle
	time.Sleep(time.Second)
	before, err := rss(pid)
	if err != nil {
		return err
	}
	anonBefore, err := anonymous(pid)
	if err != nil {
		return err
	}
	statsBefore, err := runtimeStats(gateway.Metrics)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	var open []io.Closer
	sem := make(chan struct{}, 200)
	var wg sync.WaitGroup
	var failures int
	start := time.Now()
	for range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			req, _ := http.NewRequest(http.MethodPost, base+"/api/v1/responses", bytes.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil || resp.StatusCode != http.StatusOK {
				failures++
				return
			}
			open = append(open, resp.Body)
		}()
	}
	wg.Wait()
	opened := time.Since(start)
	// Wait until the gateway holds every upstream call too.
	for deadline := time.Now().Add(60 * time.Second); len(fake.Calls()) < len(open) && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	after, err := rss(pid)
	if err != nil {
		return err
	}
	fmt.Printf("idle streams, %s: %d open (%d failed) in %s, %d upstream calls held\n\n", p, len(open), failures, opened.Round(time.Millisecond), len(fake.Calls()))
	perStream := float64(after-before) / float64(max(1, len(open)))
	for _, c := range open {
		c.Close()
	}
	// How long until the memory of the closed streams is given back.
	closed := time.Now()
	var released, anonReleased int64
	back := time.Duration(-1)
	for time.Since(closed) < release {
		time.Sleep(time.Second)
		if released, err = rss(pid); err != nil {
			return err
		}
		if anonReleased, err = anonymous(pid); err != nil {
			return err
		}
		if back < 0 && float64(released) <= 1.2*float64(before) {
			back = time.Since(closed)
		}
	}
	statsAfter, err := runtimeStats(gateway.Metrics)
	if err != nil {
		return err
	}
	within := "not within " + release.String()
	if back >= 0 {
		within = back.Round(time.Second).String()
	}
	fmt.Printf("| gateway RSS idle (anonymous) | RSS with the streams open | per stream | projected for 10,000 | RSS %s after closing (anonymous) | RSS back within 20%% of idle |\n", release)
	fmt.Println("|---|---|---|---|---|---|")
	fmt.Printf("| %.1f MiB (%.1f) | %.1f MiB | %.1f KiB | %.0f MiB | %.1f MiB (%.1f) | %s |\n\n", mib(before), mib(anonBefore), mib(after), perStream/1024,
		mib(before+int64(perStream*10000)), mib(released), mib(anonReleased), within)
	printRuntimeStats(statsBefore, statsAfter, release)
	return nil
}

// memStats are the runtime's accounts of its memory (runtime.MemStats, as the
// gateway's /metrics exports them), in the order printed.
var memStats = []struct{ metric, name string }{
	{"go_memstats_other_sys_bytes", "OtherSys (the runtime's own: poll descriptors, ...)"},
	{"go_memstats_heap_inuse_bytes", "HeapInuse (spans with objects)"},
	{"go_memstats_heap_alloc_bytes", "HeapAlloc (objects, live or not yet collected)"},
	{"go_memstats_mspan_sys_bytes", "MSpanSys (span structures)"},
	{"go_memstats_stack_inuse_bytes", "StackInuse"},
	{"go_memstats_gc_sys_bytes", "GCSys (the collector's metadata)"},
}

// printRuntimeStats prints what the runtime holds idle and after the streams
// closed: where the RSS that stays goes.
func printRuntimeStats(before, after map[string]float64, release time.Duration) {
	fmt.Printf("| runtime.MemStats | idle | %s after closing | kept |\n", release)
	fmt.Println("|---|---|---|---|")
	for _, m := range memStats {
		fmt.Printf("| %s | %.1f MB | %.1f MB | %.1f MB |\n", m.name, before[m.metric]/1e6, after[m.metric]/1e6, (after[m.metric]-before[m.metric])/1e6)
	}
	fmt.Println()
}

// runtimeStats reads the go_memstats_ figures of a gateway's metrics.
func runtimeStats(url string) (map[string]float64, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, fmt.Errorf("error reading the gateway's metrics: %w", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("error reading the gateway's metrics: %w", err)
	}
	stats := map[string]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		name, value, ok := strings.Cut(line, " ")
		if !ok || !strings.HasPrefix(name, "go_memstats_") {
			continue
		}
		if stats[name], err = strconv.ParseFloat(value, 64); err != nil {
			return nil, fmt.Errorf("error reading metric %s: %w", name, err)
		}
	}
	for _, m := range memStats {
		if _, ok := stats[m.metric]; !ok {
			return nil, fmt.Errorf("the gateway's metrics have no %s", m.metric)
		}
	}
	return stats, nil
}

// drain makes one streamed request and reads it to the end.
func drain(client *http.Client, base, key string, body []byte) error {
	req, _ := http.NewRequest(http.MethodPost, base+"/api/v1/responses", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return err
}

// rss is a process's resident set size in bytes.
func rss(pid int) (int64, error) { return status(pid, "VmRSS:") }

// anonymous is the part of a process's resident set that is its own memory
// (not pages of its executable and other files, which the kernel may drop).
func anonymous(pid int) (int64, error) { return status(pid, "RssAnon:") }

// status reads a size in kB from a process's /proc status, in bytes.
func status(pid int, field string) (int64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, field); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, fmt.Errorf("no %s for process %d", field, pid)
}

func pct(sorted []time.Duration, p int) time.Duration {
	return sorted[(len(sorted)-1)*p/100]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }

func mib(b int64) float64 { return float64(b) / (1 << 20) }
