package config_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
)

// example is the worked example of the README.
const example = `# OpenAI first, a self-hosted vLLM when OpenAI is down.
providers:
  openai:
    base_url: https://api.openai.com/v1
    api_key_env: OPENAI_API_KEY
    timeout: 60s
    headers:
      OpenAI-Project: proj_123
  vllm:
    base_url: http://vllm.internal:8000/v1
    api_key_file: /run/secrets/vllm_key
    timeout: 120s
    idle_timeout: 4s
    ping_after: 20s
    stream_limit: 1h
    h2c: true
    max_tokens_field: max_tokens
models:
  instant:
    targets:
      - openai/gpt-4.1-mini
      - vllm/meta-llama/Llama-3.1-8B-Instruct
  reasoning:
    strategy: weighted
    targets:
      - target: openai/o4-mini
        weight: 3
      - target: vllm/Qwen/Qwen3-32B
        weight: 1
fallback:
  max_attempts: 2
  max_time: 20s
circuit:
  failures: 5
  cooldown: 2s
  max_cooldown: 30s
`

func TestParseWorkedExample(t *testing.T) {
	t.Parallel()
	f, err := config.ParseFile("gateway.yaml", []byte(example))
	require.NoError(t, err)
	require.Equal(t, config.ProviderSpec{
		Type: "openai", BaseURL: "https://api.openai.com/v1", APIKeyEnv: "OPENAI_API_KEY", Timeout: time.Minute,
		Headers: map[string]string{"OpenAI-Project": "proj_123"},
	}, withoutLine(f.Providers["openai"]))
	require.True(t, f.Providers["vllm"].H2C)
	require.Equal(t, 4*time.Second, f.Providers["vllm"].IdleTimeout)
	require.Equal(t, time.Hour, f.Providers["vllm"].StreamLimit)
	require.Equal(t, 20*time.Second, f.Providers["vllm"].PingAfter)
	require.Equal(t, "max_tokens", f.Providers["vllm"].MaxTokensField)
	require.Equal(t, routing.Ordered, f.Models[gateway.ModelInstant].Strategy)
	require.Equal(t, "meta-llama/Llama-3.1-8B-Instruct", f.Models[gateway.ModelInstant].Targets[1].UpstreamModel, "model names keep their slashes")
	require.Equal(t, 3, f.Models[gateway.ModelReasoning].Targets[0].Weight)
	require.NotContains(t, f.Models, gateway.ModelElements)
	require.Equal(t, 2, f.MaxAttempts)
	require.Equal(t, 20*time.Second, f.MaxTime)
	require.Equal(t, routing.CircuitConfig{Failures: 5, Cooldown: 2 * time.Second, MaxCooldown: 30 * time.Second}, f.Circuit)
	require.Equal(t, "instant   ordered: openai/gpt-4.1-mini vllm/meta-llama/Llama-3.1-8B-Instruct\n"+
		"reasoning weighted: openai/o4-mini (weight 3) vllm/Qwen/Qwen3-32B (weight 1)\n"+
		"elements  not served\n", f.Describe())

	require.Equal(t, "/run/secrets/vllm_key", f.Providers["vllm"].APIKeyFile)
	_, err = f.Keys(func(string) string { return "" })
	require.ErrorContains(t, err, `gateway.yaml:3: provider "openai": the environment variable OPENAI_API_KEY (api_key_env) is not set`)
	require.ErrorContains(t, err, `gateway.yaml:9: provider "vllm": api_key_file: open /run/secrets/vllm_key`)
	keys, err := f.Keys(func(string) string { return "sk-x" })
	require.Error(t, err, "vllm's key file is still missing")
	require.NotContains(t, err.Error(), "OPENAI_API_KEY")
	require.Equal(t, "sk-x", keys["openai"])
}

// TestKeyFiles: api_key_file is read at each load (a rotated key is taken),
// relative to the configuration file's folder, one key with white space
// around it; a missing, empty, oversized or multi-line file is reported with
// its provider's line.
func TestKeyFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, content string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600))
	}
	write("good", "  sk-file-1\n")
	write("empty", " \n")
	write("lines", "sk-a\nsk-b\n")
	write("large", strings.Repeat("k", 17<<10))
	abs := filepath.Join(dir, "good")
	cfg := fmt.Sprintf(`providers:
  relative: {base_url: "http://a/v1", api_key_file: good}
  absolute: {base_url: "http://b/v1", api_key_file: %q}
models:
  instant: {targets: [relative/m, absolute/m]}
`, abs)
	path := filepath.Join(dir, "gateway.yaml")
	f, err := config.ParseFile(path, []byte(cfg))
	require.NoError(t, err)
	keys, err := f.Keys(os.Getenv)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"relative": "sk-file-1", "absolute": "sk-file-1"}, keys)
	write("good", "sk-file-2")
	keys, err = f.Keys(os.Getenv)
	require.NoError(t, err)
	require.Equal(t, "sk-file-2", keys["relative"], "read anew")

	for file, want := range map[string]string{
		"missing": "no such file",
		"empty":   "is empty",
		"lines":   "holds more than a key",
		"large":   "is larger than a key",
	} {
		f, err := config.ParseFile(path, []byte("providers:\n  p: {base_url: \"http://a/v1\", api_key_file: "+file+"}\nmodels:\n  instant: {targets: [p/m]}\n"))
		require.NoError(t, err)
		_, err = f.Keys(os.Getenv)
		require.ErrorContains(t, err, `gateway.yaml:2: provider "p": api_key_file: `, file)
		require.ErrorContains(t, err, want, file)
	}
	_, err = config.ParseFile(path, []byte("providers:\n  p: {base_url: \"http://a/v1\", api_key_env: K, api_key_file: good}\nmodels:\n  instant: {targets: [p/m]}\n"))
	require.ErrorContains(t, err, `gateway.yaml:2: provider "p": give api_key_env or api_key_file, not both`)
}

func withoutLine(p config.ProviderSpec) config.ProviderSpec {
	return config.ProviderSpec{Type: p.Type, BaseURL: p.BaseURL, APIKeyEnv: p.APIKeyEnv, APIKeyFile: p.APIKeyFile, Timeout: p.Timeout, IdleTimeout: p.IdleTimeout, H2C: p.H2C, Headers: p.Headers}
}

// TestErrorsNameTheirLine: every problem is reported at once, each with its line.
func TestErrorsNameTheirLine(t *testing.T) {
	t.Parallel()
	bad := `providers:
  openai:
    base_url: ftp://x
    api_key_env: sk-live-123
    timeout: soon
    colour: blue
    headers:
      Authorization: Bearer x
  "a/b":
    type: sim
models:
  instant:
    targets:
      - openai/gpt
      - nobody/model
      - openai
      - openai/gpt
  turbo:
    targets: [openai/x]
  elements:
    targets:
      - target: openai/y
        weight: 2
  reasoning:
    strategy: random
    targets: []
circuit:
  cooldown: 10s
  max_cooldown: 1s
`
	_, err := config.ParseFile("g.yaml", []byte(bad))
	require.Error(t, err)
	for _, want := range []string{
		`g.yaml:3: provider "openai": base_url must be an http(s) URL`,
		`g.yaml:4: provider "openai": api_key_env names an environment variable`,
		`g.yaml:5: provider "openai" timeout must be a positive duration`,
		`g.yaml:6: unknown key "colour" in provider "openai"`,
		`g.yaml:8: provider "openai": header Authorization is set by the gateway: it carries the key`,
		`g.yaml:9: provider name "a/b" must be non-empty, without '/'`,
		`g.yaml:15: model instant: target "nobody/model" names provider "nobody", which providers does not define`,
		`g.yaml:16: model instant: target "openai" must be provider/upstream-model`,
		`g.yaml:17: model instant: target openai/gpt is listed twice`,
		`g.yaml:18: models: "turbo" is not a canonical model`,
		`g.yaml:22: model elements: weight is only used with strategy: weighted`,
		`g.yaml:25: model reasoning: strategy must be ordered or weighted`,
		`g.yaml:24: model reasoning needs a non-empty list of targets`,
		`g.yaml:1: circuit.cooldown (10s) must not exceed circuit.max_cooldown (1s)`,
	} {
		require.ErrorContains(t, err, want)
	}

	for content, want := range map[string]string{
		"":                            "the file is empty",
		"providers: {}\n":             "g.yaml:1: the file needs both providers and models",
		"providers: [\n":              "g.yaml: yaml:",
		"providers: {}\nmodels: {}\n": "models must route at least one canonical model",
		"providers:\n  p: {type: sim}\nmodels:\n  instant: {targets: [p/m]}\nfallback: {max_attempts: 0}\n":  "g.yaml:5: fallback.max_attempts must be a whole number of at least 1",
		"providers:\n  p: {type: openai}\nmodels:\n  instant: {targets: [p/m]}\n":                            `g.yaml:2: provider "p" needs a base_url`,
		"providers:\n  p: {type: sim, idle_timeout: -1s}\nmodels:\n  instant: {targets: [p/m]}\n":            `g.yaml:2: provider "p" idle_timeout must be a positive duration`,
		"providers:\n  p: {type: sim, stream_limit: 0s}\nmodels:\n  instant: {targets: [p/m]}\n":             `g.yaml:2: provider "p" stream_limit must be a positive duration`,
		"providers:\n  p: {type: sim, ping_after: 0s}\nmodels:\n  instant: {targets: [p/m]}\n":               `g.yaml:2: provider "p" ping_after must be a positive duration`,
		"providers:\n  p: {type: sim}\n  p: {type: sim}\nmodels:\n  instant: {targets: [p/m]}\n":             `g.yaml:3: key "p" appears twice in providers`,
		"providers:\n  p: {type: sim, max_tokens_field: max_output}\nmodels:\n  instant: {targets: [p/m]}\n": `g.yaml:2: provider "p": max_tokens_field must be max_completion_tokens (the default) or max_tokens, got "max_output"`,
		"providers:\n  p: {type: sim, headers: {\"X Team\": a}}\nmodels:\n  instant: {targets: [p/m]}\n":     `g.yaml:2: provider "p": header "X Team" is not a valid header name`,
		"providers:\n  p: {type: sim}\nmodels:\n  fast: {targets: [p/m]}\n":                                  `g.yaml:4: models: "fast" is not a canonical model`,
		"providers:\n  p: {type: sim}\nmodels:\n  instant: {strategy: ordered}\n":                            `g.yaml:4: model instant needs a non-empty list of targets`,
	} {
		_, err := config.ParseFile("g.yaml", []byte(content))
		require.ErrorContains(t, err, want, "content %q", content)
	}
}

// TestACooldownAloneIsTaken: circuit.cooldown without max_cooldown is taken,
// longer than the default longest cool-down too (which then follows it:
// routing.CircuitConfig).
func TestACooldownAloneIsTaken(t *testing.T) {
	t.Parallel()
	f, err := config.ParseFile("g.yaml", []byte(instantOnly+"circuit: {cooldown: 1m}\n"))
	require.NoError(t, err)
	require.Equal(t, routing.CircuitConfig{Cooldown: time.Minute}, f.Circuit)
}

// instantOnly is a configuration file that serves the instant model alone.
const instantOnly = "providers:\n  local: {type: sim}\nmodels:\n  instant: {targets: [local/tiny]}\n"

// configFile writes content to a file of the test's and names it in
// GATEWAY_CONFIG, returning its path.
func configFile(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	t.Setenv("GATEWAY_CONFIG", path)
	return path
}

func TestRouterFromFile(t *testing.T) {
	configFile(t, instantOnly)
	cfg, err := config.Load()
	require.NoError(t, err)
	r, err := cfg.Router(nil, nil, nil)
	require.NoError(t, err)
	require.True(t, r.Available(gateway.ModelInstant))
	require.False(t, r.Available(gateway.ModelReasoning), "models the file leaves out are not served")

	t.Setenv("GATEWAY_UPSTREAM", "http://127.0.0.1:1/v1")
	_, err = config.Load()
	require.ErrorContains(t, err, "leave GATEWAY_UPSTREAM")
}

// TestAChangeBeforeTheReloadsBeginIsReloaded: a file changed after the
// routes were read at start, before the reload loop began, is reloaded at
// the loop's first look.
func TestAChangeBeforeTheReloadsBeginIsReloaded(t *testing.T) {
	path := configFile(t, instantOnly)
	cfg, err := config.Load()
	require.NoError(t, err)
	read := cfg.FilesStamp()
	r, err := cfg.Router(nil, nil, nil)
	require.NoError(t, err)
	require.False(t, r.Available(gateway.ModelReasoning))

	require.NoError(t, os.WriteFile(path, []byte(instantOnly+"  reasoning: {targets: [local/deep]}\n"), 0o600))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go cfg.ReloadRoutes(ctx, nil, r, read, nil, nil, slog.New(slog.DiscardHandler))
	require.Eventually(t, func() bool { return r.Available(gateway.ModelReasoning) }, 2*config.FileCheck, 10*time.Millisecond)
}

// shorthandRouter is the router of the shorthand the environment sets (the
// simulator's among them, which counts with the tokenizer).
func shorthandRouter(t *testing.T) *routing.Router {
	t.Helper()
	cfg, err := config.Load()
	require.NoError(t, err)
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	r, err := cfg.Router(tok, nil, nil)
	require.NoError(t, err)
	return r
}

func TestShorthandServesEveryModel(t *testing.T) {
	t.Setenv("GATEWAY_UPSTREAM", "http://127.0.0.1:1/v1")
	t.Setenv("GATEWAY_MODEL_MAP", "instant=small")
	r := shorthandRouter(t)
	require.True(t, r.Available(gateway.ModelInstant))
	require.False(t, r.Available(gateway.ModelElements))

	t.Setenv("GATEWAY_UPSTREAM", "ftp://x")
	cfg, err := config.Load()
	require.NoError(t, err)
	_, err = cfg.Router(nil, nil, nil)
	require.ErrorContains(t, err, "GATEWAY_UPSTREAM must be sim or an http(s) base URL")

	t.Setenv("GATEWAY_UPSTREAM", "https://me:hunter2@example.org/v1")
	cfg, err = config.Load()
	require.NoError(t, err)
	_, err = cfg.Router(nil, nil, nil)
	require.ErrorContains(t, err, "GATEWAY_UPSTREAM must not hold credentials")
	require.NotContains(t, err.Error(), "hunter2", "the error does not print them")
}

// TestBaseURLs: a base URL's query is taken (calls keep it); credentials and
// fragments are refused, and credentials are not printed.
func TestBaseURLs(t *testing.T) {
	t.Parallel()
	parse := func(base string) error {
		_, err := config.ParseFile("g.yaml", []byte("providers:\n  p: {type: openai, base_url: \""+base+"\"}\nmodels:\n  instant: {targets: [p/m]}\n"))
		return err
	}
	require.NoError(t, parse("https://acme.openai.azure.com/openai/deployments/gpt-4o?api-version=2024-10-21"))
	err := parse("https://me:hunter2@example.org/v1")
	require.ErrorContains(t, err, `g.yaml:2: provider "p": base_url must not hold credentials`)
	require.NotContains(t, err.Error(), "hunter2")
	require.ErrorContains(t, parse("https://example.org/v1#models"), `base_url must not end in a fragment`)
	require.ErrorContains(t, parse("https://example.org/v1#"), `base_url must not end in a fragment`)
}

// TestDevDrainDelay: gateway dev, with no load balancer in front, stops at
// once unless GATEWAY_DRAIN_DELAY says otherwise; serve waits its default.
func TestDevDrainDelay(t *testing.T) {
	t.Setenv("GATEWAY_DRAIN_DELAY", "")
	dev, err := config.LoadDev()
	require.NoError(t, err)
	require.Zero(t, dev.DrainDelay)
	serve, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, 5*time.Second, serve.DrainDelay)
	require.Equal(t, serve.Listen, dev.Listen, "the other defaults are serve's")

	t.Setenv("GATEWAY_DRAIN_DELAY", "2s")
	dev, err = config.LoadDev()
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, dev.DrainDelay)
	t.Setenv("GATEWAY_DRAIN_DELAY", "-1s")
	_, err = config.LoadDev()
	require.ErrorContains(t, err, "GATEWAY_DRAIN_DELAY must not be negative")
}

// TestTurnSettings: GATEWAY_TURN_PLACES (0, the default, is half the cores)
// and GATEWAY_TURN_WAIT are read, and a negative count or a wait that is not
// positive is refused.
func TestTurnSettings(t *testing.T) {
	t.Setenv("GATEWAY_TURN_PLACES", "")
	t.Setenv("GATEWAY_TURN_WAIT", "")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Zero(t, cfg.TurnPlaces)
	require.Equal(t, 10*time.Second, cfg.TurnWait)

	t.Setenv("GATEWAY_TURN_PLACES", "3")
	t.Setenv("GATEWAY_TURN_WAIT", "2s")
	cfg, err = config.Load()
	require.NoError(t, err)
	require.Equal(t, 3, cfg.TurnPlaces)
	require.Equal(t, 2*time.Second, cfg.TurnWait)

	t.Setenv("GATEWAY_TURN_PLACES", "-1")
	_, err = config.Load()
	require.ErrorContains(t, err, "GATEWAY_TURN_PLACES must not be negative")
	t.Setenv("GATEWAY_TURN_PLACES", "")
	t.Setenv("GATEWAY_TURN_WAIT", "0s")
	_, err = config.Load()
	require.ErrorContains(t, err, "GATEWAY_TURN_WAIT must be positive")
}

// TestTLSSettings: GATEWAY_TLS_CERT and GATEWAY_TLS_KEY go together, not
// with GATEWAY_H2C, and Check reads them: files that do not read as a pair
// stop the start, named.
func TestTLSSettings(t *testing.T) {
	t.Setenv("GATEWAY_H2C", "")
	t.Setenv("GATEWAY_TLS_KEY", "")
	t.Setenv("GATEWAY_TLS_CERT", "tls.crt")
	_, err := config.Load()
	require.ErrorContains(t, err, "GATEWAY_TLS_CERT and GATEWAY_TLS_KEY go together")
	t.Setenv("GATEWAY_TLS_KEY", "tls.key")
	t.Setenv("GATEWAY_H2C", "true")
	_, err = config.Load()
	require.ErrorContains(t, err, "GATEWAY_H2C is HTTP/2 without TLS")

	t.Setenv("GATEWAY_H2C", "")
	cfg, err := config.Load()
	require.NoError(t, err)
	err = cfg.Check()
	require.ErrorContains(t, err, "GATEWAY_TLS_CERT/GATEWAY_TLS_KEY")
	require.ErrorIs(t, err, os.ErrNotExist)

	t.Setenv("GATEWAY_TLS_CERT", "")
	t.Setenv("GATEWAY_TLS_KEY", "")
	cfg, err = config.Load()
	require.NoError(t, err)
	certificate, err := cfg.Certificate(nil)
	require.NoError(t, err)
	require.Nil(t, certificate, "served without TLS")
}

// TestUpstreamMaxTokensField: the shorthand's field of the output limit is
// read, one of the two names, and not beside a file of providers.
func TestUpstreamMaxTokensField(t *testing.T) {
	t.Setenv("GATEWAY_UPSTREAM_MAX_TOKENS_FIELD", "max_tokens")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, "max_tokens", cfg.UpstreamMaxTokensField)

	t.Setenv("GATEWAY_UPSTREAM_MAX_TOKENS_FIELD", "max_new_tokens")
	_, err = config.Load()
	require.ErrorContains(t, err, `GATEWAY_UPSTREAM_MAX_TOKENS_FIELD must be max_completion_tokens or max_tokens, got "max_new_tokens"`)

	configFile(t, instantOnly)
	t.Setenv("GATEWAY_UPSTREAM_MAX_TOKENS_FIELD", "max_tokens")
	_, err = config.Load()
	require.ErrorContains(t, err, "leave GATEWAY_UPSTREAM, GATEWAY_UPSTREAM_KEY, GATEWAY_UPSTREAM_KEY_HEADER, GATEWAY_UPSTREAM_H2C, GATEWAY_UPSTREAM_MAX_TOKENS_FIELD, GATEWAY_UPSTREAM_STREAM_OPTIONS and GATEWAY_MODEL_MAP unset")
}

// TestStreamOptions: a provider's stream_options (default true) may be set
// false, in the file and in the shorthand, whose calls then carry none; the
// shorthand's is refused beside a file of providers.
func TestStreamOptions(t *testing.T) {
	for content, want := range map[string]bool{
		"providers:\n  p: {base_url: \"http://a/v1\", stream_options: false}\nmodels:\n  instant: {targets: [p/m]}\n": true,
		"providers:\n  p: {base_url: \"http://a/v1\", stream_options: true}\nmodels:\n  instant: {targets: [p/m]}\n":  false,
		"providers:\n  p: {base_url: \"http://a/v1\"}\nmodels:\n  instant: {targets: [p/m]}\n":                        false,
	} {
		f, err := config.ParseFile("g.yaml", []byte(content))
		require.NoError(t, err, content)
		require.Equal(t, want, f.Providers["p"].NoStreamOptions, content)
	}
	_, err := config.ParseFile("g.yaml", []byte("providers:\n  p: {base_url: \"http://a/v1\", stream_options: sometimes}\nmodels:\n  instant: {targets: [p/m]}\n"))
	require.ErrorContains(t, err, `provider "p" stream_options must be true or false`)

	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	t.Setenv("GATEWAY_UPSTREAM", fake.BaseURL())
	for _, set := range []string{"", "true", "false"} {
		t.Setenv("GATEWAY_UPSTREAM_STREAM_OPTIONS", set)
		if set == "" {
			require.NoError(t, os.Unsetenv("GATEWAY_UPSTREAM_STREAM_OPTIONS"))
		}
		_, err := shorthandRouter(t).Stream(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "hi", MaxOutputTokens: 10}, func(upstream.Delta) error { return nil })
		require.NoError(t, err)
		calls := fake.Calls()
		require.Equal(t, set != "false", calls[len(calls)-1].StreamOptions, "GATEWAY_UPSTREAM_STREAM_OPTIONS=%q", set)
	}

	t.Setenv("GATEWAY_UPSTREAM", "")
	configFile(t, instantOnly)
	t.Setenv("GATEWAY_UPSTREAM_STREAM_OPTIONS", "true")
	_, err = config.Load()
	require.ErrorContains(t, err, "GATEWAY_UPSTREAM_STREAM_OPTIONS")
}

// TestAPIKeyHeader: a provider may name the header of its key, in the file
// and in the shorthand, whose calls then carry the key there; not a header
// the gateway sets, nor one its headers set too.
func TestAPIKeyHeader(t *testing.T) {
	provider := func(fields string) string {
		return "providers:\n  p: {base_url: \"http://a/v1\", " + fields + "}\nmodels:\n  instant: {targets: [p/m]}\n"
	}
	f, err := config.ParseFile("g.yaml", []byte(provider("api_key_header: api-key")))
	require.NoError(t, err)
	require.Equal(t, "api-key", f.Providers["p"].APIKeyHeader)
	for fields, want := range map[string]string{
		"api_key_header: Authorization":                  `provider "p": api_key_header Authorization is set by the gateway: it carries the key`,
		`api_key_header: "api key"`:                      `provider "p": api_key_header "api key" is not a valid header name`,
		"api_key_header: x-gateway-hints":                `provider "p": api_key_header X-Gateway-Hints is set by the gateway`,
		"api_key_header: api-key, headers: {Api-Key: x}": `provider "p": header Api-Key is api_key_header's`,
		"headers: {Accept-Encoding: gzip}":               `provider "p": header Accept-Encoding is set by the gateway`,
		"headers: {authorization: Basic eA==}":           `provider "p": header Authorization is set by the gateway: it carries the key, as a bearer token, unless another header is named for it`,
	} {
		_, err := config.ParseFile("g.yaml", []byte(provider(fields)))
		require.ErrorContains(t, err, want, fields)
	}

	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	t.Setenv("GATEWAY_UPSTREAM", fake.BaseURL())
	t.Setenv("GATEWAY_UPSTREAM_KEY", "up-key")
	t.Setenv("GATEWAY_UPSTREAM_KEY_HEADER", "api-key")
	_, err = shorthandRouter(t).Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "hi", MaxOutputTokens: 10})
	require.NoError(t, err)
	require.Equal(t, "up-key", fake.Calls()[0].Header.Get("api-key"))
	require.Empty(t, fake.Calls()[0].Header.Get("Authorization"))

	t.Setenv("GATEWAY_UPSTREAM_KEY_HEADER", "Authorization")
	_, err = config.Load()
	require.ErrorContains(t, err, "GATEWAY_UPSTREAM_KEY_HEADER Authorization is set by the gateway")
}

// TestUpstreamLimits: the shorthand's call and stream limits are read, and
// must be positive.
func TestUpstreamLimits(t *testing.T) {
	t.Setenv("GATEWAY_UPSTREAM_TIMEOUT", "")
	t.Setenv("GATEWAY_UPSTREAM_STREAM_LIMIT", "")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, 2*time.Minute, cfg.UpstreamTimeout)
	require.Equal(t, 30*time.Minute, cfg.UpstreamStreamLimit)

	t.Setenv("GATEWAY_UPSTREAM_STREAM_LIMIT", "1h")
	cfg, err = config.Load()
	require.NoError(t, err)
	require.Equal(t, time.Hour, cfg.UpstreamStreamLimit)
	for _, name := range []string{"GATEWAY_UPSTREAM_TIMEOUT", "GATEWAY_UPSTREAM_STREAM_LIMIT"} {
		t.Setenv(name, "0s")
		_, err = config.Load()
		require.ErrorContains(t, err, "GATEWAY_UPSTREAM_TIMEOUT and GATEWAY_UPSTREAM_STREAM_LIMIT must be positive", name)
		t.Setenv(name, "1m")
	}
}

// TestRequestRetention: GATEWAY_REQUEST_RETENTION is 90 days by default, 0
// keeps requests for good, and a retention shorter than a day or than the
// evidence's is refused.
func TestRequestRetention(t *testing.T) {
	t.Setenv("GATEWAY_REQUEST_RETENTION", "")
	t.Setenv("GATEWAY_EVIDENCE_RETENTION", "")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, 90*24*time.Hour, cfg.RequestRetention)

	for value, want := range map[string]time.Duration{"0s": 0, "168h": 7 * 24 * time.Hour, "8760h": 365 * 24 * time.Hour} {
		t.Setenv("GATEWAY_REQUEST_RETENTION", value)
		cfg, err = config.Load()
		require.NoError(t, err, value)
		require.Equal(t, want, cfg.RequestRetention, value)
	}
	for _, value := range []string{"23h", "-24h", "100h"} { // 100h: under the evidence's 168h
		t.Setenv("GATEWAY_REQUEST_RETENTION", value)
		_, err = config.Load()
		require.ErrorContains(t, err, "GATEWAY_REQUEST_RETENTION must be 0 (requests kept for good) or at least 24h and GATEWAY_EVIDENCE_RETENTION (168h0m0s)", value)
	}
	t.Setenv("GATEWAY_EVIDENCE_RETENTION", "1h")
	t.Setenv("GATEWAY_REQUEST_RETENTION", "100h")
	_, err = config.Load()
	require.NoError(t, err)
	t.Setenv("GATEWAY_REQUEST_RETENTION", "23h")
	_, err = config.Load()
	require.ErrorContains(t, err, "at least 24h")
}

// TestTheRoutersConfigurationIsTheFiles: the router is built with what the
// file says of its routes, fallback and circuit, each target under its
// provider.
func TestTheRoutersConfigurationIsTheFiles(t *testing.T) {
	t.Parallel()
	f, err := config.ParseFile("gateway.yaml", []byte(example))
	require.NoError(t, err)
	rc := f.RouterConfig(map[string]string{"openai": "sk-x", "vllm": "sk-y"}, nil, 0, nil, nil)
	require.Equal(t, 2, rc.MaxAttempts)
	require.Equal(t, 20*time.Second, rc.MaxTime)
	require.Equal(t, routing.CircuitConfig{Failures: 5, Cooldown: 2 * time.Second, MaxCooldown: 30 * time.Second}, rc.Circuit)
	require.Len(t, rc.Routes, 2)
	reasoning := rc.Routes[gateway.ModelReasoning]
	require.Equal(t, routing.Weighted, reasoning.Strategy)
	var targets []string
	for _, target := range reasoning.Targets {
		require.NotNil(t, target.Client, target.Provider)
		targets = append(targets, fmt.Sprintf("%s/%s×%d", target.Provider, target.UpstreamModel, target.Weight))
	}
	require.Equal(t, []string{"openai/o4-mini×3", "vllm/Qwen/Qwen3-32B×1"}, targets)
	require.Equal(t, routing.Ordered, rc.Routes[gateway.ModelInstant].Strategy)
}

// TestTheEnvironmentsBounds: each setting that has a bound is refused past
// it, naming the variable, and taken at it.
func TestTheEnvironmentsBounds(t *testing.T) {
	for _, c := range []struct {
		name, past, at, refusal string
	}{
		{"GATEWAY_EVIDENCE_RETENTION", "0s", "1s", "GATEWAY_EVIDENCE_RETENTION must be positive"},
		{"GATEWAY_SSE_KEEPALIVE", "0s", "1ms", "GATEWAY_SSE_KEEPALIVE must be positive"},
		{"GATEWAY_BATCH_WINDOW", "0s", "1s", "GATEWAY_BATCH_WINDOW and GATEWAY_BATCH_RETENTION must be positive"},
		{"GATEWAY_BATCH_RETENTION", "-1h", "1s", "GATEWAY_BATCH_WINDOW and GATEWAY_BATCH_RETENTION must be positive"},
		{"GATEWAY_LEASE", "999ms", "1s", "GATEWAY_LEASE must be at least 1s"},
		{"GATEWAY_DRAIN_CONCURRENCY", "0", "1", "GATEWAY_DRAIN_CONCURRENCY must be at least 1"},
		{"GATEWAY_SHUTDOWN_GRACE", "0s", "1ms", "GATEWAY_SHUTDOWN_GRACE must be positive"},
		{"GATEWAY_BODY_TIMEOUT", "0s", "1ms", "GATEWAY_BODY_TIMEOUT must be positive"},
		{"GATEWAY_RATE_LIMIT", "-1", "0", "GATEWAY_RATE_LIMIT must not be negative"},
		{"GATEWAY_DB_MAX_CONNS", "1", "2", "GATEWAY_DB_MAX_CONNS must be at least 2"},
		{"GATEWAY_DB_START_WAIT", "-1s", "0s", "GATEWAY_DB_START_WAIT must not be negative"},
	} {
		t.Setenv("GATEWAY_REQUEST_RETENTION", "0s") // not bound by a short evidence retention
		t.Setenv(c.name, c.past)
		_, err := config.Load()
		require.ErrorContains(t, err, c.refusal, c.name)
		t.Setenv(c.name, c.at)
		_, err = config.Load()
		require.NoError(t, err, c.name)
		t.Setenv(c.name, "")
	}
}

// TestAFileOfProvidersLeavesTheShorthandUnset: beside GATEWAY_CONFIG, each
// variable of the one-provider shorthand is refused.
func TestAFileOfProvidersLeavesTheShorthandUnset(t *testing.T) {
	configFile(t, instantOnly)
	_, err := config.Load()
	require.NoError(t, err)
	for name, value := range map[string]string{
		"GATEWAY_UPSTREAM":                  "http://127.0.0.1:1/v1",
		"GATEWAY_UPSTREAM_KEY":              "sk-x",
		"GATEWAY_UPSTREAM_KEY_HEADER":       "api-key",
		"GATEWAY_UPSTREAM_H2C":              "true",
		"GATEWAY_UPSTREAM_MAX_TOKENS_FIELD": "max_tokens",
		"GATEWAY_UPSTREAM_STREAM_OPTIONS":   "true",
		"GATEWAY_MODEL_MAP":                 "instant=small",
	} {
		t.Setenv(name, value)
		_, err := config.Load()
		require.ErrorContains(t, err, "GATEWAY_CONFIG names a file of providers", name)
		require.NoError(t, os.Unsetenv(name))
	}
}

// TestTrustedProxies: GATEWAY_TRUSTED_PROXIES is a list of addresses and
// CIDR ranges, with spaces and empty entries ignored; an address is a
// range of itself alone (an IPv4 address written in IPv6 as the IPv4 one),
// and a range is its network.
func TestTrustedProxies(t *testing.T) {
	t.Setenv("GATEWAY_TRUSTED_PROXIES", " 10.1.2.3/8 , ,::ffff:192.0.2.1,2001:db8::1,")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.0.2.1/32"), netip.MustParsePrefix("2001:db8::1/128"),
	}, cfg.Proxies())
	t.Setenv("GATEWAY_TRUSTED_PROXIES", "10.0.0.0/8,lb.internal")
	_, err = config.Load()
	require.ErrorContains(t, err, `GATEWAY_TRUSTED_PROXIES: "lb.internal" is neither an address nor a CIDR range`)
}

// TestRateLimits: GATEWAY_RATE_LIMIT, when set, is every tier's limit;
// unset or 0, the tiers keep their defaults.
func TestRateLimits(t *testing.T) {
	for value, want := range map[string]gateway.RateLimits{
		"":  gateway.DefaultRateLimits,
		"0": gateway.DefaultRateLimits,
		"7": {Free: 7, Developer: 7},
		"1": {Free: 1, Developer: 1},
	} {
		t.Setenv("GATEWAY_RATE_LIMIT", value)
		cfg, err := config.Load()
		require.NoError(t, err, value)
		require.Equal(t, want, cfg.RateLimits(), value)
	}
}

// TestCheckReadsWhatAServerBuilds: Check refuses a rate card that does not
// read, and a file whose providers' keys are missing, naming GATEWAY_CONFIG;
// GATEWAY_UPSTREAM=sim is the simulator, as unset is.
func TestCheckReadsWhatAServerBuilds(t *testing.T) {
	for name, value := range map[string]string{"GATEWAY_MULTIPLIERS": "instant=1", "GATEWAY_BATCH_DISCOUNT": "2"} {
		t.Setenv(name, value)
		cfg, err := config.Load()
		require.NoError(t, err, name)
		require.ErrorContains(t, cfg.Check(), name)
		t.Setenv(name, "")
	}

	t.Setenv("GATEWAY_UPSTREAM", "")
	cfg, err := config.Load()
	require.NoError(t, err)
	require.Equal(t, "sim", cfg.UpstreamName(), "unset")
	t.Setenv("GATEWAY_UPSTREAM", "sim")
	cfg, err = config.Load()
	require.NoError(t, err)
	require.NoError(t, cfg.Check())
	require.Equal(t, "sim", cfg.UpstreamName())
	res, err := shorthandRouter(t).Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "hi", MaxOutputTokens: 10})
	require.NoError(t, err)
	require.NotEmpty(t, res.Content)
	require.Equal(t, "sim", res.Route.Provider)

	t.Setenv("GATEWAY_UPSTREAM", "")
	configFile(t, "providers:\n  p: {type: openai, base_url: http://127.0.0.1:1/v1, api_key_env: GATEWAY_TEST_UNSET_KEY}\nmodels:\n  instant: {targets: [p/m]}\n")
	cfg, err = config.Load()
	require.NoError(t, err)
	err = cfg.Check()
	require.ErrorContains(t, err, "GATEWAY_CONFIG: ")
	require.ErrorContains(t, err, "GATEWAY_TEST_UNSET_KEY")
}

// TestShorthandH2C: GATEWAY_UPSTREAM_H2C makes the shorthand's calls
// HTTP/2 without TLS; unset, they are HTTP/1.1.
func TestShorthandH2C(t *testing.T) {
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	t.Setenv("GATEWAY_UPSTREAM", fake.BaseURL())
	for i, h2c := range []string{"", "true"} {
		t.Setenv("GATEWAY_UPSTREAM_H2C", h2c)
		_, err := shorthandRouter(t).Complete(context.Background(), &upstream.Request{Model: gateway.ModelInstant, Prompt: "hi", MaxOutputTokens: 10})
		require.NoError(t, err)
		require.Equal(t, i, fake.HTTP2Calls(), "GATEWAY_UPSTREAM_H2C=%q", h2c)
	}
}
