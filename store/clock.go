package store

import (
	"context"
	"fmt"
	"time"
)

// DatabaseTime reads the database's clock.
func (s *Store) DatabaseTime(ctx context.Context) (time.Time, error) {
	now, err := s.queries.DatabaseTime(ctx, s.pool)
	if err != nil {
		return time.Time{}, fmt.Errorf("error reading the database's clock: %w", err)
	}
	return now, nil
}
