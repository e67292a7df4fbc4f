package metrics_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/serverlog"
	"github.com/rungworks/gateway/metrics"
)

// TestLabelsComeFromFixedSets: no caller can grow the metrics (D11).
func TestLabelsComeFromFixedSets(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	for i := range 1000 {
		m.Request("/api/v1/responses", strings.Repeat("X", 100)+string(rune('A'+i%26))+strings.Repeat("Y", i), 404, time.Millisecond)
	}
	m.Request("/api/v1/responses", "GET", 99999, time.Millisecond)
	for _, status := range []int{99, 600} {
		m.Request("/api/v1/responses", "GET", status, time.Millisecond)
	}
	for _, status := range []int{100, 599} {
		m.Request("/healthz", "GET", status, time.Millisecond)
	}
	var lines []string
	for _, l := range strings.Split(metricstest.Scrape(m), "\n") {
		if strings.HasPrefix(l, "gateway_http_requests_total{") {
			lines = append(lines, l)
		}
	}
	require.Equal(t, []string{
		`gateway_http_requests_total{method="GET",route="/api/v1/responses",status="0"} 3`,
		`gateway_http_requests_total{method="GET",route="/healthz",status="100"} 1`,
		`gateway_http_requests_total{method="GET",route="/healthz",status="599"} 1`,
		`gateway_http_requests_total{method="other",route="/api/v1/responses",status="404"} 1000`,
	}, lines)
	for _, kind := range []string{serverlog.Closed, serverlog.PlainHTTP, serverlog.Refused, "tls: a reason of the client's making"} {
		m.TLSHandshakeFailed(kind)
	}
	scrape := metricstest.Scrape(m)
	for _, kind := range []string{"closed", "plain_http", "refused", "other"} {
		require.Contains(t, scrape, `gateway_tls_handshake_failures_total{kind="`+kind+`"} 1`)
	}
	for _, method := range []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "CONNECT", "OPTIONS", "TRACE"} {
		require.Equal(t, method, metrics.Method(method))
	}
	require.Equal(t, metrics.Other, metrics.Method("post"))
}

// TestTheBuildIsExported: gateway_build_info is 1, labelled with the
// version and the revision it is given.
func TestTheBuildIsExported(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	require.NotContains(t, metricstest.Scrape(m), "gateway_build_info")
	m.Build("v1.4.0", "0123abc")
	require.Contains(t, metricstest.Scrape(m), `gateway_build_info{revision="0123abc",version="v1.4.0"} 1`)
}

// TestTraceExportFailuresAreCounted: the count of failed exports is 0 until
// the first.
func TestTraceExportFailuresAreCounted(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	require.Contains(t, metricstest.Scrape(m), "gateway_trace_export_failures_total 0\n")
	m.TraceExportFailed()
	m.TraceExportFailed()
	require.Contains(t, metricstest.Scrape(m), "gateway_trace_export_failures_total 2\n")
}

// TestListenerServesOnlyWhatItShould: /metrics, and the profiler only when
// asked for; every other path is 404, not the metrics text.
func TestListenerServesOnlyWhatItShould(t *testing.T) {
	t.Parallel()
	get := func(h http.Handler, path string) int {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		return rec.Code
	}
	m := metrics.New()
	require.Equal(t, http.StatusOK, get(m.Handler(false), "/metrics"))
	require.Equal(t, http.StatusNotFound, get(m.Handler(false), "/debug/pprof/"))
	require.Equal(t, http.StatusNotFound, get(m.Handler(false), "/anything"))
	require.Equal(t, http.StatusOK, get(m.Handler(true), "/debug/pprof/"))
	for _, path := range []string{"/debug/pprof/cmdline", "/debug/pprof/symbol", "/debug/pprof/trace?seconds=0.01", "/debug/pprof/profile?seconds=1", "/debug/pprof/heap"} {
		require.Equal(t, http.StatusOK, get(m.Handler(true), path), path)
	}
}

// TestStatesAreExportedAsSet: the gauges of a state hold its last setting:
// the load of the routes (a failed reload keeps the time of the last that
// took effect), the listeners, and the certificate's end, read at each scrape.
func TestStatesAreExportedAsSet(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	samples := func() map[string]float64 { return metricstest.Samples(t, m) }
	loaded := time.Date(2026, 3, 1, 12, 0, 0, 500_000_000, time.UTC)
	m.ConfigLoaded(true, loaded)
	require.Equal(t, 1.0, samples()["gateway_config_last_reload_successful"])
	require.Equal(t, 1772366400.5, samples()["gateway_config_last_reload_success_timestamp_seconds"])
	m.ConfigLoaded(false, loaded.Add(time.Hour))
	require.Equal(t, 0.0, samples()["gateway_config_last_reload_successful"])
	require.Equal(t, 1772366400.5, samples()["gateway_config_last_reload_success_timestamp_seconds"])
	m.ConfigLoaded(true, loaded.Add(time.Hour))
	require.Equal(t, 1.0, samples()["gateway_config_last_reload_successful"])
	require.Equal(t, 1772370000.5, samples()["gateway_config_last_reload_success_timestamp_seconds"])

	m.Listening(metrics.ListenerKeys, true)
	require.Equal(t, 1.0, samples()[`gateway_notifications_listening{listener="keys"}`])
	require.Equal(t, 0.0, samples()[`gateway_notifications_listening{listener="batches"}`])
	m.Listening(metrics.ListenerKeys, false)
	require.Equal(t, 0.0, samples()[`gateway_notifications_listening{listener="keys"}`])

	notAfter := loaded
	m.TLSCertificate(func() time.Time { return notAfter })
	require.Equal(t, float64(loaded.Unix()), samples()["gateway_tls_certificate_expiry_timestamp_seconds"])
	notAfter = loaded.AddDate(0, 3, 0)
	require.Equal(t, float64(notAfter.Unix()), samples()["gateway_tls_certificate_expiry_timestamp_seconds"], "a renewal shows at the next scrape")
}

// TestTheDatabasePoolIsReadAtEachScrape: the pool's connections by state,
// its bound and its acquires are what the pool says at the scrape.
func TestTheDatabasePoolIsReadAtEachScrape(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	pool := metrics.Pool{Acquired: 3, Idle: 4, Constructing: 1, Max: 8, Acquires: 1000, Waited: 7, Canceled: 2, Wait: 1500 * time.Millisecond}
	m.DatabasePool(func() metrics.Pool { return pool })
	want := map[string]float64{
		`gateway_db_connections{state="acquired"}`:     3,
		`gateway_db_connections{state="idle"}`:         4,
		`gateway_db_connections{state="constructing"}`: 1,
		`gateway_db_connections_max`:                   8,
		`gateway_db_acquires_total`:                    1000,
		`gateway_db_acquires_waited_total`:             7,
		`gateway_db_acquire_wait_seconds_total`:        1.5,
		`gateway_db_acquires_canceled_total`:           2,
	}
	check := func() {
		t.Helper()
		samples := metricstest.Samples(t, m)
		for name, v := range want {
			require.Equal(t, v, samples[name], name)
		}
	}
	check()
	pool.Acquired, pool.Acquires = 0, 1001
	want[`gateway_db_connections{state="acquired"}`], want[`gateway_db_acquires_total`] = 0, 1001
	check()
}

func TestLostLogLinesAreReadAtEachScrape(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	var lost uint64 = 3
	m.LogLinesLost(func() uint64 { return lost })
	require.Equal(t, 3.0, metricstest.Samples(t, m)["gateway_log_lines_lost_total"])
	lost = 5
	require.Equal(t, 5.0, metricstest.Samples(t, m)["gateway_log_lines_lost_total"])
}

// TestEveryAttemptAndJobIsCounted: an attempt whose kind is outside the
// fixed set counts as other, not as ok nor not at all; a maintenance job's
// series are there at zero before its first run.
func TestEveryAttemptAndJobIsCounted(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	target := m.Target("primary", "small")
	target.Attempt("", time.Millisecond)
	target.Attempt("a kind of no set", time.Millisecond)
	samples := metricstest.Samples(t, m)
	attempts := `gateway_upstream_attempts_total{outcome="%s",provider="primary",upstream_model="small"}`
	require.Equal(t, 1.0, samples[fmt.Sprintf(attempts, "ok")])
	require.Equal(t, 1.0, samples[fmt.Sprintf(attempts, metrics.Other)])
	require.Equal(t, 2.0, samples[`gateway_upstream_attempt_duration_seconds_count{provider="primary",upstream_model="small"}`])

	m.MaintenanceJob("fold old usage")
	samples = metricstest.Samples(t, m)
	for _, series := range []string{"gateway_maintenance_rows_total", "gateway_maintenance_failures_total"} {
		v, ok := samples[series+`{task="fold old usage"}`]
		require.True(t, ok, series)
		require.Zero(t, v)
	}
}

// TestAlertRulesFireAsTheirTestsSay runs the alerting rules' own tests
// (deploy/prometheus/alerts_test.yml: when each fires, with what it says,
// and when it stays quiet) with promtool, where it is installed.
func TestAlertRulesFireAsTheirTestsSay(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool is not installed")
	}
	out, err := exec.Command(promtool, "test", "rules", "../deploy/prometheus/alerts_test.yml").CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// TestAlertRulesSelectExportedSeries: every gateway series, and every label,
// that the alerting rules (deploy/prometheus/alerts.yml) select is one the
// metrics export, and the counters whose increases they alert on are exported
// before their first event; so renaming a metric or a label cannot silently
// disarm an alert. (promtool tests the rules' logic: alerts_test.yml.)
func TestAlertRulesSelectExportedSeries(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	m.Request("/api/v1/responses", "POST", 200, time.Millisecond)
	m.GroupCommit(metrics.WorkSettlement, 1, time.Millisecond)
	m.Target("openai", "gpt-4.1-mini").Circuit(0)
	// As maintenance.Jobs does for each job, a replica serving TLS, and
	// every serving replica.
	m.MaintenanceJob("fold old usage")
	m.TLSCertificate(func() time.Time { return time.Now().Add(time.Hour) })
	m.LogLinesLost(func() uint64 { return 0 })
	m.DatabasePool(func() metrics.Pool { return metrics.Pool{} })

	labels := map[string]map[string]bool{} // series name → its label names
	sample := regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? `)
	label := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="`)
	for _, line := range strings.Split(metricstest.Scrape(m), "\n") {
		match := sample.FindStringSubmatch(line)
		if match == nil {
			continue
		}
		if labels[match[1]] == nil {
			labels[match[1]] = map[string]bool{}
		}
		for _, l := range label.FindAllStringSubmatch(match[2], -1) {
			labels[match[1]][l[1]] = true
		}
	}

	raw, err := os.ReadFile("../deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &file))
	selector := regexp.MustCompile(`(gateway_[a-z0-9_]+)(\{[^}]*\})?`)
	matcher := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	by := regexp.MustCompile(`by \(([^)]*)\)`)
	rules := 0
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			rules++
			series := selector.FindAllStringSubmatch(r.Expr, -1)
			require.NotEmpty(t, series, "%s selects no gateway series", r.Alert)
			selected := map[string]bool{} // the labels of the series r selects
			for _, s := range series {
				require.Contains(t, labels, s[1], "%s selects a series the gateway does not export", r.Alert)
				for l := range labels[s[1]] {
					selected[l] = true
				}
				for _, l := range matcher.FindAllStringSubmatch(s[2], -1) {
					require.True(t, labels[s[1]][l[1]], "%s: %s has no label %s", r.Alert, s[1], l[1])
				}
			}
			for _, b := range by.FindAllStringSubmatch(r.Expr, -1) {
				for l := range strings.SplitSeq(b[1], ",") {
					if l = strings.TrimSpace(l); l != "" {
						require.True(t, selected[l], "%s groups by %s, a label of none of its series", r.Alert, l)
					}
				}
			}
		}
	}
	require.Equal(t, 19, rules)
}

// TestDatabaseRetriesAreCountedByWork: each work's retries are 0 until its
// first, and counted apart from the others'.
func TestDatabaseRetriesAreCountedByWork(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	works := []string{metrics.RetrySettlement, metrics.RetryLateSettlement, metrics.RetryBatchCreation, metrics.RetryBatchOutcomes, metrics.RetryBatchItems, metrics.RetryBatchStates}
	scrape := metricstest.Scrape(m)
	for _, w := range works {
		require.Contains(t, scrape, `gateway_database_retries_total{work="`+w+`"} 0`+"\n")
	}
	m.DatabaseRetry(metrics.RetryBatchOutcomes)
	m.DatabaseRetry(metrics.RetryBatchOutcomes)
	m.DatabaseRetry(metrics.RetrySettlement)
	samples := metricstest.Samples(t, m)
	for _, w := range works {
		want := map[string]float64{metrics.RetryBatchOutcomes: 2, metrics.RetrySettlement: 1}[w]
		require.Equal(t, want, samples[`gateway_database_retries_total{work="`+w+`"}`], w)
	}
}
