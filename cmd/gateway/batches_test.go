package main

import (
	"bytes"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/store"
)

// TestReportCancels: an account's cancel writes a line a batch and the
// counts, and fails only for a batch that could not be cancelled for another
// reason than having finished meanwhile, or when it stopped.
func TestReportCancels(t *testing.T) {
	t.Parallel()
	ids := []uuid.UUID{uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())}
	finished := gateway.Errorf(gateway.EBatchNotCancellable, "a batch that is completed cannot be cancelled")
	outcomes := []store.CancelOutcome{
		{ID: ids[0], Status: gateway.BatchCancelled},
		{ID: ids[1], Status: gateway.BatchCancelling},
		{ID: ids[2], Err: finished},
	}
	var out, log bytes.Buffer
	require.NoError(t, reportCancels(&out, &log, outcomes, nil), "a batch that finished meanwhile is no failure")
	require.Equal(t, ids[0].String()+" cancelled\n"+ids[1].String()+" cancelling\n"+ids[2].String()+" not cancelled: "+finished.Error()+"\n", out.String())
	require.Equal(t, "1 cancelled, 1 cancelling, 1 not cancelled\n", log.String())

	out.Reset()
	log.Reset()
	err := reportCancels(&out, &log, append(outcomes, store.CancelOutcome{ID: ids[3], Err: errors.New("connection lost")}), nil)
	require.EqualError(t, err, "1 batch(es) could not be cancelled (see above); run it again to retry them")
	require.Contains(t, out.String(), ids[3].String()+" not cancelled: connection lost\n")
	require.Equal(t, "1 cancelled, 1 cancelling, 2 not cancelled\n", log.String())

	stopped := errors.New("error listing batches: context canceled")
	require.Equal(t, stopped, reportCancels(&out, &log, nil, stopped), "what was tried is reported, and why it stopped")
}
