package store

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/rungworks/gateway/migrations"
)

// Migrate applies pending migrations under a PostgreSQL session advisory lock,
// so several replicas may start at once: one migrates, the others wait and then
// find nothing to do. It returns the number of migrations applied.
func Migrate(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return 0, fmt.Errorf("error creating migration lock: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS, goose.WithSessionLocker(locker))
	if err != nil {
		return 0, fmt.Errorf("error creating migration provider: %w", err)
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return 0, fmt.Errorf("error applying migrations: %w", err)
	}
	return len(results), nil
}

// migrationsCurrent remembers a positive answer: for a given binary, a schema
// that has every embedded migration stays so.
var migrationsCurrent atomic.Bool

// Ready reports whether the database answers, takes writes (a standby, or
// a database set read-only, would refuse every request's settlement) and has
// every embedded migration.
func (s *Store) Ready(ctx context.Context) error {
	writable, err := s.queries.AcceptsWrites(ctx, s.pool)
	if err != nil {
		return fmt.Errorf("database unreachable: %w", err)
	}
	if writable != nil && !*writable {
		return errors.New("the database takes no writes (a standby, or set read-only)")
	}
	if migrationsCurrent.Load() {
		return nil
	}
	sqlDB := stdlib.OpenDBFromPool(s.pool)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS)
	if err != nil {
		return fmt.Errorf("error reading migrations: %w", err)
	}
	pending, err := provider.HasPending(ctx)
	if err != nil {
		return fmt.Errorf("error checking migrations: %w", err)
	}
	if pending {
		return errors.New("migrations pending")
	}
	migrationsCurrent.Store(true)
	return nil
}
