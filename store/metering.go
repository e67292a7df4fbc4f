package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
)

// Admit charges a request's estimate to the account's daily ceiling and
// reserves it on the project budget, atomically, in one round trip. Refusals
// are RATE_LIMITED (daily ceiling, Retry-After to the next UTC day) and
// BUDGET_EXCEEDED.
func (s *Store) Admit(ctx context.Context, a gateway.Admission) error {
	day := gateway.UTCDay(a.Day)
	outcome, err := s.queries.AdmitRequest(ctx, s.pool, db.AdmitRequestParams{
		RequestID:      a.RequestID,
		AccountID:      a.Principal.AccountID,
		ProjectID:      a.Principal.ProjectID,
		Day:            day,
		DefaultCeiling: a.Principal.Tier.DefaultDailyCeiling(),
		Estimate:       a.Estimate,
		ExpiresAt:      a.ExpiresAt,
	})
	if err != nil {
		return fmt.Errorf("error admitting request: %w", err)
	}
	return admissionError(outcome, "request", a.Estimate, a.Principal, day)
}

// admissionError is the refusal an admission outcome stands for (nil for
// "ok"). A refusal that waiting cannot cure, an estimate larger than the whole
// ceiling or cap, carries no Retry-After and says what to change (D11).
func admissionError(outcome, what string, estimate int64, p *gateway.Principal, day time.Time) error {
	switch outcome {
	case "ok":
		return nil
	case "daily":
		return &gateway.Error{
			Code:       gateway.ERateLimited,
			Message:    fmt.Sprintf("the account's daily rung ceiling cannot cover this %s's estimate of %d rungs; it resets at 00:00 UTC", what, estimate),
			RetryAfter: day.Add(24 * time.Hour).Sub(time.Now()),
		}
	case "daily_never":
		return gateway.Errorf(gateway.ERateLimited,
			"this %s's estimate of %d rungs is larger than the account's whole daily rung ceiling, so waiting will not help: lower max_output_rungs (the estimate prices it in full), send less, or ask the operator for a higher ceiling", what, estimate)
	case "budget":
		return gateway.Errorf(gateway.EBudgetExceeded, "the budget cap of project %q cannot cover this %s's estimate of %d rungs", p.ProjectName, what, estimate)
	case "budget_never":
		return gateway.Errorf(gateway.EBudgetExceeded,
			"this %s's estimate of %d rungs is larger than the whole budget cap of project %q: lower max_output_rungs (the estimate prices it in full), send less, or raise the cap", what, estimate, p.ProjectName)
	default:
		return fmt.Errorf("unexpected admission outcome %q", outcome)
	}
}

// Settle commits a finished request durably in one round trip: its usage and
// evidence, and its actual cost on its reservation, which ReconcileSettlements
// later folds into the daily and budget counters (the usage view counts it at
// once).
func (s *Store) Settle(ctx context.Context, r gateway.UsageRecord) error {
	sources := r.Sources
	if sources == nil {
		sources = []gateway.Source{}
	}
	sourcesJSON, err := json.Marshal(sources)
	if err != nil {
		return fmt.Errorf("error encoding sources: %w", err)
	}
	status := "completed"
	if r.Failed {
		status = "failed"
	}
	var verdict *string
	if r.Verdict != "" {
		verdict = &r.Verdict
	}
	err = s.queries.SettleRequest(ctx, s.pool, db.SettleRequestParams{
		ID:                r.RequestID,
		AccountID:         r.Principal.AccountID,
		ProjectID:         r.Principal.ProjectID,
		ApiKeyID:          r.Principal.KeyID,
		Model:             string(r.Model),
		EntryPoint:        string(r.Entry),
		Status:            status,
		InputTokens:       r.Usage.InputTokens,
		OutputTokens:      r.Usage.OutputTokens,
		InputRungs:        r.Usage.InputRungs,
		OutputRungs:       r.Usage.OutputRungs,
		TotalRungs:        r.Usage.TotalRungs,
		CreatedAt:         r.CreatedAt,
		CompletedAt:       r.CompletedAt,
		Sources:           sourcesJSON,
		Verdict:           verdict,
		EvidenceExpiresAt: r.EvidenceExpiresAt,
		Day:               gateway.UTCDay(r.CompletedAt),
	})
	if err != nil {
		return fmt.Errorf("error settling request: %w", err)
	}
	return nil
}

// Release gives back the charge and reservation of a request that ended
// without cost (refused or failed upstream before producing anything).
func (s *Store) Release(ctx context.Context, requestID uuid.UUID) error {
	if err := s.queries.ReleaseReservation(ctx, s.pool, requestID); err != nil {
		return fmt.Errorf("error releasing reservation: %w", err)
	}
	return nil
}

// ReleaseExpiredReservations releases up to maxRows reservations whose lease ran
// out, returning how many.
func (s *Store) ReleaseExpiredReservations(ctx context.Context, maxRows int32) (int64, error) {
	n, err := s.queries.ReleaseExpiredReservations(ctx, s.pool, maxRows)
	if err != nil {
		return 0, fmt.Errorf("error releasing expired reservations: %w", err)
	}
	return n, nil
}

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
		rows, err := s.queries.UsageByModel(ctx, tx, db.UsageByModelParams{AccountID: p.AccountID, Start: start, EndTime: end})
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
		daily, err := s.queries.DailyState(ctx, tx, db.DailyStateParams{AccountID: p.AccountID, Day: today, DefaultCeiling: p.Tier.DefaultDailyCeiling()})
		if err != nil {
			return fmt.Errorf("error reading daily ceiling: %w", err)
		}
		view.Daily = gateway.DailyState{
			Ceiling:   daily.CeilingRungs,
			Charged:   daily.ChargedRungs,
			Remaining: max(0, daily.CeilingRungs-daily.ChargedRungs),
			ResetsAt:  today.Add(24 * time.Hour),
		}
		budget, err := s.queries.BudgetState(ctx, tx, p.ProjectID)
		if errors.Is(err, pgx.ErrNoRows) {
			return errors.New("the caller's project no longer exists")
		}
		if err != nil {
			return fmt.Errorf("error reading budget: %w", err)
		}
		view.Budget = gateway.BudgetState{Project: budget.Name, Cap: budget.BudgetCapRungs, Spent: budget.SpentRungs, Reserved: budget.ReservedRungs}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return view, nil
}

// ReconcileSettlements folds up to maxRows settled reservations into the daily
// and budget counters, returning how many. One account's rows never stop the
// others' (D11): when a run fails for a reason other than the database being
// away, it folds account by account, and an account that fails alone is set
// aside for quarantinePeriod (reported in the error, which names it) while
// every other account is folded.
func (s *Store) ReconcileSettlements(ctx context.Context, maxRows int32) (int64, error) {
	skip := s.quarantine.members()
	n, err := s.queries.ReconcileSettlements(ctx, s.pool, db.ReconcileSettlementsParams{MaxRows: maxRows, Skip: skip})
	if err == nil || Transient(err) {
		if err != nil {
			return 0, fmt.Errorf("error reconciling settlements: %w", err)
		}
		return n, nil
	}
	accounts, lerr := s.queries.SettledAccounts(ctx, s.pool, db.SettledAccountsParams{Skip: skip, MaxRows: maxRows})
	if lerr != nil {
		return 0, fmt.Errorf("error reconciling settlements: %w (listing accounts: %v)", err, lerr)
	}
	var failures []error
	for _, account := range accounts {
		m, err := s.queries.ReconcileSettlements(ctx, s.pool, db.ReconcileSettlementsParams{MaxRows: maxRows, Skip: skip, AccountID: &account})
		if err != nil {
			if !Transient(err) {
				s.quarantine.add(account)
			}
			failures = append(failures, fmt.Errorf("error reconciling settlements of account %s (set aside for %s): %w", account, quarantinePeriod, err))
			continue
		}
		n += m
	}
	return n, errors.Join(failures...)
}
