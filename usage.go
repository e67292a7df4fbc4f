package gateway

import (
	"time"

	"github.com/google/uuid"
)

// Usage is the metered cost of one request or batch item: upstream token counts
// and the rungs they price to.
type Usage struct {
	InputTokens  int64
	OutputTokens int64
	InputRungs   int64
	OutputRungs  int64
	TotalRungs   int64
}

// UsageRecord is a request whose usage is committed, with its evidence.
type UsageRecord struct {
	RequestID         uuid.UUID
	Principal         *Principal
	Model             Model
	Entry             EntryPoint
	Failed            bool
	Usage             Usage
	CreatedAt         time.Time
	CompletedAt       time.Time
	Sources           []Source
	Verdict           string
	EvidenceExpiresAt time.Time
}

// Admission is what a request charges and reserves before it runs.
type Admission struct {
	RequestID uuid.UUID
	Principal *Principal
	// Estimate is charged to the daily ceiling and reserved on a capped budget.
	Estimate int64
	// Day is the UTC day charged.
	Day time.Time
	// ExpiresAt is when recovery may release the reservation (the request's
	// replica is presumed dead).
	ExpiresAt time.Time
}

// ModelUsage is committed usage of one model (or of all, in totals).
type ModelUsage struct {
	Model       Model
	Requests    int64
	InputRungs  int64
	OutputRungs int64
	TotalRungs  int64
}

// UsageView is an account's committed usage in a period, with the state of its
// daily ceiling and of the caller's project budget.
type UsageView struct {
	Start, End time.Time
	Totals     ModelUsage
	ByModel    []ModelUsage
	Daily      DailyState
	Budget     BudgetState
}

// DailyState is the account's daily ceiling today.
type DailyState struct {
	Ceiling   int64
	Charged   int64
	Remaining int64
	ResetsAt  time.Time
}

// BudgetState is a project's budget.
type BudgetState struct {
	Project  string
	Cap      *int64 // nil: no cap
	Spent    int64
	Reserved int64
}

// UTCDay returns the start of t's UTC day.
func UTCDay(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
}
