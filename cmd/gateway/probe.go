package main

import (
	"fmt"
	"net/http"
	"time"

	"github.com/spf13/cobra"
)

func probeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "probe URL",
		Short: "Exit 0 when URL answers 200 (a container health check without curl)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client := &http.Client{Timeout: 3 * time.Second}
			resp, err := client.Get(args[0])
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s answered %s", args[0], resp.Status)
			}
			return nil
		},
	}
}
