// Command gateway is the inference gateway: the HTTP server and its operator
// commands (serve, dev, migrate, keys, limits, batches, usage, config). It only parses
// configuration and wires the packages that do the work.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/internal/logbuffer"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/logsplit"
	"github.com/rungworks/gateway/internal/lostlines"
	"github.com/rungworks/gateway/internal/stopsignal"
	"github.com/rungworks/gateway/internal/version"
)

// logCloseWait is how long the process waits at its exit for a stalled
// standard error to take the lines that wait.
const logCloseWait = 5 * time.Second

// serveLogging is a serving replica's logging to out: its lines go out in
// groups, off the requests' way (logbuffer), warnings and errors sampled
// (logsample). While out blocks, its errors (few: sampled, or one for each
// request whose usage may be missing) are kept where its other lines are
// dropped.
func serveLogging(out io.Writer) (*logsample.Handler, *logbuffer.Writer) {
	buf := logbuffer.New(out, logbuffer.DefaultDelay)
	return logsample.New(logsplit.New(slog.LevelError, slog.NewJSONHandler(buf, nil), slog.NewJSONHandler(buf.Kept(), nil))), buf
}

func main() {
	ctx, release := stopsignal.Notify(context.Background())
	defer release()
	// Lines that cannot be written (the reader of standard error gone) are
	// counted, and a serving replica exports the count.
	stderr := lostlines.New(os.Stderr)
	// Warnings and errors alike are sampled (a few and a count each window),
	// so that an outage does not write one line a request.
	logs := logsample.New(slog.NewJSONHandler(stderr, nil))
	logger := slog.New(logs)
	slog.SetDefault(logger)
	// A serving replica's lines (one a request) go out in groups; the other
	// commands write theirs at once, in order with what they print.
	serveLogs, serveBuffer := serveLogging(stderr)
	// Lost: those whose write failed, and those dropped while stderr blocked.
	logLinesLost := func() uint64 { return stderr.Lost() + serveBuffer.Dropped() }

	root := &cobra.Command{
		Use:           "gateway",
		Short:         "Inference gateway: responses, streams and batches metered in rungs",
		SilenceUsage:  true,
		SilenceErrors: true,
		// gateway --version: the version and the source revision of the
		// build, as gateway_build_info exports them.
		Version: version.Read().String(),
	}
	root.AddCommand(serveCmd(slog.New(serveLogs), logLinesLost), devCmd(logger, logLinesLost), migrateCmd(), keysCmd(), limitsCmd(), batchesCmd(), usageCmd(), probeCmd(), configCmd())
	err := root.ExecuteContext(ctx)
	logs.Flush()
	serveLogs.Flush()
	_ = serveBuffer.Close(logCloseWait)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}
