// Command gateway is the inference gateway: the HTTP server and its operator
// commands (serve, dev, migrate, keys, limits, batches, usage, config). It only parses
// configuration and wires the packages that do the work.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/internal/logbuffer"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/lostlines"
	"github.com/rungworks/gateway/internal/stopsignal"
)

func main() {
	ctx, release := stopsignal.Notify(context.Background())
	defer release()
	// Warnings and errors alike are sampled (a few and a count each window),
	// so that an outage does not write one line a request.
	// Lines that cannot be written (the reader of standard error gone) are
	// counted, and a serving replica exports the count.
	stderr := lostlines.New(os.Stderr)
	logs := logsample.New(slog.NewJSONHandler(stderr, nil))
	logger := slog.New(logs)
	slog.SetDefault(logger)
	// A serving replica's lines (one a request) go out in groups; the other
	// commands write theirs at once, in order with what they print.
	serveBuffer := logbuffer.New(stderr, logbuffer.DefaultDelay)
	serveLogs := logsample.New(slog.NewJSONHandler(serveBuffer, nil))

	root := &cobra.Command{
		Use:           "gateway",
		Short:         "Inference gateway: responses, streams and batches metered in rungs",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(serveCmd(slog.New(serveLogs), stderr.Lost), devCmd(logger, stderr.Lost), migrateCmd(), keysCmd(), limitsCmd(), batchesCmd(), usageCmd(), probeCmd(), configCmd())
	err := root.ExecuteContext(ctx)
	logs.Flush()
	serveLogs.Flush()
	_ = serveBuffer.Flush()
	if err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}
