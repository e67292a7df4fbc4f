package drainer

import (
	"context"

	"github.com/rungworks/gateway/store"
)

// Commit stores a group of outcomes as the completer does.
func (d *Drainer) Commit(ctx context.Context, group []store.ItemResult) { d.commit(ctx, group) }
