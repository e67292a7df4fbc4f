package config_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/config"
)

// TestStrays: a GATEWAY_ variable no setting reads is a stray, named with the
// setting a typo or two away when there is one; settings, other variables,
// those the documentation uses otherwise and those Kubernetes sets for
// services named gateway are not.
func TestStrays(t *testing.T) {
	t.Parallel()
	environ := []string{
		"PATH=/usr/bin",
		"DATABASE_URL=postgres://db/gateway",
		"GATEWAY_LISTEN=:8080",
		"GATEWAY_DRAIN_CONCURENCY=64",    // a letter missing
		"GATEWAY_SHUTDOWN_GARCE=1m",      // two swapped
		"GATEWAY_TLS_CERTIFICATE=a.pem",  // no setting that near
		"GATEWAY_METRICS_PORT=9900",      // a guess, not a service's address
		"GATEWAY_LISTEN_ADDRESS=:8080",   // too far from GATEWAY_LISTEN
		"gateway_listen=:8080",           // another name: variables are case-sensitive
		"GATEWAY_KEY=igw_x",              // the client's, in the examples
		"GATEWAY_VERSION=1.0.0",          // the image's tag, in docker-compose.yml
		"GATEWAY_REVISION=0123abc",       // the revision its build stamps
		"GATEWAY_SERVICE_HOST=10.0.0.7",  // a service gateway's
		"GATEWAY_SERVICE_PORT=8080",      //
		"GATEWAY_SERVICE_PORT_HTTP=8080", // its port named http
		"GATEWAY_PORT=tcp://10.0.0.7:8080",
		"GATEWAY_PORT_8080_TCP=tcp://10.0.0.7:8080",
		"GATEWAY_PORT_8080_TCP_PROTO=tcp",
		"GATEWAY_PORT_8080_TCP_PORT=8080",
		"GATEWAY_PORT_8080_TCP_ADDR=10.0.0.7",
		"GATEWAY_METRICS_SERVICE_HOST=10.0.0.8", // a service gateway-metrics's
		"GATEWAY_METRICS_PORT=tcp://10.0.0.8:9810",
		"GATEWAY_METRICS_PORT_9810_TCP_ADDR=10.0.0.8",
	}
	require.Equal(t, []config.Stray{
		{Name: "GATEWAY_DRAIN_CONCURENCY", Nearest: "GATEWAY_DRAIN_CONCURRENCY"},
		{Name: "GATEWAY_SHUTDOWN_GARCE", Nearest: "GATEWAY_SHUTDOWN_GRACE"},
		{Name: "GATEWAY_TLS_CERTIFICATE"},
		{Name: "GATEWAY_METRICS_PORT"},
		{Name: "GATEWAY_LISTEN_ADDRESS"},
	}, config.Config{}.Strays(environ))
	require.Empty(t, config.Config{}.Strays([]string{"GATEWAY_CONFIG=gateway.yaml", "GATEWAY_UPSTREAM_KEY=sk", "GATEWAY_PPROF=true"}), "every setting is read")

	// A provider's key in a variable named as the settings are is read.
	file := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(file, []byte("providers:\n  openai: {base_url: https://api.openai.com/v1, api_key_env: GATEWAY_OPENAI_KEY}\nmodels:\n  instant: {targets: [openai/gpt-4o-mini]}\n"), 0o600))
	require.Equal(t, []config.Stray{{Name: "GATEWAY_OPEANI_KEY", Nearest: "GATEWAY_OPENAI_KEY"}},
		config.Config{File: file}.Strays([]string{"GATEWAY_OPENAI_KEY=sk-1", "GATEWAY_OPEANI_KEY=sk-2"}))
}
