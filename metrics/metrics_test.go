package metrics_test

import (
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
	var lines []string
	for _, l := range strings.Split(metricstest.Scrape(m), "\n") {
		if strings.HasPrefix(l, "gateway_http_requests_total{") {
			lines = append(lines, l)
		}
	}
	require.Equal(t, []string{
		`gateway_http_requests_total{method="GET",route="/api/v1/responses",status="0"} 1`,
		`gateway_http_requests_total{method="other",route="/api/v1/responses",status="404"} 1000`,
	}, lines)
	m.TLSHandshakeFailed("closed")
	m.TLSHandshakeFailed("tls: a reason of the client's making")
	require.Contains(t, metricstest.Scrape(m), `gateway_tls_handshake_failures_total{kind="closed"} 1`)
	require.Contains(t, metricstest.Scrape(m), `gateway_tls_handshake_failures_total{kind="other"} 1`)
	require.Equal(t, "POST", metrics.Method("POST"))
	require.Equal(t, metrics.Other, metrics.Method("post"))
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
	require.Equal(t, http.StatusOK, get(m.Handler(true), "/debug/pprof/cmdline"))
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
	// As maintenance.Jobs does for each job, and a replica serving TLS.
	m.MaintenanceJob("fold old usage")
	m.TLSCertificate(func() time.Time { return time.Now().Add(time.Hour) })

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
	require.Equal(t, 17, rules)
}
