// Package inference runs interactive requests: it validates and routes a
// request, prices its estimate, dispatches it to the upstream provider (whole or
// streamed), prices the upstream's usage and commits it with the evidence before
// the caller sees the final reply.
package inference

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/logsample"
	"github.com/rungworks/gateway/internal/retry"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/tracing"
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
	Release(requestID uuid.UUID)
	// Unconfirmed ends a request whose settlement may or may not be stored,
	// its cost counted as a settled request's is.
	Unconfirmed(requestID uuid.UUID, cost int64)
}

// DefaultSettleWindow is how long a finished request retries its settlement
// while the database is away (a restart takes a second or two) before it gives
// up, answers SERVICE_UNAVAILABLE and bills nothing (unless the settlement may
// be stored: see settle).
const DefaultSettleWindow = 10 * time.Second

// ErrShutdown is the cause with which the server cancels calls still running
// when its shutdown grace ends: they end as an upstream failure would, with
// what was produced billed and the caller told (decisions D12).
var ErrShutdown = errors.New("the gateway is shutting down")

// ErrCallerGone marks a stream the caller abandoned: nobody reads its reply.
var ErrCallerGone = errors.New("the caller went away")

// Service runs interactive requests.
type Service struct {
	Provider upstream.Provider
	// Models says which canonical models are served (the router's routes).
	Models    gateway.Catalog
	Estimator *metering.Estimator
	Ledger    Ledger
	// EvidenceRetention is how long evidence is held.
	EvidenceRetention time.Duration
	// RetryAfter is suggested to callers when the upstream is unavailable
	// and did not say how long to wait.
	RetryAfter time.Duration
	// SettleWindow bounds the retries of a settlement while the database is
	// away; zero means DefaultSettleWindow.
	SettleWindow time.Duration
	// Unavailable reports whether an error means the database is away for the
	// moment (worth retrying); nil means never.
	Unavailable func(error) bool
	// MayHaveCommitted reports whether a settlement that failed with an error
	// may still have been stored (its reply was lost after it was sent); nil
	// means never.
	MayHaveCommitted func(error) bool
	// Logger reports the settlements whose outcome was unknown (see settle);
	// nil discards.
	Logger *slog.Logger
	// Metrics, when set, records upstream calls, rungs and refusals.
	Metrics *metrics.Metrics

	late lateSettlements
}

// lateSettlements tracks the settlements sent again in the background after
// their replies went out (see settleLater).
type lateSettlements struct {
	mu      sync.Mutex
	running sync.WaitGroup
	stop    context.Context // ended by WaitLateSettlements
	cancel  context.CancelFunc
}

// start registers a late settlement; it reports false once the service has
// stopped sending them (the settlement then is not sent again). ctx ends
// when WaitLateSettlements gives up on them.
func (l *lateSettlements) start() (context.Context, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.init()
	if l.stop.Err() != nil {
		return nil, false
	}
	l.running.Add(1)
	return l.stop, true
}

// stopSending ends the late settlements still running, and those to come.
func (l *lateSettlements) stopSending() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.init()
	l.cancel()
}

// init makes the context of late settlements; mu is held.
func (l *lateSettlements) init() {
	if l.stop == nil {
		l.stop, l.cancel = context.WithCancel(context.Background())
	}
}

// Route is the route decided for a request.
type Route struct {
	ID            uuid.UUID
	Entry         gateway.EntryPoint
	Primary       gateway.Model
	EvidenceModel gateway.Model // empty when no retrieval was asked for
	Explicit      bool
	DecidedAt     time.Time
	// Upstream is the target that answered; set once the call has run.
	Upstream gateway.UpstreamRoute
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
	err := s.Ledger.Admit(ctx, gateway.Admission{
		RequestID: call.RequestID,
		Principal: call.Principal,
		Estimate:  call.Estimate.Total(),
		Day:       call.Route.DecidedAt,
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
	s.trace(ctx, call)
	start := time.Now()
	res, err := s.Provider.Complete(ctx, s.upstreamRequest(call))
	s.observe(ctx, call, err, start)
	if err != nil {
		s.release(call)
		return nil, s.upstreamError(ctx, err)
	}
	return s.settle(ctx, call, res, false)
}

// Stream runs an admitted call upstream, passing each piece of output to emit, and commits
// the usage before returning. Four outcomes:
//   - success: the committed result, nil;
//   - failure before any output: nil, INFERENCE_BUSY (nothing billed);
//   - failure after output (the upstream's, or the server's shutdown): the
//     committed result of what was produced, and INFERENCE_BUSY;
//   - the caller gone (emit failed or ctx ended): the committed result and
//     ErrCallerGone. Any other failure after output, of whatever kind, is
//     the upstream's.
//
// When the settlement itself fails, nothing is billed and the result, with zero
// usage, comes with the settlement's error: the caller is told it was not
// billed (decisions D12: never billed without being sent the usage). A
// settlement that may be stored counts as committed (see settle).
func (s *Service) Stream(ctx context.Context, call *Call, emit func(upstream.Delta) error) (*Result, error) {
	s.trace(ctx, call)
	var started, gone bool
	start := time.Now()
	res, err := s.Provider.Stream(ctx, s.upstreamRequest(call), func(d upstream.Delta) error {
		started = true
		if err := emit(d); err != nil {
			gone = true
			return err
		}
		return nil
	})
	return s.streamed(ctx, call, &res, err, started, gone, start)
}

// streamed settles a stream the upstream ran (begun at start; started says
// it emitted output, gone that emit failed) and says how it ended. Apart from
// Stream, whose frame is under the upstream call while it waits, often long,
// for a first token.
func (s *Service) streamed(ctx context.Context, call *Call, res *upstream.Result, err error, started, gone bool, start time.Time) (*Result, error) {
	s.observe(ctx, call, err, start)
	if err != nil && !started {
		s.release(call)
		return nil, s.upstreamError(ctx, err)
	}
	committed, settleErr := s.settle(ctx, call, *res, err != nil)
	if settleErr != nil {
		return s.result(call, upstream.Result{}, gateway.Usage{}), settleErr
	}
	switch {
	case err == nil:
		return committed, nil
	case shuttingDown(ctx):
		return committed, s.upstreamError(ctx, err)
	case ctx.Err() != nil || gone:
		return committed, fmt.Errorf("%w: %w", ErrCallerGone, err)
	}
	return committed, s.upstreamError(ctx, err)
}

// observe records the outcome of a call's upstream run, begun at start, in
// the metrics and on the request's span.
func (s *Service) observe(ctx context.Context, call *Call, err error, start time.Time) {
	kind := upstream.Kind(err)
	s.Metrics.Upstream(string(call.Request.Model), kind, time.Since(start))
	tracing.Fail(ctx, kind)
}

// trace describes the call on the request's span.
func (s *Service) trace(ctx context.Context, call *Call) {
	req := call.Request
	tracing.Inference(ctx, call.RequestID.String(), string(req.Model), req.MaxOutputRungs, req.CustomInstructions, req.Prompt)
}

func shuttingDown(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrShutdown) }

func (s *Service) upstreamRequest(call *Call) *upstream.Request {
	req := call.Request
	return &upstream.Request{
		Model:           req.Model,
		System:          req.CustomInstructions,
		Prompt:          req.Prompt,
		MaxOutputTokens: req.MaxOutputRungs,
		Hints:           req.Hints,
		Tenant:          call.Principal.AccountID,
	}
}

// settle prices what the upstream produced and commits it with the evidence.
// The commit survives the caller's cancellation: output produced is billed.
// While the database is away it retries, for SettleWindow; a settlement that
// cannot be stored releases the reservation instead, bills nothing, and is
// SERVICE_UNAVAILABLE (or INTERNAL when the database refused it).
//
// One exception: when an attempt's reply was lost after it was sent, it may
// have been stored, and only the database can tell (a settlement sent again
// is stored once). If the window ends before the database answers, the
// caller gets the result with its usage, as if the commit had been
// confirmed: were it stored, a caller told "nothing was billed" would have
// been billed without the usage, and retrying, billed twice (D12). The
// settlement is then sent again in the background until the database answers
// (settleLater), so the database ends up holding exactly the usage the caller
// was sent; the request is logged for the operator.
func (s *Service) settle(ctx context.Context, call *Call, res upstream.Result, failed bool) (*Result, error) {
	usage, err := s.Estimator.Actual(call.Request, call.Route.Entry, res)
	if err != nil {
		s.release(call)
		return nil, fmt.Errorf("error pricing usage: %w", err)
	}
	completed := time.Now().UTC()
	record := gateway.UsageRecord{
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
	}
	window := s.SettleWindow
	if window <= 0 {
		window = DefaultSettleWindow
	}
	unconfirmed := false
	settleCtx, span := tracing.StartSettlement(ctx)
	err = s.retry(settleCtx, window, func(ctx context.Context) error {
		err := s.Ledger.Settle(ctx, record)
		unconfirmed = unconfirmed || err != nil && s.MayHaveCommitted != nil && s.MayHaveCommitted(err)
		return err
	})
	tracing.EndSettlement(span, settlementOutcome(err, unconfirmed, s.unavailable))
	if err != nil && unconfirmed {
		s.Ledger.Unconfirmed(call.RequestID, usage.TotalRungs)
		s.logger().ErrorContext(logsample.Each(ctx), "a settlement's reply was lost and the database stayed away: the response is sent with its usage, which may not be stored yet; it is sent again until the database answers",
			"request_id", call.RequestID, "account_id", call.Principal.AccountID, "total_rungs", usage.TotalRungs, "error", err)
		s.Metrics.Unconfirmed(metrics.UnconfirmedSent)
		s.settleLater(record)
		err = nil
	}
	if err != nil {
		s.release(call)
		if s.unavailable(err) {
			return nil, &gateway.Error{Code: gateway.EServiceUnavailable, RetryAfter: s.RetryAfter, Cause: err,
				Message: "the response could not be recorded because the gateway's database is away; nothing was billed, retry later"}
		}
		return nil, &gateway.Error{Code: gateway.EInternal, Cause: err, Message: "the response could not be recorded; nothing was billed"}
	}
	s.Metrics.Rungs(string(call.Request.Model), string(call.Route.Entry), usage.InputRungs, usage.OutputRungs)
	tracing.Usage(ctx, usage.InputTokens, usage.OutputTokens, usage.InputRungs, usage.OutputRungs, res.Content)
	return s.result(call, res, usage), nil
}

// settlementOutcome names how a settlement that ended with err failed, for
// its span: "" when it was stored, "unconfirmed" when it may have been (its
// reply was lost), "unavailable" when the database stayed away, "refused"
// when the database refused it.
func settlementOutcome(err error, unconfirmed bool, unavailable func(error) bool) string {
	switch {
	case err == nil:
		return ""
	case unconfirmed:
		return "unconfirmed"
	case unavailable(err):
		return "unavailable"
	}
	return "refused"
}

// maxRetryWait is the longest wait between two attempts of a settlement.
const maxRetryWait = 2 * time.Second

// lateSettleWindow bounds how long a settlement whose outcome is unknown is
// sent again, in the background, after its reply went out.
const lateSettleWindow = 10 * time.Minute

// settleLater sends again, in the background until the database answers, a
// settlement that may or may not be stored: it is stored once either way, so
// the usage the caller was sent ends up billed, exactly. At shutdown,
// WaitLateSettlements waits for these and logs those it gives up on.
func (s *Service) settleLater(record gateway.UsageRecord) {
	ctx, ok := s.late.start()
	if !ok {
		s.lateMissing(record, errors.New("the gateway is stopping and no longer sends settlements again"))
		return
	}
	go func() {
		defer s.late.running.Done()
		err := retry.Until(ctx, lateSettleWindow, maxRetryWait, s.unavailable, func(ctx context.Context) error {
			s.Metrics.DatabaseRetry(metrics.RetryLateSettlement) // each call here sends it again
			return s.Ledger.Settle(ctx, record)
		})
		if err != nil {
			s.lateMissing(record, err)
			return
		}
		s.Metrics.Unconfirmed(metrics.UnconfirmedStored)
		s.logger().Info("a settlement sent with its usage is stored", "request_id", record.RequestID)
	}()
}

// lateMissing reports a settlement sent with its usage that was given up on.
func (s *Service) lateMissing(record gateway.UsageRecord, err error) {
	s.Metrics.Unconfirmed(metrics.UnconfirmedMissing)
	s.logger().ErrorContext(logsample.Each(context.Background()), "a settlement sent with its usage could not be stored; its usage may be missing", "request_id", record.RequestID,
		"account_id", record.Principal.AccountID, "total_rungs", record.Usage.TotalRungs, "error", err)
}

// WaitLateSettlements waits, until ctx ends, for the settlements being sent
// again in the background (see settle); at shutdown, call it once no request
// is left. When ctx ends first, those still unconfirmed are given up on, each
// logged with its request and usage, and it returns ctx's error. Settlements
// whose reply is lost from then on are not sent again, and are logged alike.
func (s *Service) WaitLateSettlements(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.late.running.Wait(); close(done) }()
	select {
	case <-done:
		s.late.stopSending()
		return nil
	case <-ctx.Done():
		s.late.stopSending()
		<-done
		return ctx.Err()
	}
}

// result is the reply of a call whose usage is committed.
func (s *Service) result(call *Call, res upstream.Result, usage gateway.Usage) *Result {
	result := &Result{
		RequestID: call.RequestID,
		Model:     call.Request.Model,
		Content:   res.Content,
		Sources:   res.Sources,
		Verdict:   res.Verdict,
		Usage:     usage,
		Route:     call.Route,
	}
	result.Route.Upstream = res.Route
	if call.Request.IncludeRegions {
		zero := 0
		result.RegionsActivated = &zero
	}
	return result
}

// release gives back the call's charge and reservation.
func (s *Service) release(call *Call) { s.Ledger.Release(call.RequestID) }

// retry runs fn (whatever ctx's cancellation) until it succeeds, fails for a
// reason other than the database being away, or window has passed, counting
// each attempt after the first as a settlement's retry.
func (s *Service) retry(ctx context.Context, window time.Duration, fn func(context.Context) error) error {
	retried := func() { s.Metrics.DatabaseRetry(metrics.RetrySettlement) }
	return retry.Until(context.WithoutCancel(ctx), window, maxRetryWait, s.unavailable, retry.Counted(retried, fn))
}

func (s *Service) logger() *slog.Logger {
	if s.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Logger
}

func (s *Service) unavailable(err error) bool { return s.Unavailable != nil && s.Unavailable(err) }

// upstreamError turns a provider failure into INFERENCE_BUSY, keeping the
// upstream's own message when it rejected the request.
func (s *Service) upstreamError(ctx context.Context, err error) error {
	if ctx.Err() != nil && !shuttingDown(ctx) {
		return fmt.Errorf("%w: %w", ErrCallerGone, ctx.Err())
	}
	// The wait the upstream asked for, or its circuit's, when there is one.
	e := &gateway.Error{Code: gateway.EInferenceBusy, RetryAfter: cmp.Or(upstream.RetryAfter(err), s.RetryAfter), Cause: err}
	var rejected *upstream.RejectedError
	switch {
	case shuttingDown(ctx):
		e.Message = "the gateway is shutting down; the output so far, if any, is billed; retry"
	case errors.As(err, &rejected):
		e.Message = "the inference provider rejected the request: " + rejected.Message
	case errors.Is(err, upstream.ErrCallerHeld):
		e.Message = "this account's last requests failed at the inference provider while others' did not; its requests wait out a cool-down (Retry-After); retry then"
	case errors.Is(err, upstream.ErrUnavailable):
		e.Message = "inference is unavailable; retry later"
	case errors.Is(err, upstream.ErrFailed):
		e.Message = "the inference request failed; retry later"
	case errors.Is(err, upstream.ErrStreamBroken):
		e.Message = "the inference stream broke off; the output so far is billed"
	default:
		e.Message = "the inference request failed; retry later"
	}
	return e
}

func newID() uuid.UUID { return uuid.Must(uuid.NewV7()) }
