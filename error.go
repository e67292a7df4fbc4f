// Package gateway holds the domain types of the inference gateway: error codes,
// models and routing, callers and their scopes. Implementations live in packages
// named after their dependency (store for PostgreSQL, server for HTTP, upstream for
// inference providers); cmd/gateway only wires them.
package gateway

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
	"unicode/utf8"
)

// ErrorCode is a machine-readable error code of the public API. The values equal
// the ErrorCode enum of openapi/openapi.yaml.
type ErrorCode string

// Error codes of the public API.
const (
	EInvalidRequest       ErrorCode = "INVALID_REQUEST"
	EEmptyPrompt          ErrorCode = "EMPTY_PROMPT"
	EPromptTooLarge       ErrorCode = "PROMPT_TOO_LARGE"
	EInvalidModel         ErrorCode = "INVALID_MODEL"
	EModelUnavailable     ErrorCode = "MODEL_UNAVAILABLE"
	EEmptyBatch           ErrorCode = "EMPTY_BATCH"
	EBatchTooLarge        ErrorCode = "BATCH_TOO_LARGE"
	EUnauthorized         ErrorCode = "UNAUTHORIZED"
	EInsufficientScope    ErrorCode = "INSUFFICIENT_SCOPE"
	EInsufficientTier     ErrorCode = "INSUFFICIENT_TIER"
	EBatchNotFound        ErrorCode = "BATCH_NOT_FOUND"
	EBatchExpired         ErrorCode = "BATCH_EXPIRED"
	ESourcesNotFound      ErrorCode = "SOURCES_NOT_FOUND"
	ENotFound             ErrorCode = "NOT_FOUND"
	EMethodNotAllowed     ErrorCode = "METHOD_NOT_ALLOWED"
	EBatchNotCancellable  ErrorCode = "BATCH_NOT_CANCELLABLE"
	ERequestTimeout       ErrorCode = "REQUEST_TIMEOUT"
	ERequestTooLarge      ErrorCode = "REQUEST_TOO_LARGE"
	EIdempotencyKeyReused ErrorCode = "IDEMPOTENCY_KEY_REUSED"
	ERateLimited          ErrorCode = "RATE_LIMITED"
	EBudgetExceeded       ErrorCode = "BUDGET_EXCEEDED"
	EInferenceBusy        ErrorCode = "INFERENCE_BUSY"
	EServiceUnavailable   ErrorCode = "SERVICE_UNAVAILABLE"
	EInterrupted          ErrorCode = "INTERRUPTED"
	EInternal             ErrorCode = "INTERNAL"
)

// ErrorCodes lists every error code, in the order of the OpenAPI enum.
var ErrorCodes = []ErrorCode{
	EInvalidRequest, EEmptyPrompt, EPromptTooLarge, EInvalidModel, EModelUnavailable,
	EEmptyBatch, EBatchTooLarge, EUnauthorized, EInsufficientScope, EInsufficientTier,
	EBatchNotFound, EBatchExpired, ESourcesNotFound, ENotFound, EMethodNotAllowed, EBatchNotCancellable,
	ERequestTimeout, ERequestTooLarge, EIdempotencyKeyReused, ERateLimited, EBudgetExceeded,
	EInferenceBusy, EServiceUnavailable, EInterrupted, EInternal,
}

// Error is a domain error the API reports to the caller: a code, a message for
// humans that never leaks internals, and optional details for the reply's headers.
type Error struct {
	Code    ErrorCode
	Message string
	// RetryAfter, when positive, is sent as the Retry-After header.
	RetryAfter time.Duration
	// BatchIndex, when set, names the offending batch item (x-service-batch-index).
	BatchIndex *int
	// Cause is the underlying error, for logs only.
	Cause error
}

// InItem makes e the refusal of a batch's item index: its message begins
// with the item (`requests[2]: `) and it names the index
// (x-service-batch-index). It returns e.
func (e *Error) InItem(index int) *Error {
	e.BatchIndex = &index
	e.Message = fmt.Sprintf("requests[%d]: %s", index, e.Message)
	return e
}

// RetryAfterSeconds is RetryAfter as the Retry-After header says it: in whole
// seconds, rounded up.
func (e *Error) RetryAfterSeconds() int {
	return int(math.Ceil(e.RetryAfter.Seconds()))
}

// Error implements error.
func (e *Error) Error() string {
	if e.Cause != nil {
		return fmt.Sprintf("%s: %s: %v", e.Code, e.Message, e.Cause)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Cause }

// Errorf returns an *Error with a formatted message.
func Errorf(code ErrorCode, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// ErrorCodeOf returns the code of err's *Error, or EInternal when it has none.
func ErrorCodeOf(err error) ErrorCode {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return EInternal
}

// maxQuotedBytes bounds what of a caller's value an error message repeats.
const maxQuotedBytes = 64

// Quote quotes a caller's value for an error message, as %q does, cut as
// Clip cuts it.
func Quote(s string) string { return strconv.Quote(Clip(s)) }

// Clip is s cut after maxQuotedBytes (at a character's start) with an
// ellipsis, for an error message: a reply, and the log, never repeat a
// large value of a caller's whole.
func Clip(s string) string {
	if len(s) <= maxQuotedBytes {
		return s
	}
	cut := maxQuotedBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
