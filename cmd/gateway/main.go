// Command gateway is the inference gateway: the HTTP server and its operator
// commands (serve, dev, migrate, keys, limits, batches, usage, config). It only parses
// configuration and wires the packages that do the work.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/internal/logbuffer"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	slog.SetDefault(logger)
	// A serving replica's lines (one a request) go out in groups; the other
	// commands write theirs at once, in order with what they print.
	serveLogs := logbuffer.New(os.Stderr, logbuffer.DefaultDelay)

	root := &cobra.Command{
		Use:           "gateway",
		Short:         "Inference gateway: responses, streams and batches metered in rungs",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(serveCmd(slog.New(slog.NewJSONHandler(serveLogs, nil))), devCmd(logger), migrateCmd(), keysCmd(), limitsCmd(), batchesCmd(), usageCmd(), probeCmd(), configCmd())
	err := root.ExecuteContext(ctx)
	_ = serveLogs.Flush()
	if err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}
