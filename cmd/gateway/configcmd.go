package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream/tryout"
)

func configCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Work with the configuration file (GATEWAY_CONFIG)"}
	var try bool
	var timeout time.Duration
	check := &cobra.Command{
		Use:   "check [FILE]",
		Short: "Check a configuration file (or, without one, the environment's routes): syntax, providers, routes, and every provider's key (api_key_env set, api_key_file readable)",
		Long: "Reads FILE as `gateway serve` would with GATEWAY_CONFIG=FILE, reports every problem with its line, and exits non-zero if there is one; otherwise prints the routes it describes. " +
			"Without FILE, it reads the routes from the environment as `gateway serve` would: GATEWAY_CONFIG's file, or the one-provider shorthand (GATEWAY_UPSTREAM and the variables beside it), " +
			"and warns on standard error of each variable named as the settings are (GATEWAY_…) that none of them is, with the setting it likely means.\n\n" +
			"With --call, it then calls each target once asked for a whole reply and once streamed, with a prompt of a few tokens (real calls, which the upstreams bill), " +
			"and says how each answered: in how long, what, and with what usage; it exits non-zero if a call failed.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg := config.Config{}
			if len(args) == 1 {
				cfg.File = args[0]
			} else if loaded, err := config.Load(); err != nil {
				return err
			} else {
				cfg = loaded
				for _, s := range cfg.Strays(os.Environ()) {
					fmt.Fprintf(cmd.ErrOrStderr(), "warning: %s is no setting of the gateway's: ignored", s.Name)
					if s.Nearest != "" {
						fmt.Fprintf(cmd.ErrOrStderr(), " (%s?)", s.Nearest)
					}
					fmt.Fprintln(cmd.ErrOrStderr())
				}
			}
			tok, err := metering.DefaultTokenizer()
			if err != nil {
				return err
			}
			routes, described, err := cfg.Routes(tok, nil, nil)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprint(out, described)
			if !try {
				return nil
			}
			failed := 0
			fmt.Fprintln(out)
			reports := tryout.Run(cmd.Context(), tryout.Targets(routes.Routes), timeout)
			for _, r := range reports {
				fmt.Fprint(out, r)
				if r.Failed() {
					failed++
				}
			}
			if failed > 0 {
				return fmt.Errorf("%d of %d targets failed a call", failed, len(reports))
			}
			return nil
		},
	}
	check.Flags().BoolVar(&try, "call", false, "call each target once, whole and streamed, and say how it answered")
	check.Flags().DurationVar(&timeout, "timeout", time.Minute, "the most each call may take (with --call)")
	cmd.AddCommand(check)
	return cmd
}

// warnStrays logs, each in a line of its own, the variables of the
// environment named as the gateway's settings that cfg does not read
// (Config.Strays): a misspelt setting is otherwise silently left at its
// default.
func warnStrays(ctx context.Context, cfg config.Config, logger *slog.Logger) {
	for _, s := range cfg.Strays(os.Environ()) {
		attrs := []any{"variable", s.Name}
		if s.Nearest != "" {
			attrs = append(attrs, "did_you_mean", s.Nearest)
		}
		logger.WarnContext(logsample.Each(ctx), "a variable named as the gateway's settings is no setting: ignored", attrs...)
	}
}
