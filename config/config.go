// Package config reads the gateway's configuration from the environment
// (decisions D2) and, when GATEWAY_CONFIG names one, from a file of providers
// and routes, and builds the pieces they describe: the upstream router and
// the rate card.
package config

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/certfile"
	"github.com/rungworks/gateway/internal/filestamp"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
	"github.com/rungworks/gateway/upstream/sim"
)

// Config is the gateway's configuration.
type Config struct {
	DatabaseURL            string        `env:"DATABASE_URL"`
	Listen                 string        `env:"GATEWAY_LISTEN" envDefault:":8080"`
	H2C                    bool          `env:"GATEWAY_H2C"`
	TLSCert                string        `env:"GATEWAY_TLS_CERT"`
	TLSKey                 string        `env:"GATEWAY_TLS_KEY"`
	File                   string        `env:"GATEWAY_CONFIG"`
	Upstream               string        `env:"GATEWAY_UPSTREAM"`
	UpstreamKey            string        `env:"GATEWAY_UPSTREAM_KEY"`
	UpstreamKeyHeader      string        `env:"GATEWAY_UPSTREAM_KEY_HEADER"`
	UpstreamTimeout        time.Duration `env:"GATEWAY_UPSTREAM_TIMEOUT" envDefault:"120s"`
	UpstreamStreamLimit    time.Duration `env:"GATEWAY_UPSTREAM_STREAM_LIMIT" envDefault:"30m"`
	UpstreamH2C            bool          `env:"GATEWAY_UPSTREAM_H2C"`
	UpstreamMaxTokensField string        `env:"GATEWAY_UPSTREAM_MAX_TOKENS_FIELD"`
	UpstreamStreamOptions  *bool         `env:"GATEWAY_UPSTREAM_STREAM_OPTIONS"`
	ModelMap               string        `env:"GATEWAY_MODEL_MAP"`
	Multipliers            string        `env:"GATEWAY_MULTIPLIERS" envDefault:"instant=1,reasoning=4,elements=2"`
	BatchDiscount          string        `env:"GATEWAY_BATCH_DISCOUNT" envDefault:"0.5"`
	EvidenceRetention      time.Duration `env:"GATEWAY_EVIDENCE_RETENTION" envDefault:"168h"`
	SSEKeepalive           time.Duration `env:"GATEWAY_SSE_KEEPALIVE" envDefault:"15s"`
	RateLimit              int           `env:"GATEWAY_RATE_LIMIT"`
	BatchWindow            time.Duration `env:"GATEWAY_BATCH_WINDOW" envDefault:"24h"`
	BatchRetention         time.Duration `env:"GATEWAY_BATCH_RETENTION" envDefault:"720h"`
	RequestRetention       time.Duration `env:"GATEWAY_REQUEST_RETENTION" envDefault:"2160h"`
	Lease                  time.Duration `env:"GATEWAY_LEASE" envDefault:"30s"`
	DrainConcurrency       int           `env:"GATEWAY_DRAIN_CONCURRENCY" envDefault:"32"`
	SimTokenLatency        time.Duration `env:"GATEWAY_SIM_TOKEN_LATENCY" envDefault:"2ms"`
	DBMaxConns             int32         `env:"GATEWAY_DB_MAX_CONNS" envDefault:"8"`
	DBStartWait            time.Duration `env:"GATEWAY_DB_START_WAIT" envDefault:"30s"`
	MetricsListen          string        `env:"GATEWAY_METRICS_LISTEN" envDefault:":9810"`
	Pprof                  bool          `env:"GATEWAY_PPROF"`
	ShutdownGrace          time.Duration `env:"GATEWAY_SHUTDOWN_GRACE" envDefault:"30s"`
	BodyTimeout            time.Duration `env:"GATEWAY_BODY_TIMEOUT" envDefault:"30s"`
	TurnPlaces             int           `env:"GATEWAY_TURN_PLACES"`
	TurnWait               time.Duration `env:"GATEWAY_TURN_WAIT" envDefault:"10s"`
	DrainDelay             time.Duration `env:"GATEWAY_DRAIN_DELAY" envDefault:"5s"`
	CORSOrigins            []string      `env:"GATEWAY_CORS_ORIGINS" envSeparator:","`
	TrustedProxies         []string      `env:"GATEWAY_TRUSTED_PROXIES" envSeparator:","`
	TraceContent           bool          `env:"GATEWAY_TRACE_CONTENT"`
	Compress               bool          `env:"GATEWAY_COMPRESS"`

	// proxies are TrustedProxies read (see Proxies).
	proxies []netip.Prefix
}

// minRequestRetention is the shortest request retention: the usage view
// treats times as past the retention an hour early (gateway.RetentionMargin).
const minRequestRetention = 24 * time.Hour

// Load reads the configuration from the environment.
func Load() (Config, error) {
	return load(nil)
}

// devDefaults are the defaults of gateway dev where they differ from serve's:
// no load balancer stands in front of it, so on Ctrl-C it stops at once.
var devDefaults = map[string]string{"GATEWAY_DRAIN_DELAY": "0s"}

// LoadDev reads the configuration from the environment as Load does, with
// gateway dev's defaults for what is not set.
func LoadDev() (Config, error) {
	return load(devDefaults)
}

// load reads the configuration from the environment, with defaults for the
// variables it leaves unset or empty, in place of the fields' own.
func load(defaults map[string]string) (Config, error) {
	environ := env.ToMap(os.Environ())
	for name, value := range defaults {
		if environ[name] == "" { // unset or empty, as the fields' defaults
			environ[name] = value
		}
	}
	cfg, err := env.ParseAsWithOptions[Config](env.Options{Environment: environ})
	if err != nil {
		return Config{}, fmt.Errorf("error reading configuration: %w", err)
	}
	if cfg.EvidenceRetention <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_EVIDENCE_RETENTION must be positive")
	}
	if cfg.SSEKeepalive <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_SSE_KEEPALIVE must be positive")
	}
	if cfg.BatchWindow <= 0 || cfg.BatchRetention <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_BATCH_WINDOW and GATEWAY_BATCH_RETENTION must be positive")
	}
	if cfg.RequestRetention != 0 && cfg.RequestRetention < max(minRequestRetention, cfg.EvidenceRetention) {
		return Config{}, fmt.Errorf("GATEWAY_REQUEST_RETENTION must be 0 (requests kept for good) or at least 24h and GATEWAY_EVIDENCE_RETENTION (%s): a request without sources holds its evidence in its own row", cfg.EvidenceRetention)
	}
	if cfg.Lease < time.Second {
		return Config{}, fmt.Errorf("GATEWAY_LEASE must be at least 1s")
	}
	if cfg.DrainConcurrency < 1 {
		return Config{}, fmt.Errorf("GATEWAY_DRAIN_CONCURRENCY must be at least 1")
	}
	if cfg.ShutdownGrace <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_SHUTDOWN_GRACE must be positive")
	}
	if cfg.DrainDelay < 0 {
		return Config{}, fmt.Errorf("GATEWAY_DRAIN_DELAY must not be negative")
	}
	if cfg.BodyTimeout <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_BODY_TIMEOUT must be positive")
	}
	if cfg.TurnPlaces < 0 {
		return Config{}, fmt.Errorf("GATEWAY_TURN_PLACES must not be negative (0: half the cores)")
	}
	if cfg.TurnWait <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_TURN_WAIT must be positive")
	}
	if cfg.UpstreamTimeout <= 0 || cfg.UpstreamStreamLimit <= 0 {
		return Config{}, fmt.Errorf("GATEWAY_UPSTREAM_TIMEOUT and GATEWAY_UPSTREAM_STREAM_LIMIT must be positive")
	}
	if cfg.RateLimit < 0 {
		return Config{}, fmt.Errorf("GATEWAY_RATE_LIMIT must not be negative")
	}
	if cfg.File != "" && (cfg.Upstream != "" || cfg.UpstreamKey != "" || cfg.ModelMap != "" || cfg.UpstreamH2C || cfg.UpstreamMaxTokensField != "" || cfg.UpstreamStreamOptions != nil || cfg.UpstreamKeyHeader != "") {
		return Config{}, fmt.Errorf("GATEWAY_CONFIG names a file of providers: leave GATEWAY_UPSTREAM, GATEWAY_UPSTREAM_KEY, GATEWAY_UPSTREAM_KEY_HEADER, GATEWAY_UPSTREAM_H2C, GATEWAY_UPSTREAM_MAX_TOKENS_FIELD, GATEWAY_UPSTREAM_STREAM_OPTIONS and GATEWAY_MODEL_MAP unset (they are the one-provider shorthand)")
	}
	if cfg.UpstreamKeyHeader != "" {
		if problem := headerProblem(cfg.UpstreamKeyHeader); problem != "" {
			return Config{}, fmt.Errorf("GATEWAY_UPSTREAM_KEY_HEADER %s", problem)
		}
	}
	if !maxTokensField(cfg.UpstreamMaxTokensField) {
		return Config{}, fmt.Errorf("GATEWAY_UPSTREAM_MAX_TOKENS_FIELD must be %s or %s, got %q", openai.MaxCompletionTokens, openai.MaxTokens, cfg.UpstreamMaxTokensField)
	}
	if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
		return Config{}, fmt.Errorf("GATEWAY_TLS_CERT and GATEWAY_TLS_KEY go together: set both (a certificate file and its key's) or neither")
	}
	if cfg.TLSCert != "" && cfg.H2C {
		return Config{}, fmt.Errorf("GATEWAY_H2C is HTTP/2 without TLS: leave it unset with GATEWAY_TLS_CERT (over TLS, HTTP/2 is served to the clients that ask for it)")
	}
	if cfg.DBMaxConns < 2 {
		return Config{}, fmt.Errorf("GATEWAY_DB_MAX_CONNS must be at least 2")
	}
	if cfg.DBStartWait < 0 {
		return Config{}, fmt.Errorf("GATEWAY_DB_START_WAIT must not be negative (0: no wait)")
	}
	if cfg.proxies, err = readProxies(cfg.TrustedProxies); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// Proxies returns GATEWAY_TRUSTED_PROXIES: the proxies (load balancers) whose
// X-Forwarded-For names a request's client.
func (c Config) Proxies() []netip.Prefix {
	return c.proxies
}

// readProxies reads GATEWAY_TRUSTED_PROXIES, each an address or a CIDR range.
func readProxies(list []string) ([]netip.Prefix, error) {
	var proxies []netip.Prefix
	for _, s := range list {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			addr, addrErr := netip.ParseAddr(s)
			if addrErr != nil {
				return nil, fmt.Errorf("GATEWAY_TRUSTED_PROXIES: %q is neither an address nor a CIDR range such as 10.0.0.0/8", s)
			}
			addr = addr.Unmap()
			p = netip.PrefixFrom(addr, addr.BitLen())
		}
		proxies = append(proxies, p.Masked())
	}
	return proxies, nil
}

// Check checks what a server builds of c beyond what Load checks: the rate
// card and the routes, with their providers' keys. serve and dev call it
// before they connect to a database, so that a mistake there stops the
// start at once, reported as itself, whether a database answers or not. The
// operator commands, which need the database alone, do not.
func (c Config) Check() error {
	if _, err := c.RateCard(); err != nil {
		return err
	}
	if _, err := c.Certificate(nil); err != nil {
		return err
	}
	_, _, err := c.routesWithKeys()
	if err != nil && c.File != "" {
		return fmt.Errorf("GATEWAY_CONFIG: %w", err)
	}
	return err
}

// Certificate returns the certificate GATEWAY_TLS_CERT and GATEWAY_TLS_KEY
// name, read again when their files change (onChange, when set, is told of
// each change: certfile.Load), or nil when the API is served without TLS.
func (c Config) Certificate(onChange func(*x509.Certificate, error)) (*certfile.Pair, error) {
	if c.TLSCert == "" {
		return nil, nil
	}
	pair, err := certfile.Load(c.TLSCert, c.TLSKey, onChange)
	if err != nil {
		return nil, fmt.Errorf("GATEWAY_TLS_CERT/GATEWAY_TLS_KEY: %w", err)
	}
	return pair, nil
}

// RateLimits returns the requests per minute per key: GATEWAY_RATE_LIMIT for
// every tier when set, otherwise the tier defaults.
func (c Config) RateLimits() gateway.RateLimits {
	if c.RateLimit > 0 {
		return gateway.RateLimits{Free: c.RateLimit, Developer: c.RateLimit}
	}
	return gateway.DefaultRateLimits
}

// RateCard returns the rate card of GATEWAY_MULTIPLIERS and GATEWAY_BATCH_DISCOUNT.
func (c Config) RateCard() (*metering.RateCard, error) {
	pairs, err := upstream.ParseModelPairs(c.Multipliers)
	if err != nil {
		return nil, fmt.Errorf("GATEWAY_MULTIPLIERS: %w", err)
	}
	rc, err := metering.NewRateCard(pairs, c.BatchDiscount)
	if err != nil {
		return nil, fmt.Errorf("GATEWAY_MULTIPLIERS/GATEWAY_BATCH_DISCOUNT: %w", err)
	}
	return rc, nil
}

// UpstreamName is what the log says of the upstream: the file, or the URL.
func (c Config) UpstreamName() string {
	switch {
	case c.File != "":
		return c.File
	case c.Upstream == "":
		return "sim"
	}
	return c.Upstream
}

// Router builds the upstream router: from GATEWAY_CONFIG's file when set,
// otherwise from the one-provider shorthand (GATEWAY_UPSTREAM, sim by default,
// each model of GATEWAY_MODEL_MAP, or every canonical model under its own
// name, served by that provider). logger is told of targets that refuse the
// gateway's access.
func (c Config) Router(tok *metering.Tokenizer, m *metrics.Metrics, logger *slog.Logger) (*routing.Router, error) {
	rc, _, err := c.Routes(tok, m, logger)
	if err != nil {
		return nil, err
	}
	return routing.New(rc)
}

// Routes reads the routes as Router does (GATEWAY_CONFIG's file read anew),
// as a router's configuration for routing.Router.Replace, with the file's
// description of them.
func (c Config) Routes(tok *metering.Tokenizer, m *metrics.Metrics, logger *slog.Logger) (routing.Config, string, error) {
	f, keys, err := c.routesWithKeys()
	if err != nil {
		return routing.Config{}, "", err
	}
	return f.RouterConfig(keys, tok, c.SimTokenLatency, m, logger), f.Describe(), nil
}

// routesWithKeys returns the routes (see routes) and their providers' keys.
func (c Config) routesWithKeys() (*File, map[string]string, error) {
	f, err := c.routes()
	if err != nil {
		return nil, nil, err
	}
	keys, err := f.Keys(os.Getenv)
	if err != nil {
		return nil, nil, err
	}
	return f, keys, nil
}

// FileCheck is how often a replica looks at GATEWAY_CONFIG's file and the
// key files it names for a change.
const FileCheck = 5 * time.Second

// ReloadRoutes replaces router's routes with those of GATEWAY_CONFIG's file,
// read anew, at each signal of hangups (SIGHUP), and when the file or a key
// file it names (api_key_file) has changed, looked at every FileCheck (as a
// mounted ConfigMap or Secret changes under a running replica), until ctx
// ends, recording each load in m. read is the files' stamp taken before the
// routes in use were read (FilesStamp), so that a change made since, before
// this loop began, is reloaded too. A file that does not check leaves the
// routes in use as they are, until it changes again; without a file (the
// routes come from the environment, which a running process cannot read
// again) nothing is reloaded.
func (c Config) ReloadRoutes(ctx context.Context, hangups <-chan os.Signal, router *routing.Router, read filestamp.Stamp, tok *metering.Tokenizer, m *metrics.Metrics, logger *slog.Logger) {
	var check <-chan time.Time
	var watched []string
	seen := read
	look := func() {
		watched = c.files()
		seen = filestamp.Of(watched...)
	}
	if c.File != "" {
		ticker := time.NewTicker(FileCheck)
		defer ticker.Stop()
		check = ticker.C
		watched = c.files()
	}
	for {
		cause := "SIGHUP"
		select {
		case <-ctx.Done():
			return
		case <-hangups:
		case <-check:
			if filestamp.Of(watched...).Equal(seen) {
				continue
			}
			cause = "the configuration's files changed"
		}
		if c.File == "" {
			logger.Warn("SIGHUP: the routes come from the environment, which a running process cannot read again; nothing was reloaded (restart the replica, or use GATEWAY_CONFIG)")
			continue
		}
		look() // before reading them: a change meanwhile is seen at the next check
		rc, routes, err := c.Routes(tok, m, logger)
		if err == nil {
			err = router.Replace(rc)
		}
		m.ConfigLoaded(err == nil, time.Now())
		if err != nil {
			logger.Error(cause+": the configuration file was not loaded; the routes in use stay", "file", c.File, "error", err)
			continue
		}
		logger.Info(cause+": routes reloaded", "file", c.File, "routes", routes)
	}
}

// FilesStamp stamps GATEWAY_CONFIG's file and the key files it names, for
// ReloadRoutes: taken before the routes are read.
func (c Config) FilesStamp() filestamp.Stamp {
	if c.File == "" {
		return nil
	}
	return filestamp.Of(c.files()...)
}

// files are GATEWAY_CONFIG's file and the key files it names, as it reads
// now (the file alone when it does not read).
func (c Config) files() []string {
	files := []string{c.File}
	if f, err := LoadFile(c.File); err == nil {
		files = append(files, f.keyFiles()...)
	}
	return files
}

// routes returns the file, or the shorthand as if it were one.
func (c Config) routes() (*File, error) {
	if c.File != "" {
		return LoadFile(c.File)
	}
	name, spec := "sim", ProviderSpec{Type: "sim"}
	if c.Upstream != "" && c.Upstream != "sim" {
		if !httpURL(c.Upstream) {
			return nil, fmt.Errorf("GATEWAY_UPSTREAM must be sim or an http(s) base URL, got %q", c.Upstream)
		}
		if problem := baseURLProblem(c.Upstream); problem != "" {
			return nil, fmt.Errorf("GATEWAY_UPSTREAM %s", problem)
		}
		name, spec = "upstream", ProviderSpec{Type: "openai", BaseURL: c.Upstream, Timeout: c.UpstreamTimeout, StreamLimit: c.UpstreamStreamLimit, H2C: c.UpstreamH2C, MaxTokensField: c.UpstreamMaxTokensField, APIKeyHeader: c.UpstreamKeyHeader,
			NoStreamOptions: c.UpstreamStreamOptions != nil && !*c.UpstreamStreamOptions}
		if c.UpstreamKey != "" {
			spec.APIKeyEnv = "GATEWAY_UPSTREAM_KEY"
		}
	}
	models := gateway.OwnNames()
	if c.ModelMap != "" {
		pairs, err := upstream.ParseModelPairs(c.ModelMap)
		if err != nil {
			return nil, fmt.Errorf("GATEWAY_MODEL_MAP: %w", err)
		}
		models = pairs
	}
	f := &File{path: "environment", Providers: map[string]ProviderSpec{name: spec}, Models: map[gateway.Model]RouteSpec{}}
	for m, upstreamModel := range models {
		f.Models[m] = RouteSpec{Strategy: routing.Ordered, Targets: []TargetSpec{{Provider: name, UpstreamModel: upstreamModel, Weight: 1}}}
	}
	return f, nil
}

// RouterConfig is the configuration of the router the file describes, with
// the providers' keys (see Keys). logger is told of targets that refuse the
// gateway's access.
func (f *File) RouterConfig(keys map[string]string, tok *metering.Tokenizer, simLatency time.Duration, m *metrics.Metrics, logger *slog.Logger) routing.Config {
	clients := map[string]upstream.Provider{}
	for name, pr := range f.Providers {
		if pr.Type == "sim" {
			clients[name] = &sim.Provider{Tokenizer: tok, TokenLatency: simLatency}
			continue
		}
		clients[name] = openai.New(openai.Config{
			BaseURL: pr.BaseURL, APIKey: keys[name], APIKeyHeader: pr.APIKeyHeader, Timeout: pr.Timeout, StreamLimit: pr.StreamLimit, IdleTimeout: pr.IdleTimeout, H2C: pr.H2C, Headers: pr.Headers,
			PingAfter: pr.PingAfter, MaxTokensField: pr.MaxTokensField, NoStreamOptions: pr.NoStreamOptions,
		})
	}
	routes := map[gateway.Model]routing.Route{}
	for model, spec := range f.Models {
		rt := routing.Route{Strategy: spec.Strategy}
		for _, t := range spec.Targets {
			rt.Targets = append(rt.Targets, routing.Target{Provider: t.Provider, UpstreamModel: t.UpstreamModel, Weight: t.Weight, Client: clients[t.Provider]})
		}
		routes[model] = rt
	}
	return routing.Config{Routes: routes, MaxAttempts: f.MaxAttempts, MaxTime: f.MaxTime, Circuit: f.Circuit, Metrics: m, Logger: logger}
}
