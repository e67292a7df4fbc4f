package ledger

import (
	"time"

	"github.com/rungworks/gateway"
)

// Waiting is how many settlements wait for a commit.
func (l *Ledger) Waiting() int {
	l.groupMu.Lock()
	defer l.groupMu.Unlock()
	return len(l.pending)
}

// RefusalMemory is how long a refusal answers for its lease.
const RefusalMemory = refusalMemory

// Holds reports whether the ledger holds, or is being granted, a slice of
// p's account and project for day.
func (l *Ledger) Holds(p *gateway.Principal, day time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.current[sliceKey{account: p.AccountID, project: p.ProjectID, day: day}] != nil
}

// Granting reports whether a grant of the slice of p's account and project
// for day is in flight.
func (l *Ledger) Granting(p *gateway.Principal, day time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.current[sliceKey{account: p.AccountID, project: p.ProjectID, day: day}]
	return ls != nil && ls.granting != nil
}
