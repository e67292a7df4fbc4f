// Package retry calls an operation again while it fails for a passing reason
// (the database away for a moment), with doubling waits, within a window.
package retry

import (
	"context"
	"time"
)

// firstWait is the wait after the first failure.
const firstWait = 100 * time.Millisecond

// Until calls fn until it succeeds, fails with an error passing does not
// report, ctx ends, or window has passed, waiting between calls from 100 ms,
// doubled each time up to maxWait. It returns fn's last error.
func Until(ctx context.Context, window, maxWait time.Duration, passing func(error) bool, fn func(context.Context) error) error {
	return UntilTelling(ctx, window, maxWait, passing, nil, fn)
}

// UntilTelling is Until, calling waiting (when not nil) before each wait
// with fn's error and the wait's length: after each failure tried again,
// not after the last one.
func UntilTelling(ctx context.Context, window, maxWait time.Duration, passing func(error) bool, waiting func(err error, wait time.Duration), fn func(context.Context) error) error {
	deadline := time.Now().Add(window)
	for wait := firstWait; ; wait = min(2*wait, maxWait) {
		err := fn(ctx)
		if err == nil || !passing(err) || ctx.Err() != nil || time.Now().Add(wait).After(deadline) {
			return err
		}
		if waiting != nil {
			waiting(err, wait)
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}

// Counted returns fn calling retried (when not nil) before each of its calls
// but the first: once for each time Until tries fn again.
func Counted(retried func(), fn func(context.Context) error) func(context.Context) error {
	if retried == nil {
		return fn
	}
	first := true
	return func(ctx context.Context) error {
		if !first {
			retried()
		}
		first = false
		return fn(ctx)
	}
}
