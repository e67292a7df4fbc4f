// Package upstream defines the inference provider interface that everything
// running inference uses, the error classes that tell a call the upstream never
// processed from one it may have (decisions D12), and the guard that makes what
// a provider returns safe to store (D11).
package upstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
)

// Request is one inference call.
type Request struct {
	// Model is the canonical model; UpstreamModel the name sent upstream.
	Model         gateway.Model
	UpstreamModel string
	System        string
	Prompt        string
	// MaxOutputTokens is the accepted max_output_rungs.
	MaxOutputTokens uint64
	Hints           gateway.Hints
	// AtMostOnce says the prompt may reach at most one upstream (a batch item,
	// D12): a failed attempt moves to another target only when the first
	// certainly did not process it. Interactive calls leave it false.
	AtMostOnce bool
	// Tenant is the account the call is made for (uuid.Nil: none named). A
	// router tells one tenant's failures from a target's trouble by it, and
	// holds off only that tenant's calls when they alone fail (ErrCallerHeld).
	Tenant uuid.UUID
	// OnDispatch, when set, is called once the request is about to be written to
	// the upstream: from then on the call may be processed, so it must never be
	// retried (D12).
	OnDispatch func()
}

// Dispatched calls r.OnDispatch, if set.
func (r *Request) Dispatched() {
	if r.OnDispatch != nil {
		r.OnDispatch()
	}
}

// Result is a finished (or, from a broken stream, partial) inference call.
type Result struct {
	Content string
	// Reasoning is the thinking a reasoning model produced beside its
	// content, as an upstream sends it. It is neither sent nor kept, but it is
	// output the upstream charges for: when the upstream reports no usage (a
	// stream cut short), the caller counts it with the content.
	Reasoning string
	Sources   []gateway.Source
	Verdict   string
	// UsageReported says the upstream reported the token counts; when false
	// (a stream that broke or an upstream that sends no usage) they are zero and
	// the caller estimates them.
	UsageReported bool
	InputTokens   uint64
	OutputTokens  uint64
	// Route names the target that produced the result and counts the
	// targets tried for it (set by a router).
	Route gateway.UpstreamRoute
}

// Delta is a piece of a streamed reply: text, evidence, or both.
type Delta struct {
	Content string
	Sources []gateway.Source
}

// Provider runs inference. Implementations honour ctx cancellation, call
// req.Dispatched before writing the request, and classify failures:
// ErrUnavailable when the upstream certainly did not process the call (safe to
// retry), ErrFailed when it may have (never retry), *RejectedError when it
// refused this request, ErrStreamBroken when a stream ended early.
type Provider interface {
	// Complete runs the request and returns the whole reply.
	Complete(ctx context.Context, req *Request) (Result, error)
	// Stream runs the request, calling emit for each piece of output as it
	// arrives. It returns what was produced, also when it fails part-way (the
	// caller bills that); an error from emit stops the stream and is returned.
	Stream(ctx context.Context, req *Request, emit func(Delta) error) (Result, error)
}

// ErrStreamBroken marks a stream that ended before the upstream finished it.
var ErrStreamBroken = errors.New("upstream stream ended early")

// ErrUnavailable marks a call the upstream certainly did not process: the
// connection could not be made (refused, DNS, TLS handshake), the upstream
// answered 429 or 503, or it refused the gateway (ErrDenied). Such a call may
// be retried (D12).
var ErrUnavailable = errors.New("upstream unavailable")

// ErrRateLimited marks an ErrUnavailable that is the upstream's 429: a limit
// on the rate of calls or tokens, which the gateway's traffic as a whole can
// reach, and so can one request alone (a prompt larger than a per-minute
// token limit).
var ErrRateLimited = errors.New("the upstream limited the rate of calls (429)")

// ErrCallerHeld marks an ErrUnavailable that holds off one tenant's calls
// (Request.Tenant) and no one else's: the targets failed that tenant's last
// calls after dispatch while no other tenant's failed, so its calls wait out a
// cool-down (RetryAfter says how long) and every other tenant's go on.
var ErrCallerHeld = errors.New("this tenant's last calls failed upstream; its calls are held off for a cool-down")

// MaxRetryAfter bounds the wait an upstream may ask for (RetryAfter): a
// longer one, or a hostile one, is taken as this.
const MaxRetryAfter = time.Minute

// retryAfterError is an outage whose upstream said how long to wait.
type retryAfterError struct {
	err   error
	after time.Duration
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// WithRetryAfter returns err carrying how long the upstream asked callers to
// wait before the next call (bounded by MaxRetryAfter); a wait of zero or
// less returns err as it is.
func WithRetryAfter(err error, after time.Duration) error {
	if after <= 0 {
		return err
	}
	return &retryAfterError{err: err, after: min(after, MaxRetryAfter)}
}

// RetryAfter is how long the upstream asked to wait before the next call,
// when err carries it (see WithRetryAfter); zero otherwise.
func RetryAfter(err error) time.Duration {
	if e, ok := errors.AsType[*retryAfterError](err); ok {
		return e.after
	}
	return 0
}

// isType reports whether err's tree holds an error of type E.
func isType[E error](err error) bool {
	_, ok := errors.AsType[E](err)
	return ok
}

// ErrDenied marks an upstream's refusal of the gateway itself rather than of
// the request: its credentials (401, 407) or the address or model it was
// configured with (404). No prompt causes it and the upstream did not run
// the call, so it comes wrapped in ErrUnavailable and is handled as an
// outage is: the next target, the target's circuit, a batch item back to
// the queue. Its message may quote the credentials: it is for the
// operator's log, never for a caller.
var ErrDenied = errors.New("the upstream refused the gateway's credentials, address or model")

// ErrFailed marks a call that failed after it was dispatched: a timeout, a
// reset, any other 5xx, an unreadable reply. The upstream may have processed
// it, so it is never retried (D12).
var ErrFailed = errors.New("upstream call failed after dispatch")

// ErrTooLong marks a reply a provider stopped reading: longer than its
// request allows (its text at MaxTextBytes and its sources, escaped at
// worst), or a stream with one line that long. It comes wrapped in ErrFailed
// (ErrStreamBroken for a stream), and Guard counts it as a reply past its
// text's bound (CutText).
var ErrTooLong = errors.New("the reply is longer than its request allows")

// RejectedError is an upstream's refusal of one request (a 4xx other than
// 408, 429 and those of ErrDenied).
type RejectedError struct {
	Status  int
	Message string
}

// Error implements error.
func (e *RejectedError) Error() string {
	return fmt.Sprintf("upstream rejected the request (status %d): %s", e.Status, e.Message)
}

// ParseModelPairs parses "instant=a,reasoning=b" into values per canonical model.
// Keys must be canonical model names (or aliases); values must be non-empty.
func ParseModelPairs(s string) (map[gateway.Model]string, error) {
	out := map[gateway.Model]string{}
	for _, pair := range strings.Split(s, ",") {
		pair = strings.TrimSpace(pair)
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		v = strings.TrimSpace(v)
		if !ok || v == "" {
			return nil, fmt.Errorf("%q is not of the form model=value", pair)
		}
		model, err := gateway.ParseModel(k)
		if err != nil {
			return nil, fmt.Errorf("%q: unknown model %q", pair, k)
		}
		out[model] = v
	}
	return out, nil
}

// The kinds of upstream failure Kind names.
const (
	KindUnavailable = "unavailable" // certainly not processed
	KindDenied      = "denied"      // the gateway's access refused: not processed
	KindFailed      = "failed"      // failed after dispatch
	KindRejected    = "rejected"    // the upstream refused the request
	KindBroken      = "broken"      // a stream cut short
	KindCancelled   = "cancelled"   // the caller went away
	KindOther       = "other"
)

// Kind names the class of an upstream failure, for metrics, logs and
// fallback decisions: one of the Kind constants, empty for nil. The values
// are a fixed set, fit for metric labels.
func Kind(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrDenied):
		return KindDenied
	case errors.Is(err, ErrUnavailable):
		return KindUnavailable
	case errors.Is(err, ErrFailed):
		return KindFailed
	case isType[*RejectedError](err):
		return KindRejected
	case errors.Is(err, ErrStreamBroken):
		return KindBroken
	case errors.Is(err, context.Canceled):
		return KindCancelled
	default:
		return KindOther
	}
}
