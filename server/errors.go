package server

import (
	"errors"
	"math"
	"net/http"
	"strconv"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
)

// statusOf is the HTTP status of each error code (decisions D1, D3, D8).
var statusOf = map[gateway.ErrorCode]int{
	gateway.EInvalidRequest:    http.StatusBadRequest,
	gateway.EEmptyPrompt:       http.StatusBadRequest,
	gateway.EPromptTooLarge:    http.StatusBadRequest,
	gateway.EInvalidModel:      http.StatusBadRequest,
	gateway.EModelUnavailable:  http.StatusBadRequest,
	gateway.EEmptyBatch:        http.StatusBadRequest,
	gateway.EBatchTooLarge:     http.StatusBadRequest,
	gateway.EUnauthorized:      http.StatusUnauthorized,
	gateway.EBudgetExceeded:    http.StatusPaymentRequired,
	gateway.EInsufficientScope: http.StatusForbidden,
	gateway.EInsufficientTier:  http.StatusForbidden,
	gateway.EBatchNotFound:     http.StatusNotFound,
	// BATCH_EXPIRED is only ever a batch-level error; should it escape, it is a server fault.
	gateway.EBatchExpired:         http.StatusInternalServerError,
	gateway.ESourcesNotFound:      http.StatusNotFound,
	gateway.ENotFound:             http.StatusNotFound,
	gateway.EMethodNotAllowed:     http.StatusMethodNotAllowed,
	gateway.EBatchNotCancellable:  http.StatusConflict,
	gateway.ERequestTooLarge:      http.StatusRequestEntityTooLarge,
	gateway.EIdempotencyKeyReused: http.StatusUnprocessableEntity,
	gateway.ERateLimited:          http.StatusTooManyRequests,
	gateway.EInternal:             http.StatusInternalServerError,
	gateway.EInferenceBusy:        http.StatusServiceUnavailable,
	// INTERRUPTED is only ever a batch item error; should it escape, it is a server fault.
	gateway.EInterrupted: http.StatusInternalServerError,
}

// handleError is the one place where errors become HTTP replies: every
// non-streaming error is the envelope {"error": {"code", "message"}}.
func (s *Server) handleError(err error, c echo.Context) {
	if c.Response().Committed {
		s.logger.Warn("error after the reply started", "path", c.Path(), "error", err)
		return
	}
	e := toDomainError(err)
	status, ok := statusOf[e.Code]
	if !ok {
		status = http.StatusInternalServerError
	}
	if status >= 500 && e.Code != gateway.EInferenceBusy {
		s.logger.Error("request failed", "method", c.Request().Method, "path", c.Path(), "error", err)
	}
	h := c.Response().Header()
	if e.Code == gateway.EUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="gateway"`)
	}
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int(math.Ceil(e.RetryAfter.Seconds()))))
	}
	if e.BatchIndex != nil {
		h.Set("x-service-batch-index", strconv.Itoa(*e.BatchIndex))
	}
	if err := c.JSON(status, envelopeOf(e)); err != nil {
		s.logger.Warn("error writing error reply", "error", err)
	}
}

func envelopeOf(e *gateway.Error) api.ErrorEnvelope {
	return api.ErrorEnvelope{Error: api.Error{Code: api.ErrorCode(e.Code), Message: e.Message}}
}

// errorEnvelope is the body of err, as a reply or a response.error event.
func errorEnvelope(err error) api.ErrorEnvelope { return envelopeOf(toDomainError(err)) }

// toDomainError maps any error to a *gateway.Error: domain errors as they are,
// Echo's routing and parameter errors to their codes, anything else to INTERNAL
// with a message that leaks nothing.
func toDomainError(err error) *gateway.Error {
	var e *gateway.Error
	if errors.As(err, &e) {
		return e
	}
	var he *echo.HTTPError
	if errors.As(err, &he) {
		switch he.Code {
		case http.StatusNotFound:
			return gateway.Errorf(gateway.ENotFound, "no such route")
		case http.StatusMethodNotAllowed:
			return gateway.Errorf(gateway.EMethodNotAllowed, "method not allowed on this route")
		case http.StatusRequestEntityTooLarge:
			return gateway.Errorf(gateway.ERequestTooLarge, "request body too large")
		case http.StatusBadRequest, http.StatusUnsupportedMediaType:
			msg, _ := he.Message.(string)
			if msg == "" {
				msg = "malformed request"
			}
			return &gateway.Error{Code: gateway.EInvalidRequest, Message: msg, Cause: err}
		}
	}
	return &gateway.Error{Code: gateway.EInternal, Message: "internal error", Cause: err}
}
