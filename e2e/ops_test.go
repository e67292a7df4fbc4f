package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/testdb"
)

// scrape is the replica's metrics.
func (g *gateway) scrape() string {
	g.t.Helper()
	return g.getMetricsListener("/metrics")
}

// goroutineProfile is the replica's goroutines, counted by stack, from the
// metrics listener's /debug/pprof/ (GATEWAY_PPROF).
func (g *gateway) goroutineProfile() string {
	g.t.Helper()
	return g.getMetricsListener("/debug/pprof/goroutine?debug=1")
}

// goroutines is how many goroutines the replica runs, its goroutine
// profile's total. The profile's request adds its own alike each time (its
// connection's and that connection's background read), where a scrape's
// go_goroutines counts the registry's collecting goroutines too, more or
// fewer by how the collectors happen to be scheduled.
func (g *gateway) goroutines() float64 {
	g.t.Helper()
	profile := g.goroutineProfile()
	total, _, _ := strings.Cut(strings.TrimPrefix(profile, "goroutine profile: total "), "\n")
	n, err := strconv.Atoi(total)
	require.NoError(g.t, err, "a goroutine profile begins with its total: %.80q", profile)
	return float64(n)
}

// metricsClient asks the metrics listener on a connection of its own each
// time, closed after the reply: no idle connection of a request before,
// with its goroutine in the replica, is there when the goroutines are
// counted.
var metricsClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// getMetricsListener is the body of a 200 to a GET of path on the replica's
// metrics listener.
func (g *gateway) getMetricsListener(path string) string {
	g.t.Helper()
	resp, err := metricsClient.Get(g.metrics + path)
	require.NoError(g.t, err)
	defer resp.Body.Close()
	require.Equal(g.t, http.StatusOK, resp.StatusCode)
	raw, err := io.ReadAll(resp.Body)
	require.NoError(g.t, err)
	return string(raw)
}

// TestTheBuildIsToldAlike: the version and revision the binary was linked
// with (as the image's build links them) are what gateway --version prints,
// what gateway_build_info exports and what the start's line says.
func TestTheBuildIsToldAlike(t *testing.T) {
	t.Parallel()
	out, err := cliWith(t, map[string]string{}, "--version")
	require.NoError(t, err)
	require.Equal(t, "gateway version "+builtVersion+" (revision "+builtRevision+", "+runtime.Version()+")\n", out)
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	require.Contains(t, g.scrape(), `gateway_build_info{revision="`+builtRevision+`",version="`+builtVersion+`"} 1`)
	line := waitForLine(t, g.stderr, `"msg":"gateway listening"`)
	require.Contains(t, line, `"version":"`+builtVersion+`","revision":"`+builtRevision+`"`)
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p", "model": "reasoning"}).status)
	g.stream(b.key, map[string]any{"prompt": "s"})
	g.call(http.MethodGet, "/api/v1/usage", "igw_nope", nil)
	batch := g.createBatch(b.key, prompts("metrics", 3))
	g.waitTerminal(b.key, batch.Id.String(), 30*time.Second)

	require.Eventually(t, func() bool {
		m := g.scrape()
		for _, want := range []string{
			`gateway_http_requests_total{method="POST",route="/api/v1/responses",status="200"} 2`,
			`gateway_http_requests_total{method="GET",route="/api/v1/usage",status="401"} 1`,
			`gateway_http_request_duration_seconds_bucket{method="POST",route="/api/v1/batch"`,
			`gateway_rungs_total{entry_point="responses",model="reasoning",side="input"}`,
			`gateway_rungs_total{entry_point="batch",model="instant",side="output"}`,
			`gateway_upstream_request_duration_seconds_count{model="instant",outcome="ok"}`,
			`gateway_open_streams 0`,
			`gateway_batch_items_total{outcome="completed"} 3`,
			`gateway_batch_claim_duration_seconds_count`,
			`gateway_group_commit_duration_seconds_count{work="settlement"} 2`,
			`gateway_group_commit_size_sum{work="batch_outcomes"} 3`,
			`gateway_group_commit_size_sum{work="batch_creations"} 1`,
			`gateway_batch_queue_depth`,
			`gateway_notifications_listening{listener="keys"} 1`,
			`gateway_notifications_listening{listener="batches"} 1`,
			`gateway_db_connections_max 8`,
			`process_resident_memory_bytes`,
		} {
			if !strings.Contains(m, want) {
				t.Logf("missing %s", want)
				return false
			}
		}
		return true
	}, 10*time.Second, 200*time.Millisecond)
	m := g.scrape()
	require.Positive(t, metricValue(t, m, `gateway_http_request_duration_seconds_sum{method="POST",route="/api/v1/batch"}`), "requests are timed")
	require.Positive(t, metricValue(t, m, "gateway_batch_claim_duration_seconds_count"), "claims are timed")
	require.Positive(t, metricValue(t, m, "gateway_db_acquires_total"), "the pool's acquires are counted")
	require.Positive(t, metricValue(t, m, `gateway_db_connections{state="idle"}`)+metricValue(t, m, `gateway_db_connections{state="acquired"}`), "the pool's connections are counted")
}

// TestMetricsListenerOff: with GATEWAY_METRICS_LISTEN=off a replica serves
// without a metrics listener.
func TestMetricsListenerOff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_METRICS_LISTEN": "off"})
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"}).status)
	require.NotContains(t, g.stderr.String(), `"msg":"metrics listening"`)
}

// TestAMisspeltSettingIsWarnedOf: a variable named as the settings are that
// the gateway does not read (a typo) is a warning at a replica's start,
// naming the setting it likely means, and in the configuration's check;
// the variables Kubernetes sets for a service named gateway are not.
func TestAMisspeltSettingIsWarnedOf(t *testing.T) {
	t.Parallel()
	b := setup(t)
	strays := map[string]string{"GATEWAY_DRAIN_CONCURENCY": "4", "GATEWAY_SERVICE_HOST": "10.0.0.7", "GATEWAY_PORT": "tcp://10.0.0.7:8080"}
	g := serve(t, b.db, b.fake.BaseURL(), strays)
	require.Contains(t, g.stderr.String(), `"level":"WARN","msg":"a variable named as the gateway's settings is no setting: ignored","variable":"GATEWAY_DRAIN_CONCURENCY","did_you_mean":"GATEWAY_DRAIN_CONCURRENCY"}`)
	require.Equal(t, 1, strings.Count(g.stderr.String(), "is no setting"), "Kubernetes's variables are no typos")

	_, stderr, err := cliIn(t, "", strays, "config", "check")
	require.NoError(t, err, "a warning, not a failure")
	require.Equal(t, "warning: GATEWAY_DRAIN_CONCURENCY is no setting of the gateway's: ignored (GATEWAY_DRAIN_CONCURRENCY?)\n", stderr)
}

// TestRollingRestartLosesNothing restarts one of two replicas with SIGTERM
// while both drain a batch and serve interactive requests: every item completes
// (none INTERRUPTED), each prompt reaches the upstream once, and the requests
// in flight on the stopping replica are answered.
func TestRollingRestartLosesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(300 * time.Millisecond)
	// Streams outlive the drain delay: shutdown must wait for them.
	b.fake.SetSlow("streamed in flight", 2*time.Second)
	env := map[string]string{"GATEWAY_DRAIN_CONCURRENCY": "4", "GATEWAY_SHUTDOWN_GRACE": "20s", "GATEWAY_DRAIN_DELAY": "200ms"}
	stopping := serve(t, b.db, b.fake.BaseURL(), env)
	staying := serve(t, b.db, b.fake.BaseURL(), env)
	batch := staying.createBatch(b.key, prompts("rolling", 40))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) >= 6 }, 10*time.Second, 10*time.Millisecond)

	// Interactive requests in flight on the replica about to stop.
	var wg sync.WaitGroup
	statuses := make([]int, 3)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i] = stopping.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "in flight"}).status
		}()
	}
	// And streams, which the replica serves off their connections' goroutines.
	streams := streamsUntilEnd(t, stopping, b.key, "streamed in flight", 2)
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, stopping.cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, <-stopping.done, "a clean exit: %s", stopping.stderr.String())
	stopping.done <- nil
	wg.Wait()
	for _, s := range statuses {
		require.Equal(t, http.StatusOK, s, "requests in flight at SIGTERM are answered")
	}
	for _, body := range streams() {
		require.Contains(t, string(body), "event: response.completed", "streams in flight at SIGTERM finish")
		require.NotContains(t, string(body), "event: response.error")
	}

	restarted := serve(t, b.db, b.fake.BaseURL(), env)
	res := restarted.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchStatus("completed"), res.Status)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status, "item %d: %+v", it.Index, it.Error)
	}
	for p, n := range callsPerPrompt(b.fake) {
		if p != "in flight" && p != "streamed in flight" {
			require.Equal(t, 1, n, "prompt %q reached the upstream %d times", p, n)
		}
	}
}

// TestStopWaitsForBatchItemsInFlight: a replica stopped while it runs batch
// items and nothing else exits once they have finished and been stored,
// within its grace: none is left to be rescued as INTERRUPTED.
func TestStopWaitsForBatchItemsInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetDelay(2 * time.Second)
	env := map[string]string{"GATEWAY_DRAIN_CONCURRENCY": "2", "GATEWAY_SHUTDOWN_GRACE": "20s", "GATEWAY_DRAIN_DELAY": "0s", "GATEWAY_LEASE": "2s"}
	stopping := serve(t, b.db, b.fake.BaseURL(), env)
	batch := stopping.createBatch(b.key, prompts("in flight at the stop", 2))
	require.Eventually(t, func() bool { return len(b.fake.Calls()) == 2 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, stopping.stop())

	b.fake.SetDelay(0)
	res := serve(t, b.db, b.fake.BaseURL(), env).waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	for _, it := range res.Results {
		require.Equal(t, api.BatchItemStatus("completed"), it.Status, "item %d: %+v", it.Index, it.Error)
	}
	require.Len(t, b.fake.Calls(), 2, "each ran once, on the replica that stopped")
}

// TestASecondSignalEndsTheGrace: a replica asked to stop lets the work in
// flight finish for its grace (two minutes here, the first 50 s of it the
// drain delay); asked again (a second SIGTERM, or Ctrl-C pressed again), it
// ends the grace, its drain delay with it, at once, as the grace's end would
// have: a JSON reply waiting on its call gets 503
// INFERENCE_BUSY, a stream response.error then response.completed, a batch
// item at the upstream fails INTERRUPTED (never sent again), and the
// replica exits.
func TestASecondSignalEndsTheGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetSlow("held", 10*time.Minute)
	b.fake.SetHostile("open stream", fakeupstream.Hostile{Content: "first words", KeepAlive: 20 * time.Millisecond})
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_SHUTDOWN_GRACE": "2m", "GATEWAY_DRAIN_DELAY": "50s"})
	batch := g.createBatch(b.key, prompts("held", 1))
	type answer struct {
		resp *http.Response
		err  error
	}
	replied := make(chan answer, 1)
	req := responsesRequest(t, context.Background(), g, b.key, `{"prompt":"held reply"}`)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		replied <- answer{resp, err}
	}()
	streamed := streamsUntilEnd(t, g, b.key, "open stream", 1)
	require.Eventually(t, func() bool { return b.fake.InFlight() == 3 }, 10*time.Second, 10*time.Millisecond, "the item, the reply and the stream are at the upstream")

	require.NoError(t, g.cmd.Process.Signal(syscall.SIGTERM))
	waitForLine(t, g.stderr, "shutting down")
	select {
	case err := <-g.done:
		t.Fatalf("exited within the grace, with its work in flight: %v", err)
	case <-time.After(time.Second):
	}
	require.NoError(t, g.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-g.done:
		require.NoError(t, err, "a clean exit")
		g.done <- err
	case <-time.After(30 * time.Second):
		t.Fatal("still running 30 s after it was asked again to stop")
	}
	require.Contains(t, g.stderr.String(), "asked again to stop: the grace period ends now")

	a := <-replied
	require.NoError(t, a.err, "the reply was answered")
	defer a.resp.Body.Close()
	body, err := io.ReadAll(a.resp.Body)
	require.NoError(t, err)
	r := reply{status: a.resp.StatusCode, body: body}
	require.Equal(t, http.StatusServiceUnavailable, r.status, string(r.body))
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	events := string(streamed()[0])
	require.Contains(t, events, "first words")
	require.Contains(t, events, "INFERENCE_BUSY")
	require.Less(t, strings.Index(events, "event: response.error"), strings.Index(events, "event: response.completed"))

	res := serve(t, b.db, b.fake.BaseURL(), nil).waitTerminal(b.key, batch.Id.String(), 30*time.Second)
	require.Equal(t, api.BatchItemStatus("failed"), res.Results[0].Status)
	require.Equal(t, api.ErrorCode("INTERRUPTED"), res.Results[0].Error.Code)
	require.Len(t, b.fake.Calls(), 3, "the item was not sent again")
}

// TestStopWaitsForSettlementsSentWithTheirUsage: a JSON reply whose
// settlement was lost on its way (the network cut the replica's connections
// to PostgreSQL) and whose database stayed away for the settle window is
// sent with its usage (D12), and its settlement is sent again in the
// background. At SIGTERM the replica waits the final window (5 s) for it: a
// database back within it stores the request once before the exit; one that
// stays away has the request logged, with its usage, as maybe missing.
func TestStopWaitsForSettlementsSentWithTheirUsage(t *testing.T) {
	t.Parallel()
	for _, back := range []bool{true, false} {
		t.Run(fmt.Sprintf("database back=%v", back), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			pool, proxy := testdb.Cuttable(t, b.db)
			u, err := url.Parse(b.db)
			require.NoError(t, err)
			dbHost := u.Host
			g := serve(t, pool.Config().ConnString(), b.fake.BaseURL(), nil)
			before := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "before"}), http.StatusOK)

			b.fake.SetSlow("lost", 300*time.Millisecond) // its settlement goes on a connection used within a second: not pinged first

			refused := "127.0.0.1:1" // where nothing listens
			cut := make(chan int, 1)
			go func() {
				for deadline := time.Now().Add(10 * time.Second); b.fake.InFlight() == 0 && time.Now().Before(deadline); {
					time.Sleep(5 * time.Millisecond)
				}
				proxy.Retarget(refused)
				cut <- proxy.Cut()
			}()
			lost := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "lost"}), http.StatusOK)
			require.Positive(t, <-cut, "the replica's connections were cut while the call was out")
			pt, ct := fakeupstream.Usage("lost")
			require.Equal(t, int64(pt+ct), lost.Usage.TotalRungs, "sent with its usage")
			waitForLine(t, g.stderr, "a settlement's reply was lost")

			require.NoError(t, g.cmd.Process.Signal(syscall.SIGTERM))
			waitForLine(t, g.stderr, "shutting down")
			if back {
				time.Sleep(time.Second)
				proxy.Retarget(dbHost)
				proxy.Drop()
			}
			require.NoError(t, <-g.done, "a clean exit")
			g.done <- nil
			if back {
				require.Contains(t, waitForLine(t, g.stderr, "a settlement sent with its usage is stored"), lost.RequestId.String())
			} else {
				waitForLine(t, g.stderr, "still unconfirmed at the end of the shutdown")
				line := waitForLine(t, g.stderr, "its usage may be missing")
				require.Contains(t, line, lost.RequestId.String())
				require.Contains(t, line, fmt.Sprintf(`"total_rungs":%d`, lost.Usage.TotalRungs))
				proxy.Retarget(dbHost)
				proxy.Drop()
			}

			usage := serve(t, b.db, b.fake.BaseURL(), nil).usage(b.key)
			if back {
				require.EqualValues(t, 2, usage.Totals.Requests, "stored once")
				require.Equal(t, before.Usage.TotalRungs+lost.Usage.TotalRungs, usage.Totals.TotalRungs)
			} else {
				require.EqualValues(t, 1, usage.Totals.Requests, "its settlement never reached the database")
				require.Equal(t, before.Usage.TotalRungs, usage.Totals.TotalRungs)
			}
		})
	}
}

// TestNothingIsLeftRunningAfterRequests sends a replica, over HTTP/1.1 and
// over HTTP/2 (GATEWAY_H2C), rounds of what a replica in production meets:
// replies and streams served (detached from their connections' goroutines,
// past 100 ms), a reply and a stream whose upstream fails (an
// error status, a stream broken midway), clients that leave a reply and a
// stream they wait on, a batch run and one cancelled while it runs, and
// refusals. After each round, once its calls have ended and the clients'
// connections are closed, the replica runs no more goroutines and holds no
// more database connections than after the first (which started its pools
// and beats): one left behind by any of them would add one a round. A
// failure shows the replica's goroutines by stack after the first round and
// then (its /debug/pprof/, GATEWAY_PPROF), to tell which were left.
func TestNothingIsLeftRunningAfterRequests(t *testing.T) {
	t.Parallel()
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("HTTP/2=%v", h2), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_H2C": strconv.FormatBool(h2), "GATEWAY_DRAIN_CONCURRENCY": "2", "GATEWAY_PPROF": "true"})
			transport := &http.Transport{Protocols: new(http.Protocols)}
			transport.Protocols.SetHTTP1(!h2)
			transport.Protocols.SetUnencryptedHTTP2(h2)
			g.client = &http.Client{Transport: transport}
			b.fake.SetHostile("choked", fakeupstream.Hostile{Status: http.StatusInternalServerError})
			b.fake.SetHostile("left", fakeupstream.Hostile{Content: "first words", KeepAlive: 20 * time.Millisecond})
			b.fake.SetSlow("held", time.Minute)
			b.fake.SetSlow("cancelled", 300*time.Millisecond)

			round := func(i int) {
				respond := func(prompt string) int {
					return g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt}).status
				}
				require.Equal(t, http.StatusOK, respond(fmt.Sprint("served ", i)))
				require.Equal(t, http.StatusServiceUnavailable, respond("choked"))
				b.fake.SetChunkDelay(60 * time.Millisecond) // past the 100 ms after which a stream is detached
				g.stream(b.key, map[string]any{"prompt": fmt.Sprint("streamed ", i)})
				b.fake.SetChunkDelay(0)
				b.fake.SetBreakAfter(1)
				_, broken := g.stream(b.key, map[string]any{"prompt": fmt.Sprint("broken ", i)})
				b.fake.SetBreakAfter(0)
				require.GreaterOrEqual(t, len(broken.Events), 2)
				require.Equal(t, "response.error", broken.Events[len(broken.Events)-2].Name)

				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				_, err := g.client.Do(responsesRequest(t, ctx, g, b.key, `{"prompt":"held"}`))
				cancel()
				require.ErrorIs(t, err, context.DeadlineExceeded, "the client left the reply it waited on")
				ctx, cancel = context.WithCancel(context.Background())
				resp, err := g.client.Do(responsesRequest(t, ctx, g, b.key, `{"prompt":"left","stream":true}`))
				require.NoError(t, err)
				for sc := bufio.NewScanner(resp.Body); sc.Scan() && !strings.Contains(sc.Text(), "first words"); {
				}
				time.Sleep(300 * time.Millisecond) // detached meanwhile
				cancel()
				resp.Body.Close()

				g.waitTerminal(b.key, g.createBatch(b.key, prompts(fmt.Sprint("run ", i), 3)).Id.String(), 30*time.Second)
				cancelled := g.createBatch(b.key, prompts("cancelled", 10))
				require.Eventually(t, func() bool { return b.fake.InFlight() > 0 }, 10*time.Second, 10*time.Millisecond)
				require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/batch/"+cancelled.Id.String()+"/cancel", b.key, nil).status)
				require.Equal(t, api.BatchStatusCancelled, g.waitTerminal(b.key, cancelled.Id.String(), 30*time.Second).Status)

				require.Equal(t, http.StatusBadRequest, respond(""))
				require.Equal(t, http.StatusUnauthorized, g.call(http.MethodGet, "/api/v1/usage", "", nil).status)
				require.Equal(t, http.StatusNotFound, g.call(http.MethodGet, "/api/v1/batch/"+cancelled.Id.String()+"0", b.key, nil).status)

				require.Eventually(t, func() bool { return b.fake.InFlight() == 0 }, 20*time.Second, 10*time.Millisecond, "the calls of the clients that left ended")
				transport.CloseIdleConnections()
			}
			// What a round may leave behind: goroutines, and database
			// connections held (the listeners hold theirs for good).
			left := func() (goroutines, acquired float64) {
				return g.goroutines(), metricValue(t, g.scrape(), `gateway_db_connections{state="acquired"}`)
			}

			round(0)
			time.Sleep(time.Second)
			goroutines, acquired := left()
			require.Positive(t, goroutines)
			first := g.goroutineProfile()
			for i := 1; i <= 3; i++ {
				round(i)
				if !assert.Eventually(t, func() bool {
					transport.CloseIdleConnections() // any that went idle since the round's end
					g, a := left()
					return g <= goroutines && a <= acquired
				}, 30*time.Second, 100*time.Millisecond) {
					nowG, nowA := left()
					t.Fatalf("round %d left goroutines running or connections held: %v and %v, %v and %v after the first\nafter the first:\n%s\nnow:\n%s",
						i, nowG, nowA, goroutines, acquired, first, g.goroutineProfile())
				}
			}
		})
	}
}

// TestAReplicaWhoseLogReaderLeftServesOn: a replica whose standard error's
// reader goes away (a log shipper restarted: a broken pipe) serves on,
// replies, streams and batches, counts the lines it loses in its metrics,
// and stops as asked, instead of being killed by SIGPIPE at its next line.
func TestAReplicaWhoseLogReaderLeftServesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := servePiped(t, b.db, b.fake.BaseURL())
	respond := func(prompt string) int {
		return g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt}).status
	}
	require.Equal(t, http.StatusOK, respond("heard"))
	require.Zero(t, metricValue(t, g.scrape(), "gateway_log_lines_lost_total"))

	require.NoError(t, g.logReader.Close())
	lost := 0.0
	for i := 0; lost == 0 && i < 500; i++ {
		require.Equal(t, http.StatusOK, respond("unheard"), "each request logs a line")
		time.Sleep(20 * time.Millisecond) // the lines of a few milliseconds go out together
		lost = metricValue(t, g.scrape(), "gateway_log_lines_lost_total")
	}
	require.Positive(t, lost, "the lines written once the reader left are counted lost")
	_, stream := g.stream(b.key, map[string]any{"prompt": "streamed unheard"})
	require.Equal(t, "response.completed", stream.Events[len(stream.Events)-1].Name)
	require.Equal(t, api.BatchStatusCompleted, g.waitTerminal(b.key, g.createBatch(b.key, prompts("batched unheard", 3)).Id.String(), 30*time.Second).Status)
	require.NoError(t, g.stop(), "it stops as asked, on SIGTERM, not killed")
}

// TestAReplicaWhoseLogReaderStallsServesOn: a replica whose standard error's
// reader stops reading (a log shipper stuck: its pipe full) serves on,
// keeping the lines meanwhile, which go out once the reader reads again; and
// one asked to stop while its reader is stalled exits without them.
func TestAReplicaWhoseLogReaderStallsServesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := servePiped(t, b.db, b.fake.BaseURL())
	g.client = &http.Client{Timeout: time.Minute} // a request held up by the stalled log fails
	accessLines := func() int { return strings.Count(g.stderr.String(), `"route":"/api/v1/responses"`) }
	const stalled = 200 // access lines of some 450 bytes each: past the 64 KiB a pipe holds
	sendReplies := func(round string) {
		for i := range stalled {
			require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": fmt.Sprint(round, i)}).status)
		}
	}

	release := g.holdLogs()
	defer release()
	sendReplies("stalled ")
	require.Less(t, accessLines(), stalled, "the reader held, the pipe filled")
	release()
	require.Eventually(t, func() bool { return accessLines() == stalled }, 10*time.Second, 20*time.Millisecond,
		"the lines kept went out once the reader read again")
	require.Zero(t, metricValue(t, g.scrape(), "gateway_log_lines_lost_total"))

	release = g.holdLogs()
	defer release()
	sendReplies("stalled again ")
	require.NoError(t, g.stop(), "asked to stop, it exits, its stalled lines given up")
}

// responsesRequest is a POST of body to g's responses route with key, bound
// to ctx.
func responsesRequest(t *testing.T, ctx context.Context, g *gateway, key, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/api/v1/responses", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	return req
}

// TestReadyzDrainsBeforeTheListenerCloses: from SIGTERM, /readyz answers 503
// while the replica still serves, for the drain delay, so a load balancer
// stops sending work before connections are refused.
func TestReadyzDrainsBeforeTheListenerCloses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_DRAIN_DELAY": "3s"})
	require.Equal(t, http.StatusOK, g.call(http.MethodGet, "/readyz", "", nil).status)
	require.NoError(t, g.cmd.Process.Signal(syscall.SIGTERM))
	require.Eventually(t, func() bool {
		return g.call(http.MethodGet, "/readyz", "", nil).status == http.StatusServiceUnavailable
	}, 2*time.Second, 20*time.Millisecond)
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "still served"})
	require.Equal(t, http.StatusOK, r.status, "the listener is open during the drain delay")
	require.NoError(t, <-g.done)
	g.done <- nil
}

// TestLongRepliesAreCompressedWhenTurnedOn: the binary sends a long reply
// (the OpenAPI document) as it is, a load balancer's to compress, and with
// GATEWAY_COMPRESS=true gzips it for a client that accepts it.
func TestLongRepliesAreCompressedWhenTurnedOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for setting, want := range map[string]string{"": "", "true": "gzip"} {
		g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_COMPRESS": setting})
		req, err := http.NewRequest(http.MethodGet, g.base+"/openapi.json", nil)
		require.NoError(t, err)
		req.Header.Set("Accept-Encoding", "gzip")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, want, resp.Header.Get("Content-Encoding"), "GATEWAY_COMPRESS=%q", setting)
	}
}

// TestOperatorsRetentionsAndOriginsTakeEffect: what the environment sets for
// evidence and requests held, and for the browsers let in, is what a replica
// serves: evidence, of a request and of a batch item, is gone once its
// retention has passed; a usage period past the request retention must fall
// on whole hours; the origins named are let in, no other.
func TestOperatorsRetentionsAndOriginsTakeEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const evidenceRetention = 5 * time.Second
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{
		"GATEWAY_EVIDENCE_RETENTION": evidenceRetention.String(),
		"GATEWAY_REQUEST_RETENTION":  "24h",
		"GATEWAY_CORS_ORIGINS":       "https://app.example.com",
	})

	preflight := func(origin string) string {
		return apitest.Preflight(t, g.base+"/api/v1/responses", origin).Get("Access-Control-Allow-Origin")
	}
	require.Equal(t, "https://app.example.com", preflight("https://app.example.com"))
	require.Empty(t, preflight("https://elsewhere.example.com"))

	dayAgo := time.Now().UTC().Add(-30 * time.Hour).Truncate(time.Hour)
	usage := func(start time.Time) reply {
		return g.call(http.MethodGet, "/api/v1/usage?start="+start.Format(time.RFC3339), b.key, nil)
	}
	require.Equal(t, http.StatusOK, usage(dayAgo).status)
	past := usage(dayAgo.Add(30 * time.Minute))
	require.Equal(t, http.StatusBadRequest, past.status, "past a retention of a day, a period falls on whole hours")
	require.Equal(t, "INVALID_REQUEST", past.code(t))

	// Each evidence is read as soon as it is stored, then once held its time.
	answered := expect[api.Response](t, g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "held a while"}), http.StatusOK)
	require.Equal(t, http.StatusOK, g.call(http.MethodGet, answered.SourcesUrl, b.key, nil).status)
	batch := g.createBatch(b.key, prompts("held a while", 1))
	done := g.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
	require.Equal(t, api.BatchItemStatus("completed"), done.Results[0].Status)
	itemSources := "/api/v1/sources/" + done.Results[0].RequestId.String()
	require.Equal(t, http.StatusOK, g.call(http.MethodGet, itemSources, b.key, nil).status)
	time.Sleep(evidenceRetention)
	for _, path := range []string{answered.SourcesUrl, itemSources} {
		gone := g.call(http.MethodGet, path, b.key, nil)
		require.Equal(t, http.StatusNotFound, gone.status, path)
		require.Equal(t, "SOURCES_NOT_FOUND", gone.code(t))
	}
}
