package metrics_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
