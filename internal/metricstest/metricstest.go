// Package metricstest reads a metrics.Metrics as its listener serves it, for
// tests.
package metricstest

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/metrics"
)

// Scrape returns what m's listener serves on /metrics.
func Scrape(m *metrics.Metrics) string {
	rec := httptest.NewRecorder()
	m.Handler(false).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}

// Samples returns the samples m's listener serves, each value by its series
// as written there (name and labels, as `name{label="value"}`).
func Samples(t testing.TB, m *metrics.Metrics) map[string]float64 {
	t.Helper()
	samples := map[string]float64{}
	for _, line := range strings.Split(Scrape(m), "\n") {
		i := strings.LastIndexByte(line, ' ') // label values may hold spaces
		if i < 0 || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(t, err, line)
		samples[line[:i]] = v
	}
	return samples
}
