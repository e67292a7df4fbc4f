package ledger

// Waiting is how many settlements wait for a commit.
func (l *Ledger) Waiting() int {
	l.groupMu.Lock()
	defer l.groupMu.Unlock()
	return len(l.pending)
}

// RefusalMemory is how long a refusal answers for its lease.
const RefusalMemory = refusalMemory

// AheadOf is how long before a day ends the next day's slice of account is
// granted.
var AheadOf = aheadOf
