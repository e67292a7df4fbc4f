package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// cutWithin bounds how long a test waits for the gateway to notice a
// connection the network lost: several times the bounds that should notice
// it, far less than the hours a kernel keeps such a connection.
const cutWithin = 30 * time.Second

// behindProxy is a store on the test's database whose connections pass
// through a proxy the test can cut (see testdb.Cuttable).
func (b *testBundle) behindProxy(t *testing.T) (*store.Store, *tcpproxy.Proxy) {
	t.Helper()
	pool, p := testdb.Cuttable(t, b.store.Pool().Config().ConnString())
	return store.New(pool), p
}

// TestAListenerTheNetworkLostListensAnew: a listening connection that the
// network lost, without closing it, is noticed (it answers no probe) and its
// listener returns, to listen anew on another connection, which hears the
// changes made since; without the probe it would wait on, deaf, for hours.
// The pool's idle connections, lost with it, are replaced.
func TestAListenerTheNetworkLostListensAnew(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		listen func(ctx context.Context, st *store.Store, listening func(), heard func()) error
		change func(t *testing.T, b *testBundle)
	}{
		"principals": {
			listen: func(ctx context.Context, st *store.Store, listening func(), heard func()) error {
				return st.ListenPrincipals(ctx, listening, func(string, uuid.UUID) { heard() })
			},
			change: func(t *testing.T, b *testBundle) {
				_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
				require.NoError(t, b.store.RevokeKey(b.ctx, p.KeyID.String()))
			},
		},
		"batches": {
			listen: func(ctx context.Context, st *store.Store, listening func(), heard func()) error {
				return st.ListenBatches(ctx, listening, heard, func(uuid.UUID) { heard() })
			},
			change: func(t *testing.T, b *testBundle) {
				_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
				b.newBatch(t, p, 1, 50, "", day())
			},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			st, proxy := b.behindProxy(t)
			ctx, cancel := context.WithCancel(b.ctx)
			t.Cleanup(cancel)
			listening := make(chan struct{}, 2)
			heard := make(chan struct{}, 10)
			listen := func() chan error {
				done := make(chan error, 1)
				go func() {
					done <- tc.listen(ctx, st, func() { listening <- struct{}{} }, func() { heard <- struct{}{} })
				}()
				return done
			}
			// Two connections: the listener takes one, the other stays idle.
			c1, err := st.Pool().Acquire(b.ctx)
			require.NoError(t, err)
			c2, err := st.Pool().Acquire(b.ctx)
			require.NoError(t, err)
			c1.Release()
			c2.Release()
			first := listen()
			<-listening
			require.Equal(t, 2, proxy.Cut())
			select {
			case err := <-first:
				require.ErrorContains(t, err, "probing the listening connection")
			case <-time.After(cutWithin):
				require.FailNow(t, "the listener on the lost connection did not return")
			}
			require.Zero(t, st.Pool().Stat().IdleConns(), "the pool's connections, lost with the listener's, are replaced")

			second := listen()
			<-listening
			tc.change(t, b)
			select {
			case <-heard:
			case <-time.After(cutWithin):
				require.FailNow(t, "the listener on a new connection heard nothing")
			}
			cancel()
			require.ErrorIs(t, <-second, context.Canceled)
		})
	}
}

// TestAnIdleConnectionTheNetworkLostIsReplaced: a connection idle in the pool
// that the network lost is probed when taken, dropped within
// store.PingTimeout, and another made: the statement runs, where it would
// have waited for its deadline on the lost connection.
func TestAnIdleConnectionTheNetworkLostIsReplaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st, proxy := b.behindProxy(t)
	require.NoError(t, st.Ready(b.ctx))
	time.Sleep(1100 * time.Millisecond) // pgxpool probes a connection idle for a second or more
	require.Equal(t, 1, proxy.Cut())
	ctx, cancel := context.WithTimeout(b.ctx, 5*store.PingTimeout)
	defer cancel()
	require.NoError(t, st.Ready(ctx))
}

// TestATransactionTheNetworkLostReleasesItsLocks: a transaction whose
// connection the network lost while it held a row lock is ended by the
// server (IdleTransactionTimeout), and a statement on that row from another
// connection goes on; without the bound it would wait for as long as the
// server kept the lost connection.
func TestATransactionTheNetworkLostReleasesItsLocks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	st, proxy := b.behindProxy(t)
	tx, err := st.Pool().Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() {
		lost, cancel := context.WithCancel(b.ctx)
		cancel() // the connection answers nothing: it is dropped, not waited on
		_ = tx.Rollback(lost)
	})
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM accounts WHERE id = $1 FOR UPDATE`, p.AccountID)
	require.NoError(t, err)
	require.Equal(t, 1, proxy.Cut())

	ctx, cancel := context.WithTimeout(b.ctx, cutWithin)
	defer cancel()
	_, err = b.store.Pool().Exec(ctx, `UPDATE accounts SET name = name WHERE id = $1`, p.AccountID)
	require.NoError(t, err, "the lost transaction's lock is released")
}

// TestAJobLockTheNetworkLostIsReleased: a maintenance job's lock whose
// connection the network lost is released by the server once the run's
// deadline and the release's bound have passed, and another replica runs
// the job; a session's lock would have been held for as long as the server
// kept the lost connection.
func TestAJobLockTheNetworkLostIsReleased(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st, proxy := b.behindProxy(t)
	ctx, cancel := context.WithTimeout(b.ctx, time.Second)
	defer cancel()
	ran, err := st.WithJobLock(ctx, "sweep", func() (int, error) {
		require.Equal(t, 1, proxy.Cut())
		return 0, nil
	})
	require.NoError(t, err)
	require.True(t, ran)

	ran, err = b.store.WithJobLock(b.ctx, "sweep", idle)
	require.NoError(t, err)
	require.False(t, ran, "the lost lock is held until its bound")
	require.Eventually(t, func() bool {
		ran, err := b.store.WithJobLock(b.ctx, "sweep", idle)
		require.NoError(t, err)
		return ran
	}, cutWithin, 100*time.Millisecond, "another replica runs the job")
}
