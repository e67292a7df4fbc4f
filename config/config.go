// Package config reads the gateway's configuration from the environment
// (decisions D2) and builds the pieces it describes: the upstream provider, the
// model map and the rate card.
package config

import (
	"fmt"
	"net/url"
	"time"

	"github.com/caarlos0/env/v11"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
	"github.com/rungworks/gateway/upstream/sim"
)

// Config is the gateway's configuration.
type Config struct {
	DatabaseURL       string        `env:"DATABASE_URL"`
	Listen            string        `env:"GATEWAY_LISTEN" envDefault:":8080"`
	Upstream          string        `env:"GATEWAY_UPSTREAM" envDefault:"sim"`
	UpstreamKey       string        `env:"GATEWAY_UPSTREAM_KEY"`
	UpstreamTimeout   time.Duration `env:"GATEWAY_UPSTREAM_TIMEOUT" envDefault:"120s"`
	UpstreamH2C       bool          `env:"GATEWAY_UPSTREAM_H2C"`
	ModelMap          string        `env:"GATEWAY_MODEL_MAP"`
	Multipliers       string        `env:"GATEWAY_MULTIPLIERS" envDefault:"instant=1,reasoning=4,elements=2"`
	BatchDiscount     string        `env:"GATEWAY_BATCH_DISCOUNT" envDefault:"0.5"`
	EvidenceRetention time.Duration `env:"GATEWAY_EVIDENCE_RETENTION" envDefault:"168h"`
	SSEKeepalive      time.Duration `env:"GATEWAY_SSE_KEEPALIVE" envDefault:"15s"`
	RateLimit         int           `env:"GATEWAY_RATE_LIMIT"`
	BatchWindow       time.Duration `env:"GATEWAY_BATCH_WINDOW" envDefault:"24h"`
	BatchRetention    time.Duration `env:"GATEWAY_BATCH_RETENTION" envDefault:"720h"`
	Lease             time.Duration `env:"GATEWAY_LEASE" envDefault:"30s"`
	DrainConcurrency  int           `env:"GATEWAY_DRAIN_CONCURRENCY" envDefault:"32"`
	SimTokenLatency   time.Duration `env:"GATEWAY_SIM_TOKEN_LATENCY" envDefault:"2ms"`
	DBMaxConns        int32         `env:"GATEWAY_DB_MAX_CONNS" envDefault:"8"`
	MetricsListen     string        `env:"GATEWAY_METRICS_LISTEN" envDefault:":9810"`
	Pprof             bool          `env:"GATEWAY_PPROF"`
	ShutdownGrace     time.Duration `env:"GATEWAY_SHUTDOWN_GRACE" envDefault:"30s"`
	BodyTimeout       time.Duration `env:"GATEWAY_BODY_TIMEOUT" envDefault:"30s"`
	DrainDelay        time.Duration `env:"GATEWAY_DRAIN_DELAY" envDefault:"5s"`
	CORSOrigins       []string      `env:"GATEWAY_CORS_ORIGINS" envSeparator:","`
}

// Load reads the configuration from the environment.
func Load() (Config, error) {
	cfg, err := env.ParseAs[Config]()
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
	if cfg.RateLimit < 0 {
		return Config{}, fmt.Errorf("GATEWAY_RATE_LIMIT must not be negative")
	}
	if cfg.DBMaxConns < 2 {
		return Config{}, fmt.Errorf("GATEWAY_DB_MAX_CONNS must be at least 2")
	}
	return cfg, nil
}

// RateLimits returns the requests per minute per key: GATEWAY_RATE_LIMIT for
// every tier when set, otherwise the tier defaults.
func (c Config) RateLimits() gateway.RateLimits {
	if c.RateLimit > 0 {
		return gateway.RateLimits{Free: c.RateLimit, Developer: c.RateLimit}
	}
	return gateway.DefaultRateLimits
}

// Models returns the model map: GATEWAY_MODEL_MAP when set (models left out are
// unavailable), otherwise each canonical name mapped to itself.
func (c Config) Models() (upstream.ModelMap, error) {
	if c.ModelMap == "" {
		return upstream.DefaultModelMap(), nil
	}
	pairs, err := upstream.ParseModelPairs(c.ModelMap)
	if err != nil {
		return nil, fmt.Errorf("GATEWAY_MODEL_MAP: %w", err)
	}
	return upstream.ModelMap(pairs), nil
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

// Provider returns the upstream: the built-in simulator for "sim", otherwise an
// OpenAI-compatible client of the URL.
func (c Config) Provider(tok *metering.Tokenizer) (upstream.Provider, error) {
	if c.Upstream == "sim" {
		return &sim.Provider{Tokenizer: tok, TokenLatency: c.SimTokenLatency}, nil
	}
	u, err := url.Parse(c.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("GATEWAY_UPSTREAM must be sim or an http(s) base URL, got %q", c.Upstream)
	}
	return openai.New(openai.Config{BaseURL: c.Upstream, APIKey: c.UpstreamKey, Timeout: c.UpstreamTimeout, H2C: c.UpstreamH2C}), nil
}
