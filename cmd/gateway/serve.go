package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/maintenance"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
)

func serveCmd(logger *slog.Logger) *cobra.Command {
	return &cobra.Command{
		Use:   "serve",
		Short: "Run the HTTP server (applies pending migrations first, under a lock)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load()
			if err != nil {
				return err
			}
			if cfg.DatabaseURL == "" {
				return errors.New("DATABASE_URL is required (or run `gateway dev` for a private database)")
			}
			st, err := openStore(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			defer st.Pool().Close()
			return serve(cmd.Context(), cfg, st, logger, nil)
		},
	}
}

// openStore connects to PostgreSQL and applies pending migrations.
func openStore(ctx context.Context, cfg config.Config) (*store.Store, error) {
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("error parsing DATABASE_URL: %w", err)
	}
	poolCfg.MaxConns = cfg.DBMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("error connecting to PostgreSQL: %w", err)
	}
	if _, err := store.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return store.New(pool, store.Options{RateLimits: cfg.RateLimits()}), nil
}

// serve wires the gateway and serves until ctx ends; ready, when set, is called
// with the listening address once requests are accepted.
func serve(ctx context.Context, cfg config.Config, st *store.Store, logger *slog.Logger, ready func(addr string)) error {
	tok, err := metering.DefaultTokenizer()
	if err != nil {
		return err
	}
	rateCard, err := cfg.RateCard()
	if err != nil {
		return err
	}
	models, err := cfg.Models()
	if err != nil {
		return err
	}
	provider, err := cfg.Provider(tok)
	if err != nil {
		return err
	}
	estimator := &metering.Estimator{Tokenizer: tok, RateCard: rateCard}
	srv, err := server.New(server.Config{
		Auth: st,
		Inference: &inference.Service{
			Provider:          provider,
			Models:            models,
			Estimator:         estimator,
			Ledger:            st,
			EvidenceRetention: cfg.EvidenceRetention,
			RetryAfter:        5 * time.Second,
			Logger:            logger,
		},
		Evidence:     st,
		Usage:        st,
		Batches:      &batch.Service{Store: st, Models: models, Estimator: estimator, Window: cfg.BatchWindow},
		BatchData:    st,
		Logger:       logger,
		SSEKeepalive: cfg.SSEKeepalive,
	})
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("error listening on %s: %w", cfg.Listen, err)
	}
	maintenanceCtx, stopMaintenance := context.WithCancel(ctx)
	defer stopMaintenance()
	go maintenance.Run(maintenanceCtx, maintenance.Jobs(st, maintenance.Settings{
		BatchWindow: cfg.BatchWindow, BatchRetention: cfg.BatchRetention, Lease: cfg.Lease,
	}), logger)
	drain := drainer.New(drainer.Config{
		Concurrency: cfg.DrainConcurrency, Lease: cfg.Lease, EvidenceRetention: cfg.EvidenceRetention,
	}, st, provider, models, estimator, logger)
	drained := make(chan struct{})
	go func() { defer close(drained); drain.Run(ctx) }()

	httpServer := &http.Server{
		Handler:           srv,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
	}
	errc := make(chan error, 1)
	go func() { errc <- httpServer.Serve(ln) }()
	logger.Info("gateway listening", "addr", ln.Addr().String(), "upstream", cfg.Upstream)
	if ready != nil {
		ready(ln.Addr().String())
	}

	select {
	case err := <-errc:
		return fmt.Errorf("error serving: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := httpServer.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("error shutting down: %w", err)
	}
	<-drained
	logger.Info("gateway stopped")
	return nil
}
