// Package inference runs interactive requests: it validates and routes a
// request, prices its estimate, dispatches it to the upstream provider (whole or
// streamed), prices the upstream's usage and commits it with the evidence before
// the caller sees the final reply.
package inference

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/upstream"
)

// Ledger admits requests against the daily ceiling and the project budget,
// and settles or releases them when they end.
type Ledger interface {
	// Admit charges and reserves the estimate, or refuses with RATE_LIMITED
	// (daily ceiling) or BUDGET_EXCEEDED.
	Admit(ctx context.Context, a gateway.Admission) error
	// Settle commits usage and evidence and reconciles the charge and reservation.
	Settle(ctx context.Context, r gateway.UsageRecord) error
	// Release gives back the charge and reservation of a request that cost nothing.
	Release(ctx context.Context, requestID uuid.UUID) error
}

// DefaultReservationLease is how long an interactive request's reservation is
// held before recovery presumes its replica dead and releases it.
const DefaultReservationLease = 15 * time.Minute

// Service runs interactive requests.
type Service struct {
	Provider  upstream.Provider
	Models    upstream.ModelMap
	Estimator *metering.Estimator
	Ledger    Ledger
	// EvidenceRetention is how long evidence is held.
	EvidenceRetention time.Duration
	// RetryAfter is suggested to callers when the upstream is unavailable.
	RetryAfter time.Duration
	// ReservationLease bounds how long a reservation outlives a dead replica;
	// zero means DefaultReservationLease.
	ReservationLease time.Duration
	// Logger reports failures that do not change the reply.
	Logger *slog.Logger
	// Metrics, when set, records upstream calls, rungs and refusals.
	Metrics *metrics.Metrics
}

// Route is the route decided for a request.
type Route struct {
	ID            uuid.UUID
	Entry         gateway.EntryPoint
	Primary       gateway.Model
	EvidenceModel gateway.Model // empty when no retrieval was asked for
	Explicit      bool
	DecidedAt     time.Time
}

// Call is a validated, routed and estimated request, ready to dispatch.
type Call struct {
	RequestID uuid.UUID
	Principal *gateway.Principal
	Request   gateway.Request
	Estimate  metering.Estimate
	Route     Route
}

// Result is a committed response (or the committed part of a broken stream).
type Result struct {
	RequestID        uuid.UUID
	Model            gateway.Model
	Content          string
	Sources          []gateway.Source
	Verdict          string
	Usage            gateway.Usage
	RegionsActivated *int
	Route            Route
}

// Prepare checks the caller's rate limit, then validates in, routes it and
// estimates its cost. Failures are *gateway.Error values: RATE_LIMITED or the
// validation codes.
func (s *Service) Prepare(p *gateway.Principal, entry gateway.EntryPoint, in gateway.RequestInput) (*Call, error) {
	if !p.Rate.Admitted {
		s.Metrics.Refusal("rate_limit")
		return nil, gateway.RateLimitedError(p.Rate)
	}
	req, err := gateway.Validate(in, s.Models)
	if err != nil {
		return nil, err
	}
	est, err := s.Estimator.Estimate(req, entry)
	if err != nil {
		return nil, gateway.Errorf(gateway.EInvalidRequest, "the request cannot be priced: %v", err)
	}
	route := Route{
		ID:        newID(),
		Entry:     entry,
		Primary:   req.Model,
		Explicit:  req.ModelExplicit,
		DecidedAt: time.Now().UTC(),
	}
	if req.Hints.WebSearch {
		route.EvidenceModel = req.Model
	}
	return &Call{RequestID: newID(), Principal: p, Request: req, Estimate: est, Route: route}, nil
}

// Admit charges the call's estimate to the daily ceiling and reserves it on the
// project budget before it is dispatched.
func (s *Service) Admit(ctx context.Context, call *Call) error {
	lease := s.ReservationLease
	if lease <= 0 {
		lease = DefaultReservationLease
	}
	err := s.Ledger.Admit(ctx, gateway.Admission{
		RequestID: call.RequestID,
		Principal: call.Principal,
		Estimate:  call.Estimate.Total(),
		Day:       call.Route.DecidedAt,
		ExpiresAt: time.Now().Add(lease),
	})
	switch gateway.ErrorCodeOf(err) {
	case gateway.ERateLimited:
		s.Metrics.Refusal("daily_ceiling")
	case gateway.EBudgetExceeded:
		s.Metrics.Refusal("budget")
	}
	return err
}

// Complete runs an admitted call upstream and commits its usage. An upstream
// failure is INFERENCE_BUSY and bills nothing.
func (s *Service) Complete(ctx context.Context, call *Call) (*Result, error) {
	start := time.Now()
	res, err := s.Provider.Complete(ctx, s.upstreamRequest(call))
	s.Metrics.Upstream(string(call.Request.Model), upstream.Kind(err), time.Since(start))
	if err != nil {
		s.release(ctx, call)
		return nil, s.upstreamError(ctx, err)
	}
	return s.settle(ctx, call, res, false)
}

// Stream runs an admitted call upstream, passing each piece of output to emit, and commits
// the usage before returning. Three outcomes:
//   - success: the committed result, nil;
//   - failure before any output: nil, INFERENCE_BUSY (nothing billed);
//   - failure after output, or the caller gone (emit failed or ctx ended): the
//     committed result of what was produced, and the error (INFERENCE_BUSY for
//     an upstream failure).
func (s *Service) Stream(ctx context.Context, call *Call, emit func(upstream.Delta) error) (*Result, error) {
	started := false
	start := time.Now()
	res, err := s.Provider.Stream(ctx, s.upstreamRequest(call), func(d upstream.Delta) error {
		started = true
		return emit(d)
	})
	s.Metrics.Upstream(string(call.Request.Model), upstream.Kind(err), time.Since(start))
	if err == nil {
		return s.settle(ctx, call, res, false)
	}
	if !started {
		s.release(ctx, call)
		return nil, s.upstreamError(ctx, err)
	}
	committed, settleErr := s.settle(ctx, call, res, true)
	if settleErr != nil {
		return nil, settleErr
	}
	if ctx.Err() != nil || !isUpstreamFailure(err) {
		return committed, fmt.Errorf("stream abandoned by the caller: %w", err)
	}
	return committed, s.upstreamError(ctx, err)
}

func (s *Service) upstreamRequest(call *Call) upstream.Request {
	req := call.Request
	return upstream.Request{
		Model:           req.Model,
		UpstreamModel:   s.Models[req.Model],
		System:          req.CustomInstructions,
		Prompt:          req.Prompt,
		MaxOutputTokens: req.MaxOutputRungs,
		Hints:           req.Hints,
	}
}

// settle prices what the upstream produced and commits it with the evidence.
// The commit survives the caller's cancellation: output produced is billed.
func (s *Service) settle(ctx context.Context, call *Call, res upstream.Result, failed bool) (*Result, error) {
	usage, err := s.Estimator.Actual(call.Request, call.Route.Entry, res)
	if err != nil {
		return nil, fmt.Errorf("error pricing usage: %w", err)
	}
	completed := time.Now().UTC()
	err = s.Ledger.Settle(context.WithoutCancel(ctx), gateway.UsageRecord{
		RequestID:         call.RequestID,
		Principal:         call.Principal,
		Model:             call.Request.Model,
		Entry:             call.Route.Entry,
		Failed:            failed,
		Usage:             usage,
		CreatedAt:         call.Route.DecidedAt,
		CompletedAt:       completed,
		Sources:           res.Sources,
		Verdict:           res.Verdict,
		EvidenceExpiresAt: completed.Add(s.EvidenceRetention),
	})
	if err != nil {
		return nil, fmt.Errorf("error committing usage: %w", err)
	}
	s.Metrics.Rungs(string(call.Request.Model), string(call.Route.Entry), usage.InputRungs, usage.OutputRungs)
	result := &Result{
		RequestID: call.RequestID,
		Model:     call.Request.Model,
		Content:   res.Content,
		Sources:   res.Sources,
		Verdict:   res.Verdict,
		Usage:     usage,
		Route:     call.Route,
	}
	if call.Request.IncludeRegions {
		zero := 0
		result.RegionsActivated = &zero
	}
	return result, nil
}

// release gives back the call's charge and reservation. Should that fail, the
// reservation's lease runs out and recovery releases it.
func (s *Service) release(ctx context.Context, call *Call) {
	if err := s.Ledger.Release(context.WithoutCancel(ctx), call.RequestID); err != nil && s.Logger != nil {
		s.Logger.Warn("error releasing reservation; recovery will release it", "request_id", call.RequestID, "error", err)
	}
}

func isUpstreamFailure(err error) bool {
	switch upstream.Kind(err) {
	case "unavailable", "rejected", "broken":
		return true
	}
	return false
}

// upstreamError turns a provider failure into INFERENCE_BUSY, keeping the
// upstream's own message when it rejected the request.
func (s *Service) upstreamError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("request abandoned by the caller: %w", ctx.Err())
	}
	e := &gateway.Error{Code: gateway.EInferenceBusy, RetryAfter: s.RetryAfter, Cause: err}
	var rejected *upstream.RejectedError
	switch {
	case errors.As(err, &rejected):
		e.Message = "the inference provider rejected the request: " + rejected.Message
	case errors.Is(err, upstream.ErrUnavailable):
		e.Message = "inference is unavailable; retry later"
	case errors.Is(err, upstream.ErrStreamBroken):
		e.Message = "the inference stream broke off; the output so far is billed"
	default:
		e.Message = "the inference request failed; retry later"
	}
	return e
}

func newID() uuid.UUID { return uuid.Must(uuid.NewV7()) }
