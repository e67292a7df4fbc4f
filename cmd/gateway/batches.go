package main

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/store"
)

// maxListedBatches bounds --limit of batches list.
const maxListedBatches = 10000

func batchesCmd() *cobra.Command {
	batches := &cobra.Command{Use: "batches", Short: "List the batches of every account and cancel one", Long: "Lists the batches of every account and cancels one, as its owner can through the API.\n" + databaseHelp}

	var account, status, before string
	var limit int
	list := &cobra.Command{
		Use:   "list",
		Short: "List batches, newest first, with their progress (to find one to cancel)",
		Long: "Lists batches, newest first: id, account, project, status, items (done of total: completed, failed, cancelled), " +
			"rungs billed so far, when created, when its window ends, and the error of a batch that failed or expired.\n" + databaseHelp,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			statuses, err := parseStatuses(status)
			if err != nil {
				return err
			}
			if limit < 1 || limit > maxListedBatches {
				return fmt.Errorf("--limit: want 1 to %d, got %d", maxListedBatches, limit)
			}
			var cursor *uuid.UUID
			if before != "" {
				id, err := uuid.Parse(before)
				if err != nil {
					return fmt.Errorf("--before: want a batch id (a UUID, as batches list shows), got %q", before)
				}
				cursor = &id
			}
			return withStore(cmd, func(st *store.Store) error {
				found, err := st.BatchesForOperator(cmd.Context(), account, statuses, cursor, limit)
				if err != nil {
					return err
				}
				printBatches(cmd.OutOrStdout(), found)
				return nil
			})
		},
	}
	list.Flags().StringVar(&account, "account", "", "only this account's batches")
	list.Flags().StringVar(&status, "status", "", "only batches of these statuses, comma-separated ("+listed(gateway.BatchStatuses)+"), or open ("+listed(openStatuses())+")")
	list.Flags().IntVar(&limit, "limit", 50, "at most this many batches")
	list.Flags().StringVar(&before, "before", "", "only batches older than this one (the last id of the page before: the next page)")

	var cancelAccount string
	cancel := &cobra.Command{
		Use:   "cancel BATCH_ID | --account A",
		Short: "Cancel a batch of any account, or every open batch of one, as its owner would",
		Long: "Cancels a batch as its owner can through the API: a queued batch is cancelled with every item; an in-progress batch " +
			"becomes cancelling, its items not yet started are cancelled at once (their estimates given back), and it is cancelled when " +
			"the items running finish (they are billed). A batch already finished or cancelling is not cancellable. With --account, " +
			"every queued and in-progress batch of the account, one after the other, a line each (its id and status after, or why not); " +
			"one that fails does not stop the others.\n" + databaseHelp,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == (cancelAccount != "") {
				return errors.New("name a batch (BATCH_ID) or an account (--account A), not both")
			}
			if cancelAccount != "" {
				return withStore(cmd, func(st *store.Store) error {
					outcomes, err := st.CancelAccountBatches(cmd.Context(), cancelAccount)
					return reportCancels(cmd.OutOrStdout(), cmd.ErrOrStderr(), outcomes, err)
				})
			}
			id, err := uuid.Parse(args[0])
			if err != nil {
				return fmt.Errorf("want a batch id (a UUID, as batches list shows), got %q", args[0])
			}
			return withStore(cmd, func(st *store.Store) error {
				status, err := st.CancelBatchForOperator(cmd.Context(), id)
				if err != nil {
					return err
				}
				if status == gateway.BatchCancelling {
					fmt.Fprintln(cmd.ErrOrStderr(), "cancelling: its items not started are cancelled; those running finish, are billed, and then it is cancelled")
					return nil
				}
				fmt.Fprintln(cmd.ErrOrStderr(), status)
				return nil
			})
		},
	}
	cancel.Flags().StringVar(&cancelAccount, "account", "", "cancel every queued and in-progress batch of this account")
	batches.AddCommand(list, cancel)
	return batches
}

// reportCancels writes a line for each batch an account's cancel tried (its
// id and status after, or why it was not cancelled) and a count of each;
// an error, unless every batch not cancelled had finished meanwhile (not
// cancellable), or err, when the cancel stopped.
func reportCancels(out, log io.Writer, outcomes []store.CancelOutcome, err error) error {
	var cancelled, cancelling, notCancelled, failed int
	for _, o := range outcomes {
		if o.Err != nil {
			fmt.Fprintf(out, "%s not cancelled: %v\n", o.ID, o.Err)
			notCancelled++
			if gateway.ErrorCodeOf(o.Err) != gateway.EBatchNotCancellable {
				failed++
			}
			continue
		}
		fmt.Fprintf(out, "%s %s\n", o.ID, o.Status)
		if o.Status == gateway.BatchCancelling {
			cancelling++
		} else {
			cancelled++
		}
	}
	fmt.Fprintf(log, "%d cancelled, %d cancelling, %d not cancelled\n", cancelled, cancelling, notCancelled)
	if err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("%d batch(es) could not be cancelled (see above); run it again to retry them", failed)
	}
	return nil
}

// parseStatuses reads --status: statuses separated by commas, open standing
// for those not yet finished; nil when empty (every status).
func parseStatuses(v string) ([]gateway.BatchStatus, error) {
	var out []gateway.BatchStatus
	for _, s := range strings.Split(v, ",") {
		switch s = strings.TrimSpace(s); {
		case s == "":
		case s == "open":
			out = append(out, openStatuses()...)
		case slices.Contains(gateway.BatchStatuses, gateway.BatchStatus(s)):
			out = append(out, gateway.BatchStatus(s))
		default:
			return nil, fmt.Errorf("--status: want statuses among %s, or open, got %q", listed(gateway.BatchStatuses), s)
		}
	}
	return out, nil
}

// openStatuses are the statuses of batches not yet finished (--status open).
func openStatuses() []gateway.BatchStatus {
	return slices.DeleteFunc(slices.Clone(gateway.BatchStatuses), gateway.BatchStatus.Terminal)
}

// listed is statuses as --status takes them, separated by commas.
func listed(statuses []gateway.BatchStatus) string {
	names := make([]string, len(statuses))
	for i, s := range statuses {
		names[i] = string(s)
	}
	return strings.Join(names, ", ")
}

// printBatches writes batches as a table, one batch a line.
func printBatches(w io.Writer, batches []store.OperatorBatch) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tACCOUNT\tPROJECT\tSTATUS\tDONE\tCOMPLETED\tFAILED\tCANCELLED\tRUNGS\tCREATED\tEXPIRES\tERROR")
	for _, b := range batches {
		done := b.CompletedRequests + b.FailedRequests + b.CancelledRequests
		errorCode := "-"
		if b.ErrorCode != nil {
			errorCode = *b.ErrorCode
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d/%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", b.ID, b.Account, b.Project, b.Status, done, b.TotalRequests,
			b.CompletedRequests, b.FailedRequests, b.CancelledRequests, b.TotalRungs, b.CreatedAt.UTC().Format(time.RFC3339), b.ExpiresAt.UTC().Format(time.RFC3339), errorCode)
	}
	_ = tw.Flush()
}
