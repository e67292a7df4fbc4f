package server

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
)

// DefaultTurnWait is how long a request in turns waits for its account's
// turn before it is refused.
const DefaultTurnWait = 10 * time.Second

// turnRetryAfter is the Retry-After of a request that waited too long for
// its turn.
const turnRetryAfter = 5 * time.Second

// DefaultTurnPlaces is how many of an account's requests in turns a replica
// reads and prices at once: half its cores, at least one. An account flooding
// a replica with them takes no more than half its CPU, and every other
// request waits behind a few of them at most, not behind all it sent.
func DefaultTurnPlaces() int { return max(runtime.GOMAXPROCS(0)/2, 1) }

// errTurnWait ends the wait of a request for its turn.
var errTurnWait = errors.New("waited too long for the account's turn")

// errTurnShutdown ends the wait of a request for its turn when the
// shutdown's grace ends (Abort).
var errTurnShutdown = errors.New("the replica shut down while the request waited for its turn")

// turnKey is the context key of the leave func of a request's turn.
type turnKey struct{}

// takeTurn holds a request of an operation in turns (x-account-turns) until
// one of its account's places is free, before its body is read, so that the
// requests waiting hold no body in memory. The place is held until the
// handler calls endTurn, once the costly part is done, or until the request
// ends. A request that waits turnWait is refused RATE_LIMITED; one still
// waiting when the shutdown's grace ends, SERVICE_UNAVAILABLE.
func (s *Server) takeTurn(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		r := c.Request()
		ctx, abort := context.WithCancelCause(r.Context())
		stop := context.AfterFunc(s.abort, func() { abort(errTurnShutdown) })
		ctx, cancel := context.WithTimeoutCause(ctx, s.turnWait, errTurnWait)
		leave, err := s.turns.Enter(ctx, gateway.PrincipalFrom(r.Context()).AccountID)
		cancel()
		stop()
		abort(nil)
		switch {
		case errors.Is(err, errTurnWait):
			s.metrics.Refusal("turn_wait")
			return &gateway.Error{Code: gateway.ERateLimited, RetryAfter: turnRetryAfter, Cause: err,
				Message: fmt.Sprintf("this account's batch creations are read and priced %d at a time on each replica, and this one waited %s for its turn; send fewer at once, or smaller ones", s.turns.Places(), s.turnWait)}
		case errors.Is(err, errTurnShutdown):
			return &gateway.Error{Code: gateway.EServiceUnavailable, RetryAfter: unavailableRetryAfter, Cause: err,
				Message: "this replica shut down before the batch was read; nothing was stored: send it again"}
		case err != nil:
			return fmt.Errorf("error waiting for the account's turn: %w", err)
		}
		defer leave()
		c.SetRequest(r.WithContext(context.WithValue(r.Context(), turnKey{}, leave)))
		return next(c)
	}
}

// endTurn frees the place of ctx's request in its account's turns, if it
// holds one: its costly part is done.
func endTurn(ctx context.Context) {
	if leave, ok := ctx.Value(turnKey{}).(func()); ok {
		leave()
	}
}
