package drainer_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/drainer"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/store"
)

// groupRecorder is a Store that notes each group of outcomes the drainer
// commits, by item index, before committing it.
type groupRecorder struct {
	drainer.Store
	groups [][]int
}

func (g *groupRecorder) CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error) {
	idx := make([]int, len(results))
	for i, r := range results {
		idx[i] = r.Index
	}
	g.groups = append(g.groups, idx)
	return g.Store.CompleteItems(ctx, owner, results)
}

// TestAnUnstorableOutcomeIsIsolated: a group of outcomes one of which
// PostgreSQL cannot hold (an output with U+0000, as one the guard had not
// cleaned) is committed member by member: the others as they ran, billed,
// and the one failed INFERENCE_BUSY without its output or usage; its batch
// finishes, and the operator is told (D11). Nothing is retried past that.
func TestAnUnstorableOutcomeIsIsolated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.newBatch(t, "isolated", 3)
	owner := uuid.Must(uuid.NewV7())
	claimed, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: uuid.Must(uuid.NewV7()), Max: 10, PerAccount: 10, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	slices.SortFunc(claimed, func(a, b store.ClaimedItem) int { return a.Index - b.Index })
	contents := []string{"first", "un\x00storable", "third"}
	group := make([]store.ItemResult, 3)
	for i, it := range claimed {
		group[i] = store.ItemResult{
			BatchID: it.BatchID, Index: it.Index, Status: string(gateway.ItemCompleted), Content: contents[i],
			InputTokens: 4, OutputTokens: 6, InputRungs: 2, OutputRungs: 3 + int64(i), TotalRungs: 5 + int64(i),
			EvidenceExpiresAt: time.Now().Add(time.Hour), Model: gateway.ModelInstant,
		}
	}
	rec := &groupRecorder{Store: b.store}
	logs := &syncbuf.Buffer{}
	d := drainer.New(drainer.Config{Owner: owner, EvidenceRetention: time.Hour}, rec, b.provider, b.estimator, slog.New(slog.NewJSONHandler(logs, nil)))

	d.Commit(b.ctx, group)

	require.Equal(t, [][]int{{0, 1, 2}, {0}, {1}, {1}, {2}}, rec.groups,
		"the group, then each member alone, the unstorable one again as failed")
	stored := b.items(t, id)
	require.Len(t, stored, 3)
	for _, i := range []int{0, 2} {
		require.Equal(t, gateway.ItemCompleted, stored[i].Status)
		require.Equal(t, contents[i], stored[i].Content)
		require.Equal(t, 5+int64(i), stored[i].Usage.TotalRungs)
	}
	require.Equal(t, gateway.ItemFailed, stored[1].Status)
	require.Equal(t, gateway.EInferenceBusy, stored[1].Error.Code)
	require.Equal(t, "the item's output could not be stored; it is not retried", stored[1].Error.Message)
	require.Empty(t, stored[1].Content)
	require.Zero(t, stored[1].Usage.TotalRungs)

	batch, err := b.store.Batch(b.ctx, b.principal.AccountID, id)
	require.NoError(t, err)
	require.Equal(t, gateway.BatchCompleted, batch.Status, "every item ended: the batch finished")
	usage, err := b.store.Usage(b.ctx, b.principal, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, int64(5+7), usage.Totals.TotalRungs, "the two stored outcomes billed, the unstorable one not")

	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a group of batch item outcomes failed; committing them one by one"`))
	require.Equal(t, 1, strings.Count(logs.String(), `"msg":"a batch item's outcome cannot be stored; failing the item"`))
	require.NotContains(t, logs.String(), "the rescuer will take")
}
