package server

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/tracing"
)

// RequestIDHeader carries a request's id: echoed when the client sends a
// usable one, generated otherwise; a generated one is also the request_id of
// the response made (body, sources, logs and header agree).
const RequestIDHeader = "x-request-id"

const maxRequestIDLen = 128

// observe gives every request an id, and once it is answered writes one JSON
// log line (id, method, route, status, duration, account; never a key or a
// prompt) and records it in the metrics. Errors are answered here, through the
// error handler, so the status is known.
func (s *Server) observe(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		start := time.Now()
		id := c.Request().Header.Get(RequestIDHeader)
		if !usableRequestID(id) {
			generated := uuid.Must(uuid.NewV7())
			id = generated.String()
			// A response made for this request takes this id as its request_id.
			c.SetRequest(c.Request().WithContext(context.WithValue(c.Request().Context(), generatedIDKey{}, generated)))
		}
		c.Response().Header().Set(RequestIDHeader, id)
		route := c.Path()
		if !s.routes[route] {
			route = metrics.Other // only the document's routes are label values (D11)
		}
		ctx, span := tracing.Request(c.Request().Context(), c.Request(), route)
		if span.IsRecording() {
			c.SetRequest(c.Request().WithContext(ctx))
		}
		if err := next(c); err != nil {
			c.Error(err)
		}
		method := metrics.Method(c.Request().Method)
		status, elapsed := c.Response().Status, time.Since(start)
		tracing.EndRequest(span, status)
		s.metrics.Request(route, method, status, elapsed)
		attrs := []slog.Attr{
			slog.String("request_id", id),
			slog.String("method", method),
			slog.String("route", route),
			slog.Int("status", status),
			slog.Float64("duration_ms", float64(elapsed.Microseconds())/1000),
			slog.Int64("bytes", c.Response().Size),
		}
		if p := gateway.PrincipalFrom(c.Request().Context()); p != nil {
			attrs = append(attrs, slog.String("account", p.AccountName), slog.String("key_id", p.KeyID.String()))
		}
		s.logger.LogAttrs(c.Request().Context(), slog.LevelInfo, "request", attrs...)
		return nil
	}
}

type generatedIDKey struct{}

// generatedRequestID is the request id observe generated for a request whose
// client sent none.
func generatedRequestID(ctx context.Context) (uuid.UUID, bool) {
	id, ok := ctx.Value(generatedIDKey{}).(uuid.UUID)
	return id, ok
}

// usableRequestID accepts short printable ASCII ids.
func usableRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDLen {
		return false
	}
	for _, r := range id {
		if r < 0x21 || r > 0x7e {
			return false
		}
	}
	return true
}
