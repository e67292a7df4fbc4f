package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
)

// DeleteOldRateWindows removes rate-limit windows that ended before before.
func (s *Store) DeleteOldRateWindows(ctx context.Context, before time.Time) (int64, error) {
	n, err := s.queries.DeleteOldRateWindows(ctx, s.pool, before)
	if err != nil {
		return 0, fmt.Errorf("error deleting old rate windows: %w", err)
	}
	return n, nil
}

// Usage returns the principal's account usage committed in [start, end), the
// account's daily ceiling today and the principal's project budget, read in one
// repeatable-read snapshot.
func (s *Store) Usage(ctx context.Context, p *gateway.Principal, start, end time.Time) (*gateway.UsageView, error) {
	view := &gateway.UsageView{Start: start, End: end, ByModel: []gateway.ModelUsage{}}
	today := gateway.UTCDay(time.Now())
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		lo, hourLo, hourHi, hi := periodParts(start, end)
		rows, err := s.queries.UsageByModel(ctx, tx, db.UsageByModelParams{
			AccountID: p.AccountID, Start: start, EndTime: end, Lo: lo, HourLo: hourLo, HourHi: hourHi, Hi: hi,
		})
		if err != nil {
			return fmt.Errorf("error reading usage: %w", err)
		}
		for _, r := range rows {
			m := gateway.ModelUsage{Model: gateway.Model(r.Model), Requests: r.Requests, InputRungs: r.InputRungs, OutputRungs: r.OutputRungs, TotalRungs: r.TotalRungs}
			view.ByModel = append(view.ByModel, m)
			view.Totals.Requests += m.Requests
			view.Totals.InputRungs += m.InputRungs
			view.Totals.OutputRungs += m.OutputRungs
			view.Totals.TotalRungs += m.TotalRungs
		}
		view.Daily, err = s.dailyState(ctx, tx, p.AccountID, p.Tier.DefaultDailyCeiling(), today)
		if err != nil {
			return err
		}
		view.Budget, err = s.budgetState(ctx, tx, p.ProjectID)
		return err
	})
	if err != nil {
		return nil, err
	}
	return view, nil
}

// periodParts splits [start, end) for the usage view: the UTC hours
// [hourLo, hourHi) whole inside it, read from the sums by hour; the other
// minutes [lo, hi) whole inside it, read from the sums by minute; the rest,
// [start, lo) and [hi, end), read from the requests.
func periodParts(start, end time.Time) (lo, hourLo, hourHi, hi time.Time) {
	lo, hi = whole(start, end, time.Minute)
	hourLo, hourHi = whole(lo, hi, time.Hour)
	return lo, hourLo, hourHi, hi
}

// whole returns the units [lo, hi) whole inside [start, end); lo = hi = end
// when there is none.
func whole(start, end time.Time, unit time.Duration) (lo, hi time.Time) {
	lo, hi = start.Truncate(unit), end.Truncate(unit)
	if lo.Before(start) {
		lo = lo.Add(unit)
	}
	if !lo.Before(hi) {
		return end, end
	}
	return lo, hi
}

// FoldUsageMinutes folds up to maxRows rows of the sums by minute of minutes
// before before, each of one server process, into one a minute and model,
// and adds them to the sums by hour. One account's rows never stop the
// others' (D11): as ReconcileSettlements does, a run that fails for a reason
// other than the database being away folds account by account, and an
// account that fails alone is set aside for quarantinePeriod (named in the
// error).
func (s *Store) FoldUsageMinutes(ctx context.Context, before time.Time, maxRows int32) (int64, error) {
	return s.usageQuarantine.isolated("folding usage minutes", "account", func(skip []uuid.UUID, account *uuid.UUID) (int64, error) {
		return s.queries.FoldUsageMinutes(ctx, s.pool, db.FoldUsageMinutesParams{Before: before, MaxRows: maxRows, Skip: skip, AccountID: account})
	}, func(skip []uuid.UUID) ([]uuid.UUID, error) {
		return s.queries.UnfoldedUsageAccounts(ctx, s.pool, db.UnfoldedUsageAccountsParams{Before: before, Skip: skip, MaxRows: maxRows})
	})
}

// UsageLine is one line of a usage report: what one project of an account
// used of one model through one entry point on one UTC day.
type UsageLine = db.UsageReportRow

// UsageReport returns the usage committed on the UTC days [start, end) (UTC
// midnights) per account, project, UTC day of completion, model and entry
// point, in that order, requests past the retention included; only
// account's when it is not empty (ErrAccountNotFound when there is no such
// account).
func (s *Store) UsageReport(ctx context.Context, start, end time.Time, account string) ([]UsageLine, error) {
	lines, err := s.queries.UsageReport(ctx, s.pool, db.UsageReportParams{Start: start, EndTime: end, Account: nameFilter(account)})
	if err != nil {
		return nil, fmt.Errorf("error reading usage: %w", err)
	}
	if len(lines) == 0 {
		return nil, s.accountKnown(ctx, account)
	}
	return lines, nil
}

// AccountLimits are an account's limits and what is charged against them.
type AccountLimits struct {
	Account string
	Tier    gateway.Tier
	// Daily is today's ceiling and charge; DailyDefault says the ceiling is
	// the tier's, the account having none of its own.
	Daily        gateway.DailyState
	DailyDefault bool
	// Projects are the account's projects' budgets, by name.
	Projects []gateway.BudgetState
}

// Limits reads an account's limits (by its name) and their state, in one
// repeatable-read snapshot.
func (s *Store) Limits(ctx context.Context, account string) (*AccountLimits, error) {
	var out *AccountLimits
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		a, err := s.account(ctx, tx, account)
		if err != nil {
			return err
		}
		out = &AccountLimits{Account: a.Name, Tier: gateway.Tier(a.Tier), DailyDefault: a.DailyRungCeiling == nil}
		if out.Daily, err = s.dailyState(ctx, tx, a.ID, out.Tier.DefaultDailyCeiling(), gateway.UTCDay(time.Now())); err != nil {
			return err
		}
		projects, err := s.queries.ListAccountProjects(ctx, tx, a.ID)
		if err != nil {
			return fmt.Errorf("error listing projects: %w", err)
		}
		for _, p := range projects {
			budget, err := s.budgetState(ctx, tx, p.ID)
			if err != nil {
				return err
			}
			out.Projects = append(out.Projects, budget)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// dailyState reads an account's ceiling (defaultCeiling, its tier's, when it
// has none) and what is charged against it on day.
func (s *Store) dailyState(ctx context.Context, tx db.DBTX, account uuid.UUID, defaultCeiling int64, day time.Time) (gateway.DailyState, error) {
	daily, err := s.queries.DailyState(ctx, tx, db.DailyStateParams{AccountID: account, Day: day, DefaultCeiling: defaultCeiling})
	if err != nil {
		return gateway.DailyState{}, fmt.Errorf("error reading daily ceiling: %w", err)
	}
	return gateway.DailyState{
		Ceiling:   daily.CeilingRungs,
		Charged:   daily.ChargedRungs,
		Remaining: max(0, daily.CeilingRungs-daily.ChargedRungs),
		ResetsAt:  day.Add(24 * time.Hour),
	}, nil
}

// dailyRoom is what tells apart a refusal by the ceiling of account's day
// (gateway.Held): free, what the ceiling leaves once the requests running
// end and the slices held go back, and batches, what the account's batch
// items of the day not yet finished hold of the charge at their estimates,
// apart from the batches skip (refused in the transaction tx).
func (s *Store) dailyRoom(ctx context.Context, tx db.DBTX, account uuid.UUID, defaultCeiling int64, day time.Time, skip []uuid.UUID) (free, batches int64, err error) {
	daily, err := s.dailyState(ctx, tx, account, defaultCeiling, day)
	if err != nil {
		return 0, 0, err
	}
	if skip == nil {
		skip = []uuid.UUID{} // NULL would leave every batch out
	}
	batches, err = s.queries.UnfinishedBatchEstimates(ctx, tx, db.UnfinishedBatchEstimatesParams{AccountID: account, Day: day, Skip: skip})
	if err != nil {
		return 0, 0, fmt.Errorf("error reading the estimates of unfinished batch items: %w", err)
	}
	return daily.Remaining, batches, nil
}

// budgetState reads a project's budget (projects are never deleted).
func (s *Store) budgetState(ctx context.Context, tx db.DBTX, project uuid.UUID) (gateway.BudgetState, error) {
	budget, err := s.queries.BudgetState(ctx, tx, project)
	if err != nil {
		return gateway.BudgetState{}, fmt.Errorf("error reading budget: %w", err)
	}
	return gateway.BudgetState{Project: budget.Name, Cap: budget.BudgetCapRungs, Spent: budget.SpentRungs, Reserved: budget.ReservedRungs}, nil
}

// ReconcileSettlements folds up to maxRows batch settlements into the daily and
// budget counters, returning how many. One account's rows never stop the
// others' (D11): when a run fails for a reason other than the database being
// away, it folds account by account, and an account that fails alone is set
// aside for quarantinePeriod (reported in the error, which names it) while
// every other account is folded.
func (s *Store) ReconcileSettlements(ctx context.Context, maxRows int32) (int64, error) {
	return s.quarantine.isolated("reconciling settlements", "account", func(skip []uuid.UUID, account *uuid.UUID) (int64, error) {
		return s.queries.ReconcileSettlements(ctx, s.pool, db.ReconcileSettlementsParams{MaxRows: maxRows, Skip: skip, AccountID: account})
	}, func(skip []uuid.UUID) ([]uuid.UUID, error) {
		return s.queries.SettledAccounts(ctx, s.pool, db.SettledAccountsParams{Skip: skip, MaxRows: maxRows})
	})
}
