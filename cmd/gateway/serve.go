package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/access"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/clockwatch"
	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/internal/lostpeer"
	"github.com/rungworks/gateway/internal/memrelease"
	"github.com/rungworks/gateway/internal/retry"
	"github.com/rungworks/gateway/internal/serverlog"
	"github.com/rungworks/gateway/internal/stopsignal"
	"github.com/rungworks/gateway/internal/version"
	"github.com/rungworks/gateway/ledger"
	"github.com/rungworks/gateway/maintenance"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/tracing"
)

func serveCmd(logger *slog.Logger, logLinesLost func() uint64) *cobra.Command {
	return &cobra.Command{
		Use:   "serve",
		Short: "Run the HTTP server (applies pending migrations first, under a lock)",
		Long:  "Serves the API and drains batches; applies pending migrations first, under a PostgreSQL advisory lock, waiting up to GATEWAY_DB_START_WAIT (30 s) for a database that is away (not listening yet, starting up; a signal meanwhile stops it, exit status 0). Reads DATABASE_URL (required) and the GATEWAY_* variables (see the README). SIGTERM or SIGINT stops it after the work in flight, within GATEWAY_SHUTDOWN_GRACE; a second one cuts that work short.",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// A replica whose log reader goes away (a broken pipe) goes on
			// serving, and counts the lines it loses
			// (gateway_log_lines_lost_total), instead of being killed at its
			// next line with the work in flight.
			signal.Ignore(syscall.SIGPIPE)
			cfg, err := config.Load()
			if err != nil {
				return err
			}
			if err := cfg.Check(); err != nil {
				return err
			}
			warnStrays(cmd.Context(), cfg, logger)
			if cfg.DatabaseURL == "" {
				return errors.New("DATABASE_URL is required (or run `gateway dev` for a private database)")
			}
			st, err := openStoreWhenUp(cmd.Context(), cfg, cmd.CommandPath(), logger)
			if stoppedAtStart(cmd.Context(), err, logger) {
				return nil
			}
			if err != nil {
				return err
			}
			defer st.Pool().Close()
			return serve(cmd.Context(), cfg, st, logger, logLinesLost, nil)
		},
	}
}

// openStore connects to PostgreSQL, its sessions named name, and applies
// pending migrations.
func openStore(ctx context.Context, cfg config.Config, name string) (*store.Store, error) {
	pool, err := store.Connect(ctx, cfg.DatabaseURL, name, cfg.DBMaxConns)
	if err != nil {
		return nil, err
	}
	if _, err := store.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return store.New(pool), nil
}

// openStoreWhenUp is openStore for a replica's start: while the database is
// away (not listening yet, starting up, restarting), it tries again, each
// failure that a wait follows logged, for up to cfg.DBStartWait, so that a
// replica started beside a database's restart (a deploy during a failover,
// a compose file starting both) serves once the database is back instead
// of exiting into its supervisor's back-off. Any other failure (a login
// refused, a database that does not exist) stops the start at once; so does
// ctx's end (SIGTERM).
func openStoreWhenUp(ctx context.Context, cfg config.Config, name string, logger *slog.Logger) (*store.Store, error) {
	waiting := func(err error, wait time.Duration) {
		logger.Warn("the database is away at the start: waiting for it", "error", err, "retry_in", wait.String(), "wait", cfg.DBStartWait.String())
	}
	var st *store.Store
	err := retry.UntilTelling(ctx, cfg.DBStartWait, 2*time.Second, store.Away, waiting, func(ctx context.Context) error {
		var err error
		st, err = openStore(ctx, cfg, name)
		return err
	})
	if err != nil && store.Away(err) && ctx.Err() == nil {
		return nil, fmt.Errorf("the database stayed away for the start's wait, %v (GATEWAY_DB_START_WAIT): %w", cfg.DBStartWait, err)
	}
	return st, err
}

// stoppedAtStart reports, and logs, whether err, openStoreWhenUp's, is that
// of a replica asked to stop (SIGTERM, ctx's end) before it served: a stop,
// as the one of a replica that served, not a failure.
func stoppedAtStart(ctx context.Context, err error, logger *slog.Logger) bool {
	if err == nil || ctx.Err() == nil {
		return false
	}
	logger.Info("asked to stop while opening the database at the start: stopped", "error", err)
	return true
}

// serve wires the gateway and serves until ctx ends; its metrics export
// logLinesLost, the count of log lines lost; ready, when set, is called with
// the listening address once requests are accepted. On shutdown it stops
// being ready, stops accepting and claiming, hands back the batch items it
// has not started, lets requests, streams and batch items in flight finish
// within the grace period, fails INTERRUPTED the items cut after dispatch
// (those cut before go back), and returns.
func serve(ctx context.Context, cfg config.Config, st *store.Store, logger *slog.Logger, logLinesLost func() uint64, ready func(addr string)) error {
	tok, err := metering.DefaultTokenizer()
	if err != nil {
		return err
	}
	rateCard, err := cfg.RateCard()
	if err != nil {
		return err
	}
	build := version.Read()
	m := metrics.New()
	m.Build(build.Version, build.Revision)
	st.Observe(m)
	m.DatabasePool(st.PoolStats)
	m.LogLinesLost(logLinesLost)
	// One router for interactive requests and the drainer alike: what one
	// learns of a target's health, the other uses. It guards every target
	// (D11: what an upstream returns is untrusted).
	routesRead := cfg.FilesStamp() // before the read: a change from then on is reloaded
	router, err := cfg.Router(tok, m, logger)
	if err != nil {
		return err
	}
	m.ConfigLoaded(true, time.Now())
	stopTracing, err := tracing.Setup(ctx, tracing.Options{Content: cfg.TraceContent, Logger: logger, Failed: m.TraceExportFailed})
	if err != nil {
		return err
	}
	defer func() {
		flushCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := stopTracing(flushCtx); err != nil {
			logger.Warn("error flushing traces", "error", err)
		}
	}()
	estimator := &metering.Estimator{Tokenizer: tok, RateCard: rateCard, OnClamp: func(c metering.Clamp) {
		logger.Warn("upstream usage clamped", "model", c.Model, "side", c.Side, "reported", c.Reported, "bound", c.Bound)
		m.Clamp(string(c.Model), c.Side)
	}}
	// The hot path from memory: keys cached (an account's dropped on every
	// change to its keys, to it or to its projects), rates and quota from
	// leased slices (an account's given back on a change to it or to its
	// projects), settlements committed in groups. Every replica runs these
	// with its own leases.
	owner := uuid.Must(uuid.NewV7())
	ledge := ledger.New(ledger.Config{Owner: owner, Lease: cfg.Lease, Unavailable: store.Transient, Logger: logger, Metrics: m}, st)
	// A quarter of the connections at most for key lookups: a flood of
	// unknown keys leaves the rest to settlements and grants.
	keys := access.NewKeys(access.Config{Logger: logger, Metrics: m, MaxLookups: max(1, int(cfg.DBMaxConns)/4), OnChange: func(table string, account uuid.UUID) {
		if table != "api_keys" {
			ledge.Invalidate(account)
		}
	}}, st)
	rates := ratelimit.New(ratelimit.Config{Limits: cfg.RateLimits(), Logger: logger}, st)
	infer := &inference.Service{
		Provider:          router,
		Models:            router,
		Estimator:         estimator,
		Ledger:            ledge,
		EvidenceRetention: cfg.EvidenceRetention,
		RetryAfter:        5 * time.Second,
		Unavailable:       store.Transient,
		MayHaveCommitted:  store.MayHaveCommitted,
		Logger:            logger,
		Metrics:           m,
	}
	srv, err := server.New(server.Config{
		Auth:             &access.Authenticator{Keys: keys, Rates: rates},
		Inference:        infer,
		Evidence:         st,
		Usage:            st,
		Batches:          &batch.Service{Store: st, Models: router, Estimator: estimator, Window: cfg.BatchWindow, Metrics: m},
		BatchData:        st,
		Readiness:        server.AllReady{st, keys},
		Metrics:          m,
		Logger:           logger,
		SSEKeepalive:     cfg.SSEKeepalive,
		CORSOrigins:      cfg.CORSOrigins,
		TrustedProxies:   cfg.Proxies(),
		BodyTimeout:      cfg.BodyTimeout,
		TurnPlaces:       cfg.TurnPlaces,
		TurnWait:         cfg.TurnWait,
		Unavailable:      store.Transient,
		Compress:         cfg.Compress,
		RequestRetention: cfg.RequestRetention,
	})
	if err != nil {
		return err
	}

	certificate, err := cfg.Certificate(func(served *x509.Certificate, err error) {
		if err != nil {
			logger.Error("the TLS certificate's files changed and were not read; the certificate read before is served", "error", err)
			return
		}
		logger.Info("the TLS certificate's files changed: the new certificate is served from the next connection", certificateAttrs(served)...)
	})
	if err != nil {
		return err
	}
	ln, err := lostpeer.Listen(ctx, cfg.Listen)
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w; set GATEWAY_LISTEN to another address (another gateway on this host?)", cfg.Listen, err)
	}
	// net/http's own lines (a failed TLS handshake, a panic) as records.
	errorLog := serverlog.New(logger, m.TLSHandshakeFailed)
	httpServer := newHTTPServer(srv, cfg.H2C, errorLog)
	if certificate != nil {
		// HTTP/2 for the clients that ask for it (ALPN), HTTP/1.1 for the
		// others; a renewed certificate from the next handshake on.
		httpServer.TLSConfig = &tls.Config{GetCertificate: certificate.GetCertificate, NextProtos: []string{"h2", "http/1.1"}}
		ln = tls.NewListener(ln, httpServer.TLSConfig)
		m.TLSCertificate(certificate.NotAfter)
	}
	servers := []*http.Server{httpServer}
	errc := make(chan error, 2)
	go func() { errc <- httpServer.Serve(srv.Listener(ln)) }()
	if cfg.MetricsListen != "" && cfg.MetricsListen != "off" {
		metricsLn, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			ln.Close()
			return fmt.Errorf("cannot listen for metrics on %s: %w; set GATEWAY_METRICS_LISTEN to another address, or off (each replica on a host needs its own)", cfg.MetricsListen, err)
		}
		metricsServer := newHTTPServer(m.Handler(cfg.Pprof), false, errorLog)
		servers = append(servers, metricsServer)
		go func() { errc <- metricsServer.Serve(metricsLn) }()
		logger.Info("metrics listening", "addr", metricsLn.Addr().String())
	}

	background, stopBackground := context.WithCancel(ctx)
	defer stopBackground()
	// The ledger outlives the requests it serves: it folds back its slices
	// once the server has finished every request.
	ledgerCtx, stopLedger := context.WithCancel(context.WithoutCancel(ctx))
	ledgerDone := make(chan struct{})
	go func() { defer close(ledgerDone); ledge.Run(ledgerCtx) }()
	defer func() { stopLedger(); <-ledgerDone }()
	go keys.Run(background)
	go rates.Run(background)
	go memrelease.New().Run(background)
	go clockwatch.Run(background, st, clockwatch.Config{Logger: logger, Metrics: m})
	hangups := make(chan os.Signal, 1)
	signal.Notify(hangups, syscall.SIGHUP)
	defer signal.Stop(hangups)
	go cfg.ReloadRoutes(background, hangups, router, routesRead, tok, m, logger)
	go maintenance.Run(background, st, maintenance.Jobs(st, maintenance.Settings{
		BatchWindow: cfg.BatchWindow, BatchRetention: cfg.BatchRetention, Lease: cfg.Lease, RequestRetention: cfg.RequestRetention,
	}, m), logger)
	hurried := stopsignal.Hurried(ctx)
	drain := drainer.New(drainer.Config{
		Owner: owner, Concurrency: cfg.DrainConcurrency, Lease: cfg.Lease, Grace: cfg.ShutdownGrace, Hurried: hurried.Done(),
		EvidenceRetention: cfg.EvidenceRetention, Health: router, Metrics: m,
	}, st, router, estimator, logger)
	drained := make(chan struct{})
	go func() { defer close(drained); drain.Run(ctx) }()

	listening := []any{"addr", ln.Addr().String(), "tls", certificate != nil, "upstream", cfg.UpstreamName()}
	if certificate != nil {
		listening = append(listening, certificateAttrs(certificate.Leaf())...)
	}
	listening = append(listening, "version", build.Version, "revision", build.Revision)
	logger.Info("gateway listening", listening...)
	if ready != nil {
		ready(ln.Addr().String())
	}
	select {
	case err := <-errc:
		return fmt.Errorf("error serving: %w", err)
	case <-ctx.Done():
	}

	stopLog := context.AfterFunc(hurried, func() { logger.Warn("asked again to stop: the grace period ends now") })
	defer stopLog()
	shutdown(cfg, srv, servers, hurried, logger)
	// Settlements sent again after their replies went out get the final
	// window too, while the ledger still commits.
	lateCtx, cancelLate := context.WithTimeout(context.Background(), finalWindow)
	defer cancelLate()
	if err := infer.WaitLateSettlements(lateCtx); err != nil {
		logger.Error("settlements sent with their usage were still unconfirmed at the end of the shutdown; each is logged", "error", err)
	}
	<-drained
	logger.Info("gateway stopped")
	return nil
}

// certificateAttrs are what the log says of a certificate served: the names
// it serves, and its end.
func certificateAttrs(c *x509.Certificate) []any {
	names := slices.Clone(c.DNSNames)
	for _, ip := range c.IPAddresses {
		names = append(names, ip.String())
	}
	return []any{"certificate_names", names, "certificate_not_after", c.NotAfter.UTC().Format(time.RFC3339)}
}

// finalWindow is how long, past the grace, calls cut at its end have to send
// their last events before connections are closed.
const finalWindow = 5 * time.Second

// shutdown stops serving within the grace period plus finalWindow: /readyz
// answers 503 at once and, for the drain delay (within the grace), the listener
// still accepts, so load balancers stop sending work first; then the listener
// closes and requests in flight may finish until the grace ends, or until
// hurried does (the process asked to stop again). Calls still running
// then are cut (server.Abort): JSON requests get INFERENCE_BUSY and streams
// response.error then response.completed with what was billed.
func shutdown(cfg config.Config, srv *server.Server, servers []*http.Server, hurried context.Context, logger *slog.Logger) {
	logger.Info("shutting down", "grace", cfg.ShutdownGrace.String(), "drain_delay", cfg.DrainDelay.String())
	graceCtx, cancel := context.WithTimeout(hurried, cfg.ShutdownGrace)
	defer cancel()
	srv.Drain()
	select {
	case <-time.After(min(cfg.DrainDelay, cfg.ShutdownGrace/2)):
	case <-graceCtx.Done():
	}
	if err := finish(graceCtx, srv, servers[0]); err != nil {
		logger.Warn("requests still open at the end of the grace period; cutting their upstream calls", "error", err)
		srv.Abort()
		finalCtx, cancelFinal := context.WithTimeout(context.Background(), finalWindow)
		defer cancelFinal()
		if err := finish(finalCtx, srv, servers[0]); err != nil {
			_ = servers[0].Close()
			srv.CloseStreams()
		}
	}
	for _, s := range servers[1:] {
		_ = s.Close()
	}
}

// finish stops the HTTP server and waits, until ctx ends, for its requests,
// the streams served off their connections' goroutines included.
func finish(ctx context.Context, srv *server.Server, hs *http.Server) error {
	if err := hs.Shutdown(ctx); err != nil {
		return err
	}
	return srv.WaitStreams(ctx)
}

// newHTTPServer applies the server limits: headers must arrive within 10 s and
// stay under 64 KiB, idle connections close after 2 minutes. Bodies are bounded
// per route (GATEWAY_BODY_TIMEOUT, answered 408), not by a whole-request read
// timeout, which would also cut streams that outlive it. There is no write
// timeout: streams last as long as inference does. With h2c, HTTP/2 without
// TLS (prior knowledge, as a load balancer speaks it) is served beside
// HTTP/1.1: many requests share a connection instead of one connection each.
// What the server logs on its own goes to errorLog.
func newHTTPServer(h http.Handler, h2c bool, errorLog *log.Logger) *http.Server {
	s := &http.Server{
		Handler:           h,
		ErrorLog:          errorLog,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       server.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
	}
	if h2c {
		s.Protocols = new(http.Protocols)
		s.Protocols.SetHTTP1(true)
		s.Protocols.SetUnencryptedHTTP2(true)
	}
	return s
}
