package server

import (
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/openapi"
)

// authorize enforces an operation's policy before its body is read: a valid
// key in the one Authorization header (401), one of the operation's scopes
// (403 INSUFFICIENT_SCOPE), the account tier (403 INSUFFICIENT_TIER), then the
// key's rate limit (429), which operations that stream leave to the handler so
// a stream reports it in-band. Every authenticated reply carries
// x-ratelimit-limit and x-ratelimit-remaining. The principal travels in the
// request's context to the handler.
func (s *Server) authorize(p openapi.Policy) echo.MiddlewareFunc {
	scopes := make([]gateway.Scope, len(p.AnyScope))
	for i, sc := range p.AnyScope {
		scopes[i] = gateway.Scope(sc)
	}
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			// One Authorization header (RFC 9110 allows one): of two, net/http
			// reads the first, a proxy in front perhaps the other.
			values := c.Request().Header.Values("Authorization")
			if len(values) > 1 {
				return gateway.Errorf(gateway.EUnauthorized, "send one Authorization header, not %d", len(values))
			}
			token, ok := "", false
			if len(values) == 1 {
				token, ok = bearerToken(values[0])
			}
			if !ok {
				return gateway.UnauthorizedError()
			}
			// Its waits for the database are bounded within: a key the cache
			// holds, with a rate slice in memory, waits for none.
			principal, err := s.auth.Authenticate(c.Request().Context(), token)
			if err != nil {
				return err
			}
			// The request was counted: every reply from here on says so (D5).
			h := c.Response().Header()
			h.Set("x-ratelimit-limit", strconv.Itoa(principal.Rate.Limit))
			h.Set("x-ratelimit-remaining", strconv.Itoa(principal.Rate.Remaining))
			if len(scopes) > 0 && !principal.HasAnyScope(scopes) {
				return gateway.Errorf(gateway.EInsufficientScope, "this API key lacks the %s scope", strings.Join(p.AnyScope, " or "))
			}
			if p.Tier != "" && string(principal.Tier) != p.Tier {
				return gateway.Errorf(gateway.EInsufficientTier, "this operation needs an account of the %s tier", p.Tier)
			}
			if !principal.Rate.Admitted && !p.Streams {
				s.metrics.Refusal("rate_limit")
				return gateway.RateLimitedError(principal.Rate)
			}
			c.SetRequest(c.Request().WithContext(gateway.WithPrincipal(c.Request().Context(), principal)))
			return next(c)
		}
	}
}

// bearerToken extracts the token of an "Authorization: Bearer <token>" header.
func bearerToken(header string) (string, bool) {
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	return token, token != ""
}
