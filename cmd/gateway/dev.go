package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/pglocal"
	"github.com/rungworks/gateway/store"
)

func devCmd(logger *slog.Logger, logLinesLost func() uint64) *cobra.Command {
	var dataDir string
	var pgPort int
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the gateway with a private PostgreSQL and a ready developer key",
		Long: `dev is the embedded default: without DATABASE_URL it starts a private PostgreSQL
from the machine's own binaries in the data folder, migrates, creates a developer
key on first start, prints it with a ready curl line, and serves (with the built-in
simulator unless GATEWAY_UPSTREAM says otherwise). Running it again reuses the data.
One dev at a time runs on a data folder; a PostgreSQL left running there by a
dev that was killed is stopped first.

The private database's connection string is printed and saved in the data folder,
so gateway keys and gateway limits, run in the same folder without DATABASE_URL,
find it. With DATABASE_URL set, that database is used instead, waited for
as serve waits for it (GATEWAY_DB_START_WAIT, 30 s) when it is away.

Ports: the API listens on GATEWAY_LISTEN (:8080), metrics on
GATEWAY_METRICS_LISTEN (:9810, or off), PostgreSQL on --pg-port (54329; 0 picks
any free port). A port in use is reported at once with what moves it.

No load balancer stands in front of dev, so on Ctrl-C it does not wait for
one: GATEWAY_DRAIN_DELAY is 0 unless set. Requests in flight may finish for
GATEWAY_SHUTDOWN_GRACE (30 s); Ctrl-C again cuts them short. Closing the
terminal (SIGHUP) stops it as Ctrl-C does.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.LoadDev()
			if err != nil {
				return err
			}
			if err := cfg.Check(); err != nil {
				return err
			}
			warnStrays(cmd.Context(), cfg, logger)
			// Closing the terminal dev runs in sends it SIGHUP: it stops as
			// on Ctrl-C instead of running on, with its PostgreSQL and
			// ports, without one (serve reloads its routes on SIGHUP).
			ctx, stopOnHangup := signal.NotifyContext(cmd.Context(), syscall.SIGHUP)
			defer stopOnHangup()
			if cfg.DatabaseURL == "" {
				unlock, err := lockDataDir(dataDir)
				if err != nil {
					return err
				}
				defer unlock()
				pgDir := filepath.Join(dataDir, "postgres")
				if stopped, err := pglocal.StopLeftover(ctx, pgDir); err != nil {
					return err
				} else if stopped {
					logger.Warn("stopped the PostgreSQL that a gateway dev which ended without stopping it (killed) left running", "dir", pgDir)
				}
				cluster, err := pglocal.Start(ctx, pglocal.Options{Dir: pgDir, Port: pgPort, Durable: true})
				if errors.Is(err, pglocal.ErrPortInUse) {
					return fmt.Errorf("%w: pass --pg-port N to use another (make run ARGS=\"--pg-port N\"), or --pg-port 0 for any free port", err)
				}
				if err != nil {
					return err
				}
				defer func() {
					if err := cluster.Stop(); err != nil {
						logger.Error("error stopping PostgreSQL", "error", err)
					}
				}()
				if err := cluster.CreateDatabase(ctx, "gateway"); err != nil {
					return err
				}
				cfg.DatabaseURL = cluster.URL("gateway")
				if err := os.WriteFile(filepath.Join(dataDir, databaseURLFile), []byte(cfg.DatabaseURL+"\n"), 0o600); err != nil {
					return fmt.Errorf("error saving the dev database's address: %w", err)
				}
			}
			st, err := openStoreWhenUp(ctx, cfg, cmd.CommandPath(), logger)
			if stoppedAtStart(ctx, err, logger) {
				return nil
			}
			if err != nil {
				return err
			}
			defer st.Pool().Close()
			key, err := devKey(ctx, st, filepath.Join(dataDir, "dev-key"))
			if err != nil {
				return err
			}
			return serve(ctx, cfg, st, logger, logLinesLost, func(addr string) {
				printWelcome(cmd.OutOrStdout(), cfg.TLSCert != "", addr, key, cfg.UpstreamName(), cfg.DatabaseURL)
			})
		},
	}
	cmd.Flags().StringVar(&dataDir, "data", devDataDir, "folder for the private PostgreSQL and the developer key")
	cmd.Flags().IntVar(&pgPort, "pg-port", 54329, "port of the private PostgreSQL on 127.0.0.1; 0 picks any free port")
	return cmd
}

// lockDataDir takes the lock of dev's data folder dir, held until unlock (or
// the process's end, however it ends): a second dev on the folder is
// refused, and a PostgreSQL found running in it while the lock is held is
// one that a dev killed before it could stop it left behind.
func lockDataDir(dir string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("error creating %s: %w", dir, err)
	}
	path := filepath.Join(dir, "dev.lock")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("error opening %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("another gateway dev runs on %s: stop it first, or pass --data for another folder", dir)
		}
		return nil, fmt.Errorf("error locking %s: %w", path, err)
	}
	return func() { _ = f.Close() }, nil
}

// devKey returns the developer key saved in path while it still authenticates,
// otherwise creates one (account dev, project default) and saves it.
func devKey(ctx context.Context, st *store.Store, path string) (string, error) {
	if b, err := os.ReadFile(path); err == nil {
		token := strings.TrimSpace(string(b))
		if _, err := st.LookupKey(ctx, token); err == nil {
			return token, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("error reading %s: %w", path, err)
	}
	tier := gateway.TierDeveloper
	token, err := st.CreateKey(ctx, store.CreateKeyParams{
		Account: "dev", Project: "default", Tier: &tier,
		Scopes: []gateway.Scope{gateway.ScopeInference, gateway.ScopeUsage},
	})
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", fmt.Errorf("error creating %s: %w", filepath.Dir(path), err)
	}
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("error saving the developer key: %w", err)
	}
	return token, nil
}

func printWelcome(w io.Writer, overTLS bool, addr, key, upstreamName, databaseURL string) {
	host, port, _ := net.SplitHostPort(addr)
	if host == "" || host == "::" || host == "0.0.0.0" {
		host = "127.0.0.1"
	}
	scheme := "http://"
	if overTLS {
		scheme = "https://"
	}
	base := scheme + net.JoinHostPort(host, port)
	fmt.Fprintf(w, `
Gateway ready on %s (upstream: %s)
API key: %s
Database: %s
  (gateway keys and gateway limits find it when run here; elsewhere: export DATABASE_URL='%s')

Try it:
  curl -s %s/api/v1/responses \
    -H 'Authorization: Bearer %s' \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "Explain rungs in one sentence.", "web_search": true}'

OpenAPI document: %s/openapi.json   (Ctrl-C stops the gateway and its database)
`, base, upstreamName, key, databaseURL, databaseURL, base, key, base)
}
