// Package metricstest reads a metrics.Metrics as its listener serves it, for
// tests.
package metricstest

import (
	"net/http"
	"net/http/httptest"

	"github.com/rungworks/gateway/metrics"
)

// Scrape returns what m's listener serves on /metrics.
func Scrape(m *metrics.Metrics) string {
	rec := httptest.NewRecorder()
	m.Handler(false).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}
