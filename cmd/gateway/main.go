// Command gateway is the inference gateway: the HTTP server and its operator
// commands (serve, dev, migrate, keys, limits, config). It only parses configuration and
// wires the packages that do the work.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	slog.SetDefault(logger)

	root := &cobra.Command{
		Use:           "gateway",
		Short:         "Inference gateway: responses, streams and batches metered in rungs",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(serveCmd(logger), devCmd(logger), migrateCmd(), keysCmd(), limitsCmd(), probeCmd(), configCmd())
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}
