package store

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
)

// PoolConfig is the configuration of Connect's pool.
func PoolConfig(url, name string, maxConns int32) (*pgxpool.Config, error) {
	return poolConfig(url, name, maxConns)
}

// CancelAccountBatchesPaged is CancelAccountBatches listing page batches at
// a time.
func (s *Store) CancelAccountBatchesPaged(ctx context.Context, account string, page int) ([]CancelOutcome, error) {
	return s.cancelAccountBatches(ctx, account, page)
}

// CreationsWaiting is how many batch creations wait for their turn, over
// every account-day.
func (s *Store) CreationsWaiting() int {
	s.groups.mu.Lock()
	defer s.groups.mu.Unlock()
	n := 0
	for _, q := range s.groups.queues {
		n += len(q.waiting)
	}
	return n
}
