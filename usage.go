package gateway

import (
	"fmt"
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

// RetentionMargin is how much sooner than the request retention the usage
// view treats a time as past it: the replica that folds old requests may
// read a clock ahead of the one serving the view.
const RetentionMargin = time.Hour

// CheckUsagePeriod refuses (EInvalidRequest) a usage period [start, end) with
// an end inside an hour that may be past the request retention (before now -
// retention + RetentionMargin): the requests of such an hour are folded into
// their day's sums and its sums by minute removed, so only its hour's sums
// remain, and the part of the hour inside the period cannot be counted. A
// retention of zero keeps requests and minutes for good.
func CheckUsagePeriod(start, end, now time.Time, retention time.Duration) error {
	if retention == 0 {
		return nil
	}
	kept := now.Add(-retention + RetentionMargin)
	for _, t := range []struct {
		name string
		at   time.Time
	}{{"start", start}, {"end", end}} {
		if t.at.Before(kept) && !t.at.Equal(t.at.Truncate(time.Hour)) {
			return Errorf(EInvalidRequest, "%s: usage older than %s (the request retention) is kept by the hour; give a time on a whole hour",
				t.name, retentionText(retention))
		}
	}
	return nil
}

// retentionText is a retention as an operator sets it: whole days as days.
func retentionText(d time.Duration) string {
	if d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	}
	return d.String()
}

// Admission is what a request charges and reserves before it runs.
type Admission struct {
	RequestID uuid.UUID
	Principal *Principal
	// Estimate is charged to the daily ceiling and reserved on a capped budget.
	Estimate int64
	// Day is the UTC day charged.
	Day time.Time
}

// Admission outcomes of the store's admission statements: admitted, or the
// refusal (a daily ceiling or budget cap that cannot cover the estimate now,
// or can never cover it). AdmitDailyHeld and AdmitBudgetHeld are refusals
// told apart from AdmitDaily and AdmitBudget afterwards: what the ceiling or
// cap leaves once the requests running end (charged and spent their actual
// cost) and the slices replicas hold unused go back would cover the estimate.
// AdmitDailyBatches is a refusal by the ceiling that only the end of the
// account's unfinished batch items, charged at their estimates, may cure.
const (
	AdmitOK           = "ok"
	AdmitDaily        = "daily"
	AdmitDailyHeld    = "daily_held"
	AdmitDailyBatches = "daily_batches"
	AdmitDailyNever   = "daily_never"
	AdmitBudget       = "budget"
	AdmitBudgetHeld   = "budget_held"
	AdmitBudgetNever  = "budget_never"
)

// Held is the held refusal (AdmitDailyHeld, AdmitBudgetHeld) that a refusal
// by the ceiling or the cap (outcome) of estimate is when free, what the
// limit leaves once the requests running end and the slices held go back,
// covers the estimate; AdmitDailyBatches for a refusal by the ceiling when
// free and batches, the estimates of the account's batch items of the day
// not yet finished, cover it; outcome otherwise.
func Held(outcome string, estimate, free, batches int64) string {
	switch {
	case estimate <= free && outcome == AdmitDaily:
		return AdmitDailyHeld
	case estimate <= free && outcome == AdmitBudget:
		return AdmitBudgetHeld
	case estimate <= free+batches && outcome == AdmitDaily:
		return AdmitDailyBatches
	}
	return outcome
}

// HeldRetryAfter is the wait suggested to a request refused because the
// estimates of requests still running fill the ceiling or cap: they end, and
// unused slices go back, within seconds.
const HeldRetryAfter = 2 * time.Second

// BatchesRetryAfter is the wait suggested to a request refused because the
// estimates of the account's unfinished batch items fill the day's ceiling:
// each item gives back what its estimate charged beyond its actual cost when
// it ends, which a drain reaches within minutes (hours during an outage).
const BatchesRetryAfter = time.Minute

// AdmissionError is the refusal an admission outcome stands for (nil for
// AdmitOK) of a request or batch (what) of estimate rungs by p on day. A
// refusal that waiting cannot cure, an estimate larger than the whole ceiling
// or cap, or than what the budget's spending leaves, carries no Retry-After
// and says what to change (D11); one that the end of requests running may
// cure says so, with a short Retry-After, and one that the end of the
// account's batch items may cure, with a minute's.
func AdmissionError(outcome, what string, estimate int64, p *Principal, day time.Time) error {
	switch outcome {
	case AdmitOK:
		return nil
	case AdmitDaily:
		return retryAfter(time.Until(day.Add(24*time.Hour)), ERateLimited,
			"the account's daily rung ceiling cannot cover this %s's estimate of %d rungs; it resets at 00:00 UTC", what, estimate)
	case AdmitDailyHeld:
		return retryAfter(HeldRetryAfter, ERateLimited,
			"the account's daily rung ceiling is held for now by requests still running, at their estimates, and cannot cover this %s's estimate of %d rungs as well; "+
				"as they end, each is charged its actual cost and the rest goes back, so retry shortly, or lower max_output_rungs (the estimate prices it in full)", what, estimate)
	case AdmitDailyBatches:
		return retryAfter(BatchesRetryAfter, ERateLimited,
			"the account's daily rung ceiling is held by the estimates of its batch items not yet finished (a batch is charged its whole estimate when created) and cannot cover this %s's estimate of %d rungs as well; "+
				"as each item finishes it is charged its actual cost and the rest goes back, so retry in a minute, or lower max_output_rungs (the estimate prices it in full)", what, estimate)
	case AdmitDailyNever:
		return Errorf(ERateLimited,
			"this %s's estimate of %d rungs is larger than the account's whole daily rung ceiling, so waiting will not help: lower max_output_rungs (the estimate prices it in full), send less, or ask the operator for a higher ceiling", what, estimate)
	case AdmitBudget:
		return Errorf(EBudgetExceeded, "the budget cap of project %q cannot cover this %s's estimate of %d rungs beside what the project has spent: lower max_output_rungs (the estimate prices it in full), or raise the cap", p.ProjectName, what, estimate)
	case AdmitBudgetHeld:
		return retryAfter(HeldRetryAfter, EBudgetExceeded,
			"the budget cap of project %q is held for now by requests still running, at their estimates, and cannot cover this %s's estimate of %d rungs as well; "+
				"as they end, each spends its actual cost and the rest goes back, so retry shortly, or lower max_output_rungs (the estimate prices it in full)", p.ProjectName, what, estimate)
	case AdmitBudgetNever:
		return Errorf(EBudgetExceeded,
			"this %s's estimate of %d rungs is larger than the whole budget cap of project %q: lower max_output_rungs (the estimate prices it in full), send less, or raise the cap", what, estimate, p.ProjectName)
	default:
		return fmt.Errorf("unexpected admission outcome %q", outcome)
	}
}

// retryAfter is Errorf's error with a Retry-After of after.
func retryAfter(after time.Duration, code ErrorCode, format string, args ...any) *Error {
	e := Errorf(code, format, args...)
	e.RetryAfter = after
	return e
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
