package main

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"time"

	"github.com/spf13/cobra"
)

func probeCmd() *cobra.Command {
	var insecure bool
	probe := &cobra.Command{
		Use:   "probe URL",
		Short: "Exit 0 when URL answers 200 (a container health check without curl)",
		Long: "Exits 0 when URL answers 200. An https URL's certificate is checked against the system's roots " +
			"(and SSL_CERT_FILE or SSL_CERT_DIR) unless --insecure says not to, for a replica's own address, which " +
			"its certificate may not name.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			transport := http.DefaultTransport.(*http.Transport).Clone()
			transport.TLSClientConfig = &tls.Config{InsecureSkipVerify: insecure}
			client := &http.Client{Timeout: 3 * time.Second, Transport: transport}
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
	probe.Flags().BoolVar(&insecure, "insecure", false, "do not check an https URL's certificate (a probe of the replica's own address)")
	return probe
}
