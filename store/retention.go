package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway/gen/db"
)

// retentionProbe is how many accounts one run of FoldOldUsage looks at: a
// probe of two indexes each, 6–9 µs an account on the machines measured
// (BenchmarkFoldOldUsage), so a run costs the same however many accounts
// there are, and a pass over them all takes a run every retentionProbe
// accounts.
const retentionProbe = 5000

// retentionPass is where FoldOldUsage's pass over the accounts goes on, and
// the accounts it sets aside because their usage fails to fold (D11).
type retentionPass struct {
	mu sync.Mutex
	// next is the first account the next run looks at.
	next       uuid.UUID
	quarantine quarantine
}

// FoldOldUsage handles the usage past the request retention (completed
// before before) of the next accounts, retentionProbe of them at most, in
// order of id, going on where the last run stopped and starting over past
// the last account: it folds each account's requests into their days' sums,
// which the usage report reads besides the requests still kept (the report
// stays exact), and removes its folded sums by minute, which its hours' sums
// hold (the usage view reads whole hours that old). It stops at maxRows rows
// and returns how many it handled; the next run goes on with the account it
// stopped in. A run costs the same however many accounts there are, and in
// each account it reads from where the pass stands there (retention_marks,
// migration 00049), not through the index entries of the rows it removed,
// which stay until a vacuum. An account whose usage fails to fold for its
// data is set aside for quarantinePeriod and named in the error, and the
// others go on (D11); the database away ends the run, to go on there next
// time.
func (s *Store) FoldOldUsage(ctx context.Context, before time.Time, maxRows int32) (int64, error) {
	p := &s.retention
	p.mu.Lock()
	defer p.mu.Unlock()
	accounts, err := s.queries.OldUsageAccounts(ctx, s.pool, db.OldUsageAccountsParams{FirstAccount: p.next, Before: before, MaxRows: retentionProbe})
	if err != nil {
		return 0, fmt.Errorf("error looking for usage past the retention: %w", err)
	}
	skip := p.quarantine.members()
	var done int64
	var failures []error
accounts:
	for _, a := range accounts {
		if slices.Contains(skip, a.ID) {
			continue
		}
		for _, step := range []struct {
			due bool
			run func(budget int32) (int64, error)
		}{
			{a.OldRequests, func(budget int32) (int64, error) {
				return s.queries.FoldOldRequests(ctx, s.pool, db.FoldOldRequestsParams{AccountID: a.ID, Before: before, RequestsFrom: a.RequestsFrom, MaxRows: budget})
			}},
			{a.OldMinutes, func(budget int32) (int64, error) {
				return s.queries.DeleteOldUsageMinutes(ctx, s.pool, db.DeleteOldUsageMinutesParams{AccountID: a.ID, Before: before, MinutesFrom: a.MinutesFrom, MaxRows: budget})
			}},
		} {
			if !step.due {
				continue
			}
			budget := maxRows - int32(done)
			n, err := step.run(budget)
			done += n
			switch {
			case err != nil && Transient(err):
				p.next = a.ID
				return done, errors.Join(append(failures, fmt.Errorf("error folding old usage of account %s: %w", a.ID, err))...)
			case err != nil:
				p.quarantine.add(a.ID)
				failures = append(failures, fmt.Errorf("error folding old usage of account %s (set aside for %s): %w", a.ID, quarantinePeriod, err))
				continue accounts
			case n == int64(budget):
				p.next = a.ID // it may hold more
				return done, errors.Join(failures...)
			}
		}
	}
	p.next = uuid.Nil
	if len(accounts) == retentionProbe {
		p.next = successor(accounts[len(accounts)-1].ID)
	}
	return done, errors.Join(failures...)
}

// successor is the id after id, in the order PostgreSQL sorts uuids (their
// bytes).
func successor(id uuid.UUID) uuid.UUID {
	for i := len(id) - 1; i >= 0; i-- {
		id[i]++
		if id[i] != 0 {
			break
		}
	}
	return id
}

// markSkew is how far before where a job's last run stopped its next run
// reads from (resumeMark): rows stamped by a replica whose clock is behind
// the database's by less come after it (clockwatch warns past a second).
const markSkew = time.Minute

// resumeMark is where a job that removes (or clears) a table's oldest rows
// first stopped, for its next run to read from there, less markSkew, rather
// than from the start of the table's index, through the entries of the rows
// it removed: those stay until a vacuum, which autovacuum runs once a fifth
// of a table has changed (days of removals on a large one), and a read from
// the start went through every one of them, each run. A replica that starts
// reads from the start once.
type resumeMark struct {
	mu   sync.Mutex
	from time.Time
}

// run calls step with where to read from, and keeps where step says the
// next run reads from; it returns what step counted.
func (m *resumeMark) run(step func(from time.Time) (n int64, next time.Time, err error)) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, next, err := step(m.from)
	if err != nil {
		return 0, err
	}
	m.from = next.Add(-markSkew)
	return n, nil
}
