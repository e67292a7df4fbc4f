package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
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
	gateway.EServiceUnavailable:   http.StatusServiceUnavailable,
	gateway.ERequestTimeout:       http.StatusRequestTimeout,
	// INTERRUPTED is only ever a batch item error; should it escape, it is a server fault.
	gateway.EInterrupted: http.StatusInternalServerError,
}

// statusClientClosed is the status a request is logged and counted with when
// its client left before its reply (proxies' 499): nothing is sent.
const statusClientClosed = 499

// handleError is the one place where errors become HTTP replies: every
// non-streaming error is the envelope {"error": {"code", "message"}}. A
// request that failed, not for a domain error, once its context ended has
// lost its client (its connection closed, its HTTP/2 stream reset): its
// upstream call or its database work ended with it, which is no failure of
// the gateway's. It is logged and counted as statusClientClosed, and its
// exchange is cut (http.ErrAbortHandler) rather than answered to no one; an
// error the ending did not cause is still logged as a failure. A domain
// error is answered: a body cut at the body timeout also ends the context,
// and its client is still there to read the 408. An error once the reply
// has started (a stream's handler that panicked, a reply whose writes
// failed) cannot be answered: the exchange is cut, so that no client takes
// what was written for the whole.
func (s *Server) handleError(err error, c echo.Context) {
	if c.Response().Committed {
		s.logger.Warn("error after the reply started", requestAttrs(c, err)...)
		panic(http.ErrAbortHandler)
	}
	if failedAsClientLeft(c.Request().Context(), err) {
		if !errors.Is(err, context.Canceled) {
			s.logger.Error("request failed as its client left", requestAttrs(c, err)...)
		}
		c.Response().Status = statusClientClosed
		panic(http.ErrAbortHandler)
	}
	e := s.domainError(err)
	if e.Code == gateway.ENotFound {
		if near := s.pathTemplates.near(c.Request().Method, c.Request().URL.Path); near != "" {
			e = gateway.Errorf(gateway.ENotFound, "no such route; did you mean %s?", near)
		}
	}
	if x := exchangeFrom(c.Request().Context()); x != nil {
		x.errorCode = e.Code
	}
	status := statusFor(e.Code)
	if serverFault(e.Code) {
		s.logger.Error("request failed", requestAttrs(c, err)...)
	}
	h := c.Response().Header()
	if e.Code == gateway.EUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="gateway"`)
	}
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfterSeconds()))
	}
	if e.BatchIndex != nil {
		h.Set("x-service-batch-index", strconv.Itoa(*e.BatchIndex))
	}
	if err := c.JSON(status, envelopeOf(e)); err != nil {
		s.logger.Warn("error writing error reply", "error", err)
	}
}

// requestAttrs is what a log line about c's request says of it, beside err
// and extra: its request_id finds the request's access log line.
func requestAttrs(c echo.Context, err error, extra ...any) []any {
	attrs := append([]any{"method", c.Request().Method, "path", c.Path(), "error", err}, extra...)
	if x := exchangeFrom(c.Request().Context()); x != nil {
		attrs = append(attrs, "request_id", x.id)
	}
	return attrs
}

// failedAsClientLeft says whether err, the failure of a request whose
// context is ctx, is no fault of the gateway's: not a domain error, once ctx
// ended, as it does when the client leaves.
func failedAsClientLeft(ctx context.Context, err error) bool {
	_, domain := errors.AsType[*gateway.Error](err)
	return !domain && ctx.Err() != nil
}

// statusFor is the HTTP status of a reply with code.
func statusFor(code gateway.ErrorCode) int {
	if status, ok := statusOf[code]; ok {
		return status
	}
	return http.StatusInternalServerError
}

// serverFault says whether an error with code is a failure of the gateway's
// own, logged as one: a 5xx but INFERENCE_BUSY, the upstream's (its failures
// have metrics of their own).
func serverFault(code gateway.ErrorCode) bool {
	return statusFor(code) >= 500 && code != gateway.EInferenceBusy
}

func envelopeOf(e *gateway.Error) api.ErrorEnvelope {
	return api.ErrorEnvelope{Error: api.Error{Code: api.ErrorCode(e.Code), Message: e.Message}}
}

// domainError maps any error to a *gateway.Error: domain errors as they are,
// the database being away to SERVICE_UNAVAILABLE, Echo's routing and parameter
// errors to their codes, anything else to INTERNAL with a message that leaks
// nothing. Bodies are read by jsonBinder, whose errors (a body too large, a
// Content-Type not JSON) are domain errors already.
func (s *Server) domainError(err error) *gateway.Error {
	var e *gateway.Error
	if errors.As(err, &e) {
		return e
	}
	if s.unavailable(err) {
		return &gateway.Error{Code: gateway.EServiceUnavailable, RetryAfter: unavailableRetryAfter, Cause: err,
			Message: "the gateway's database cannot be reached for the moment; retry later"}
	}
	var he *echo.HTTPError
	if errors.As(err, &he) {
		switch he.Code {
		case http.StatusNotFound:
			return noSuchRoute()
		case http.StatusMethodNotAllowed:
			return gateway.Errorf(gateway.EMethodNotAllowed, "method not allowed on this route")
		case http.StatusBadRequest:
			return s.parameterError(he)
		}
	}
	return &gateway.Error{Code: gateway.EInternal, Message: "internal error", Cause: err}
}

// checkQuery refuses, for an operation that takes query parameters, a query
// string that does not parse (a malformed percent-escape, a ';' between
// pairs): the parser would drop the pair silently, and the operation would
// answer for a parameter left out (the usage of today for a start it could
// not read). It also refuses any of the operation's parameters given more
// than once or given empty (400 INVALID_REQUEST naming it): each takes one
// value, and of two the generated binder takes one silently (a time) or calls
// the pair malformed (a number), while an empty time would be read as the
// year 1. Other query parameters are ignored, repeated, empty or not.
func (s *Server) checkQuery(names []string) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if raw := c.Request().URL.RawQuery; raw != "" {
				query, err := url.ParseQuery(raw)
				if err != nil {
					return gateway.Errorf(gateway.EInvalidRequest, "the query string is malformed (%s): send name=value pairs separated by &, percent-encoded", gateway.Clip(err.Error()))
				}
				for _, name := range names {
					switch values := query[name]; {
					case len(values) > 1:
						return &gateway.Error{Code: gateway.EInvalidRequest, Message: givenTwice(name)}
					case len(values) == 1 && values[0] == "":
						return &gateway.Error{Code: gateway.EInvalidRequest, Message: s.notInForm(name)}
					}
				}
			}
			return next(c)
		}
	}
}

// givenTwice is the message for a parameter given more than once.
func givenTwice(name string) string {
	return fmt.Sprintf("parameter %s must be given once", name)
}

// parameterErrors match the generated server's parameter errors, whose text
// (parser internals) is never shown; the parameter's name is, and whether the
// value was empty.
var parameterErrors = regexp.MustCompile(`^(?:Invalid format for parameter ([^:]+):( parameter '[^']*' is empty)?|Expected one value for ([^,]+), got)`)

// parameterError says which parameter is malformed and the form it takes. An
// empty path parameter (/api/v1/batch//results; empty query values are
// refused before, by checkQuery) is a path outside the document, as
// /api/v1/batch/ is: no such route.
func (s *Server) parameterError(he *echo.HTTPError) *gateway.Error {
	msg, _ := he.Message.(string)
	m := parameterErrors.FindStringSubmatch(msg)
	e := &gateway.Error{Code: gateway.EInvalidRequest, Cause: he}
	switch {
	case m == nil:
		e.Message = "malformed request"
	case m[3] != "":
		e.Message = givenTwice(m[3])
	case m[2] != "":
		return noSuchRoute()
	default:
		e.Message = s.notInForm(m[1])
	}
	return e
}

func noSuchRoute() *gateway.Error {
	return gateway.Errorf(gateway.ENotFound, "no such route")
}

// notInForm says that parameter name must take its form.
func (s *Server) notInForm(name string) string {
	form, ok := s.paramForms[name]
	if !ok {
		form = "well formed"
	}
	return fmt.Sprintf("parameter %s must be %s", name, form)
}
