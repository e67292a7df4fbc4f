package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway/config"
)

func configCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Work with the configuration file (GATEWAY_CONFIG)"}
	check := &cobra.Command{
		Use:   "check FILE",
		Short: "Check a configuration file: syntax, providers, routes, and every provider's key (api_key_env set, api_key_file readable)",
		Long:  "Reads FILE as `gateway serve` would with GATEWAY_CONFIG=FILE, reports every problem with its line, and exits non-zero if there is one; otherwise prints the routes it describes.",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := config.LoadFile(args[0])
			if err != nil {
				return err
			}
			if _, err := f.Keys(os.Getenv); err != nil {
				return err
			}
			fmt.Fprint(cmd.OutOrStdout(), f.Describe())
			return nil
		},
	}
	cmd.AddCommand(check)
	return cmd
}
