//go:build unix

package stopsignal_test

import (
	"context"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/stopsignal"
)

// TestTheSecondSignalHurries: the first interrupt or termination ends the
// context, the second ends Hurried's, also for a context derived from it.
// Not parallel: the signals it sends are the whole test process's (the
// parallel tests wait until it has ended).
func TestTheSecondSignalHurries(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			ctx, release := stopsignal.Notify(context.Background())
			defer release()
			derived := context.WithoutCancel(ctx)
			hurried := stopsignal.Hurried(derived).Done()
			require.NotNil(t, hurried)
			require.NoError(t, ctx.Err())

			require.NoError(t, syscall.Kill(os.Getpid(), sig))
			require.Eventually(t, func() bool { return ctx.Err() != nil }, 10*time.Second, time.Millisecond, "asked to stop")
			select {
			case <-hurried:
				t.Fatal("hurried by the first signal")
			case <-time.After(100 * time.Millisecond):
			}

			require.NoError(t, syscall.Kill(os.Getpid(), sig))
			select {
			case <-hurried:
			case <-time.After(10 * time.Second):
				t.Fatal("not hurried by the second signal")
			}
		})
	}
}

// TestReleaseEndsTheContext: release ends the context, without hurrying it,
// and may be called again.
func TestReleaseEndsTheContext(t *testing.T) {
	t.Parallel()
	ctx, release := stopsignal.Notify(context.Background())
	release()
	require.ErrorIs(t, ctx.Err(), context.Canceled)
	release()
	select {
	case <-stopsignal.Hurried(ctx).Done():
		t.Fatal("hurried by the release")
	default:
	}
}

// TestHurriedOfAnotherContextIsNever: a context not from Notify is never
// hurried.
func TestHurriedOfAnotherContextIsNever(t *testing.T) {
	t.Parallel()
	require.Nil(t, stopsignal.Hurried(context.Background()).Done())
}
