package server

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/openapi"
)

// DefaultTurnWait is how long a request in turns waits for its account's
// turn before it is refused.
const DefaultTurnWait = 10 * time.Second

// turnRetryAfter is the Retry-After of a request that waited too long for
// its turn.
const turnRetryAfter = 5 * time.Second

// turnFreeBytes is the largest body (batch creations) or text (responses)
// that takes no turn: a request that small takes a few milliseconds at most
// to decode and price.
const turnFreeBytes = 64 << 10

// DefaultTurnPlaces is how many of an account's large requests a replica
// prices at once: half its cores, at least one. An account flooding a
// replica with them takes no more than half its CPU, and every other request
// waits behind a few of them at most, not behind all it sent.
func DefaultTurnPlaces() int { return max(runtime.GOMAXPROCS(0)/2, 1) }

// errTurnWait ends the wait of a request for its turn.
var errTurnWait = errors.New("waited too long for the account's turn")

// turnKey is the context key of the leave func of a request's place.
type turnKey struct{}

// takeTurn holds a request of an operation in turns (p.InTurns: batch
// creations) whose body is over turnFreeBytes (and within the route's limit)
// or of unknown length until one of its account's places is free, before its
// body is read, so that the requests waiting hold no body in memory. The
// place is held until the handler calls endTurn, once the costly part is
// done, or until the request ends. A request that waits turnWait is refused
// RATE_LIMITED; one still waiting when the shutdown's grace ends,
// SERVICE_UNAVAILABLE.
func (s *Server) takeTurn(p openapi.Policy) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			r := c.Request()
			if r.ContentLength >= 0 && (r.ContentLength <= turnFreeBytes || r.ContentLength > p.MaxBodyBytes) {
				return next(c) // small, or too large for the route (limitBody)
			}
			leave, err := s.enterTurn(r.Context())
			if err != nil {
				return err
			}
			defer leave()
			c.SetRequest(r.WithContext(context.WithValue(r.Context(), turnKey{}, leave)))
			return next(c)
		}
	}
}

// enterTurn waits for a place of ctx's account, and returns its leave func
// or the refusal of the request.
func (s *Server) enterTurn(ctx context.Context) (leave func(), err error) {
	account := gateway.PrincipalFrom(ctx).AccountID
	ctx, done := s.callContext(ctx) // the wait ends with the shutdown's grace too
	defer done()
	ctx, cancel := context.WithTimeoutCause(ctx, s.turnWait, errTurnWait)
	defer cancel()
	leave, err = s.turns.Enter(ctx, account)
	switch {
	case err == nil:
		return leave, nil
	case errors.Is(err, errTurnWait):
		s.metrics.Refusal("turn_wait")
		return nil, &gateway.Error{Code: gateway.ERateLimited, RetryAfter: turnRetryAfter, Cause: err,
			Message: fmt.Sprintf("this account's requests over %d KiB are priced %d at a time on each replica, and this one waited %s for its turn; send fewer at once, or smaller ones", turnFreeBytes>>10, s.turns.Places(), s.turnWait)}
	case s.abort.Err() != nil:
		return nil, &gateway.Error{Code: gateway.EServiceUnavailable, RetryAfter: unavailableRetryAfter, Cause: err,
			Message: "this replica shut down while the request waited for its turn; nothing was done: send it again"}
	default:
		return nil, fmt.Errorf("error waiting for the account's turn: %w", err)
	}
}

// endTurn frees the place of ctx's request in its account's turns, if it
// holds one: its costly part is done.
func endTurn(ctx context.Context) {
	if leave, ok := ctx.Value(turnKey{}).(func()); ok {
		leave()
	}
}
