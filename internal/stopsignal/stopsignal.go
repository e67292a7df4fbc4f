// Package stopsignal tells a process's commands that they are asked to stop,
// by the first interrupt (Ctrl-C) or termination (SIGTERM), and asked again,
// by the second: a server lets its work finish for a grace period after the
// first, and cuts it short at the second.
package stopsignal

import (
	"context"
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// hurriedKey is the context key of the context Hurried returns.
type hurriedKey struct{}

// Notify returns a context, derived from parent, that ends at the process's
// first interrupt or termination, and from which Hurried tells of the second.
// release stops listening for them and ends the context.
func Notify(parent context.Context) (ctx context.Context, release func()) {
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	hurried, hurry := context.WithCancel(context.WithoutCancel(parent))
	ctx, cancel := context.WithCancel(context.WithValue(parent, hurriedKey{}, hurried))
	released := make(chan struct{})
	go func() {
		for _, asked := range []context.CancelFunc{cancel, hurry} {
			select {
			case <-signals:
				asked()
			case <-released:
				return
			}
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			signal.Stop(signals)
			close(released)
			cancel()
		})
	}
}

// Hurried returns a context that ends once the process has been asked to
// stop a second time; for a ctx that does not come from Notify, one that
// never ends. It outlives ctx's end, as what is derived from ctx does: a
// stop's grace derived from it ends at the second signal.
func Hurried(ctx context.Context) context.Context {
	if hurried, ok := ctx.Value(hurriedKey{}).(context.Context); ok {
		return hurried
	}
	return context.Background()
}
