package main

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/store"
)

// dayLayout is how the usage report reads and writes UTC days.
const dayLayout = "2006-01-02"

func usageCmd() *cobra.Command {
	var from, to, account string
	var asCSV bool
	cmd := &cobra.Command{
		Use:   "usage",
		Short: "Report the usage committed per account, project, day, model and entry point (for billing)",
		Long: "Reports the usage committed from --from to --to (UTC days, both included) per account, project, UTC day of completion, " +
			"model and entry point: requests and rungs (input, output, total), as every request and batch item was billed. " +
			"--csv writes it for a spreadsheet or a billing system.\n" + databaseHelp,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			start, end, err := reportDays(from, to, time.Now())
			if err != nil {
				return err
			}
			return withStore(cmd, func(st *store.Store) error {
				lines, err := st.UsageReport(cmd.Context(), start, end, account)
				if err != nil {
					return err
				}
				if asCSV {
					return writeUsageCSV(cmd.OutOrStdout(), lines)
				}
				printUsage(cmd.OutOrStdout(), lines)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "first UTC day reported, YYYY-MM-DD (default: the first of this month)")
	cmd.Flags().StringVar(&to, "to", "", "last UTC day reported, YYYY-MM-DD (default: today)")
	cmd.Flags().StringVar(&account, "account", "", "only this account")
	cmd.Flags().BoolVar(&asCSV, "csv", false, "write CSV with a header line")
	return cmd
}

// reportDays turns the report's first and last days (empty: the first of
// now's month, and now's day) into the instants [start, end) they cover.
func reportDays(from, to string, now time.Time) (start, end time.Time, err error) {
	today := gateway.UTCDay(now)
	start, end = today.AddDate(0, 0, 1-today.Day()), today
	if from != "" {
		if start, err = time.Parse(dayLayout, from); err != nil {
			return start, end, fmt.Errorf("--from: want a day as YYYY-MM-DD, got %q", from)
		}
	}
	if to != "" {
		if end, err = time.Parse(dayLayout, to); err != nil {
			return start, end, fmt.Errorf("--to: want a day as YYYY-MM-DD, got %q", to)
		}
	}
	if end.Before(start) {
		return start, end, errors.New("--to is before --from")
	}
	return start, end.AddDate(0, 0, 1), nil
}

var usageColumns = []string{"account", "project", "day", "model", "entry_point", "requests", "input_rungs", "output_rungs", "total_rungs"}

func usageFields(l store.UsageLine) []string {
	return []string{l.Account, l.Project, l.Day.Format(dayLayout), l.Model, l.EntryPoint,
		strconv.FormatInt(l.Requests, 10), strconv.FormatInt(l.InputRungs, 10), strconv.FormatInt(l.OutputRungs, 10), strconv.FormatInt(l.TotalRungs, 10)}
}

// writeUsageCSV writes the report as CSV, its first line the column names.
func writeUsageCSV(w io.Writer, lines []store.UsageLine) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(usageColumns)
	for _, l := range lines {
		_ = cw.Write(usageFields(l))
	}
	cw.Flush()
	return cw.Error()
}

// printUsage writes the report as a table, with the sums on its last line.
func printUsage(w io.Writer, lines []store.UsageLine) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(fields []string) { fmt.Fprintln(tw, strings.Join(fields, "\t")) }
	header := make([]string, len(usageColumns))
	for i, c := range usageColumns {
		header[i] = strings.ToUpper(c)
	}
	row(header)
	var total store.UsageLine
	for _, l := range lines {
		row(usageFields(l))
		total.Requests += l.Requests
		total.InputRungs += l.InputRungs
		total.OutputRungs += l.OutputRungs
		total.TotalRungs += l.TotalRungs
	}
	sums := usageFields(total)
	sums[0], sums[2] = "total", ""
	row(sums)
	_ = tw.Flush()
}
