package main

import (
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream/tryout"
)

func configCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Work with the configuration file (GATEWAY_CONFIG)"}
	var try bool
	var timeout time.Duration
	check := &cobra.Command{
		Use:   "check FILE",
		Short: "Check a configuration file: syntax, providers, routes, and every provider's key (api_key_env set, api_key_file readable)",
		Long: "Reads FILE as `gateway serve` would with GATEWAY_CONFIG=FILE, reports every problem with its line, and exits non-zero if there is one; otherwise prints the routes it describes.\n\n" +
			"With --call, it then calls each target once asked for a whole reply and once streamed, with a prompt of a few tokens (real calls, which the upstreams bill), " +
			"and says how each answered: in how long, what, and with what usage; it exits non-zero if a call failed.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := config.LoadFile(args[0])
			if err != nil {
				return err
			}
			keys, err := f.Keys(os.Getenv)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprint(out, f.Describe())
			if !try {
				return nil
			}
			tok, err := metering.DefaultTokenizer()
			if err != nil {
				return err
			}
			failed := 0
			fmt.Fprintln(out)
			reports := tryout.Run(cmd.Context(), tryout.Targets(f.RouterConfig(keys, tok, 0, nil, nil).Routes), timeout)
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
