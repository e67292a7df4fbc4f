package store

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/rungworks/gateway/gen/db"
)

// plannedPerCall runs statements on its handle with a plan made for each
// call, from the tables as they are then: pgx sends each as an unnamed
// statement (QueryExecModeCacheDescribe, one round trip, binary like a
// prepared one), which PostgreSQL plans afresh.
//
// A prepared statement is planned generically after a few calls and keeps
// that plan until its tables' next ANALYZE. Made while the batch tables were
// tiny and known to be, such a plan reads them whole once a burst of
// creations has grown them by thousands of batches within seconds, on every
// call until autovacuum analyzes them. The frequent ones (the drain's
// statements per item, a batch's start and finish, a client's reads of a
// batch and its results) run functions planned with sequential scans off
// (migrations 00026-00030), whose plans are kept; every other statement that
// reads the batch tables (a client's list, a creation's replay, cancels,
// lease renewals, maintenance) runs through plannedPerCall and pays for a
// plan a call, a tenth to a fifth of a millisecond.
type plannedPerCall struct{ db db.DBTX }

// Exec runs sql with a plan made for this call.
func (p plannedPerCall) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return p.db.Exec(ctx, sql, perCall(args)...)
}

// Query runs sql with a plan made for this call.
func (p plannedPerCall) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.db.Query(ctx, sql, perCall(args)...)
}

// QueryRow runs sql with a plan made for this call.
func (p plannedPerCall) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return p.db.QueryRow(ctx, sql, perCall(args)...)
}

// CopyFrom copies as the handle does: COPY has no plan.
func (p plannedPerCall) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error) {
	return p.db.CopyFrom(ctx, table, columns, rows)
}

func perCall(args []any) []any {
	return append([]any{pgx.QueryExecModeCacheDescribe}, args...)
}
