package gateway_test

import (
	"encoding/json"
	"maps"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/apitest"
)

// TestNextBatchStatus checks every status × every event (items done in each of
// its outcomes) against the table of interface §3.1 and decisions D8.
func TestNextBatchStatus(t *testing.T) {
	t.Parallel()
	const (
		invalid        = "invalid"
		notCancellable = "409"
	)
	type outcomeCase struct {
		name    string
		outcome gateway.ItemsOutcome
	}
	outcomes := []outcomeCase{
		{"some succeeded", gateway.ItemsOutcome{AnySucceeded: true}},
		{"none succeeded", gateway.ItemsOutcome{}},
		{"window elapsed, some succeeded", gateway.ItemsOutcome{AnySucceeded: true, WindowElapsed: true}},
		{"window elapsed, none succeeded", gateway.ItemsOutcome{WindowElapsed: true}},
	}
	// want[from][event] for the first three events; itemsDone[from][outcome].
	want := map[gateway.BatchStatus][3]string{
		gateway.BatchQueued:     {"in_progress", "cancelled", "expired"},
		gateway.BatchInProgress: {"in_progress", "cancelling", "in_progress"},
		gateway.BatchCancelling: {"cancelling", notCancellable, "cancelling"},
		gateway.BatchCompleted:  {invalid, notCancellable, "completed"},
		gateway.BatchFailed:     {invalid, notCancellable, "failed"},
		gateway.BatchCancelled:  {invalid, notCancellable, "cancelled"},
		gateway.BatchExpired:    {invalid, notCancellable, "expired"},
	}
	// The same while an item is claimed (running): a queued batch waits for
	// it, as an in_progress one does, on a cancel and at its window's end.
	wantRunning := maps.Clone(want)
	wantRunning[gateway.BatchQueued] = [3]string{"in_progress", "cancelling", "queued"}
	itemsDone := map[gateway.BatchStatus][4]string{
		gateway.BatchQueued:     {"completed", "failed", "expired", "expired"},
		gateway.BatchInProgress: {"completed", "failed", "expired", "expired"},
		gateway.BatchCancelling: {"cancelled", "cancelled", "cancelled", "cancelled"},
		gateway.BatchCompleted:  {invalid, invalid, invalid, invalid},
		gateway.BatchFailed:     {invalid, invalid, invalid, invalid},
		gateway.BatchCancelled:  {invalid, invalid, invalid, invalid},
		gateway.BatchExpired:    {invalid, invalid, invalid, invalid},
	}
	check := func(from gateway.BatchStatus, ev gateway.BatchEvent, o gateway.ItemsOutcome, expect string) {
		t.Helper()
		got, err := gateway.NextBatchStatus(from, ev, o)
		switch expect {
		case invalid:
			require.ErrorIs(t, err, gateway.ErrInvalidTransition, "%s + %s", from, ev)
			require.Equal(t, from, got)
		case notCancellable:
			require.Equal(t, gateway.EBatchNotCancellable, gateway.ErrorCodeOf(err), "%s + %s", from, ev)
			require.Equal(t, from, got)
			require.False(t, from.Cancellable(), from)
		default:
			require.NoError(t, err, "%s + %s", from, ev)
			require.Equal(t, gateway.BatchStatus(expect), got, "%s + %s %+v", from, ev, o)
			if ev == gateway.EventCancel {
				require.True(t, from.Cancellable(), from)
			}
		}
		if from.Terminal() && err == nil {
			require.Equal(t, from, got, "a terminal batch never changes")
		}
	}
	require.Len(t, want, len(gateway.BatchStatuses))
	for _, from := range gateway.BatchStatuses {
		for i, ev := range gateway.BatchEvents[:3] {
			check(from, ev, gateway.ItemsOutcome{}, want[from][i])
			check(from, ev, gateway.ItemsOutcome{Running: true}, wantRunning[from][i])
		}
		for i, o := range outcomes {
			check(from, gateway.EventItemsDone, o.outcome, itemsDone[from][i])
		}
	}
}

func TestBatchError(t *testing.T) {
	t.Parallel()
	require.Equal(t, gateway.EBudgetExceeded, gateway.BatchError(gateway.BatchFailed, gateway.EBudgetExceeded).Code)
	require.Equal(t, gateway.EInferenceBusy, gateway.BatchError(gateway.BatchFailed, "").Code)
	require.Equal(t, gateway.EBatchExpired, gateway.BatchError(gateway.BatchExpired, "").Code)
	for _, s := range []gateway.BatchStatus{gateway.BatchCompleted, gateway.BatchCancelled, gateway.BatchQueued} {
		require.Nil(t, gateway.BatchError(s, gateway.EInferenceBusy))
	}
}

// TestTheDocumentShowsTheExpiredBatchsError: the error of an expired batch
// the document shows is the one the gateway sets.
func TestTheDocumentShowsTheExpiredBatchsError(t *testing.T) {
	t.Parallel()
	e := gateway.BatchError(gateway.BatchExpired, "")
	set, err := json.Marshal(map[string]any{"code": e.Code, "message": e.Message})
	require.NoError(t, err)
	require.JSONEq(t, string(set), string(apitest.Example(t, "/components/responses/BatchFound/content/application~1json/examples/expired/value/error")))
}
