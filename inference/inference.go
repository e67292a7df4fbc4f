// Package inference runs interactive requests: it validates and routes a
// request, dispatches it to the upstream provider, prices the upstream's usage
// and commits it with the evidence before the caller sees the reply.
package inference

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/upstream"
)

// Recorder commits a finished request's usage and evidence.
type Recorder interface {
	RecordRequest(ctx context.Context, r gateway.UsageRecord) error
}

// Service runs interactive requests.
type Service struct {
	Provider  upstream.Provider
	Models    upstream.ModelMap
	Estimator *metering.Estimator
	Recorder  Recorder
	// EvidenceRetention is how long evidence is held.
	EvidenceRetention time.Duration
	// RetryAfter is suggested to callers when the upstream is unavailable.
	RetryAfter time.Duration
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

// Result is a committed response.
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

// Respond validates in, runs it upstream and commits its usage. Failures are
// *gateway.Error values: validation codes, or INFERENCE_BUSY when the upstream
// fails.
func (s *Service) Respond(ctx context.Context, p *gateway.Principal, entry gateway.EntryPoint, in gateway.RequestInput) (*Result, error) {
	req, err := gateway.Validate(in, s.Models)
	if err != nil {
		return nil, err
	}
	created := time.Now().UTC()
	route := Route{
		ID:        newID(),
		Entry:     entry,
		Primary:   req.Model,
		Explicit:  req.ModelExplicit,
		DecidedAt: created,
	}
	if req.Hints.WebSearch {
		route.EvidenceModel = req.Model
	}

	res, err := s.Provider.Complete(ctx, upstream.Request{
		Model:           req.Model,
		UpstreamModel:   s.Models[req.Model],
		System:          req.CustomInstructions,
		Prompt:          req.Prompt,
		MaxOutputTokens: req.MaxOutputRungs,
		Hints:           req.Hints,
	})
	if err != nil {
		return nil, s.upstreamError(ctx, err)
	}

	usage, err := s.Estimator.RateCard.Usage(req.Model, entry, res.InputTokens, res.OutputTokens)
	if err != nil {
		return nil, fmt.Errorf("error pricing usage: %w", err)
	}
	result := &Result{
		RequestID: newID(),
		Model:     req.Model,
		Content:   res.Content,
		Sources:   res.Sources,
		Verdict:   res.Verdict,
		Usage:     usage,
		Route:     route,
	}
	if req.IncludeRegions {
		zero := 0
		result.RegionsActivated = &zero
	}
	completed := time.Now().UTC()
	err = s.Recorder.RecordRequest(context.WithoutCancel(ctx), gateway.UsageRecord{
		RequestID:         result.RequestID,
		Principal:         p,
		Model:             req.Model,
		Entry:             entry,
		Usage:             usage,
		CreatedAt:         created,
		CompletedAt:       completed,
		Sources:           res.Sources,
		Verdict:           res.Verdict,
		EvidenceExpiresAt: completed.Add(s.EvidenceRetention),
	})
	if err != nil {
		return nil, fmt.Errorf("error committing usage: %w", err)
	}
	return result, nil
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
	default:
		e.Message = "the inference request failed; retry later"
	}
	return e
}

func newID() uuid.UUID { return uuid.Must(uuid.NewV7()) }
