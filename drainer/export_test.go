package drainer

import (
	"context"

	"github.com/rungworks/gateway/store"
)

// Commit stores a group of outcomes as the completer does.
func (d *Drainer) Commit(ctx context.Context, group []store.ItemResult) { d.commit(ctx, group) }

// Requeue hands a claimed item back as a worker does when the upstream
// certainly did not process it.
func (d *Drainer) Requeue(ctx context.Context, it store.ClaimedItem) { d.requeue(ctx, it) }
