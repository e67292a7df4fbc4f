package store_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testcert"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/internal/testlisten"
	"github.com/rungworks/gateway/store"
)

// TestReconcileIsolatesAFailingAccount: one account whose counters cannot take
// its settlements (its day charge at the edge of bigint) does not stop the
// reconciliation of any other account (D11).
func TestReconcileIsolatesAFailingAccount(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, bad := b.key(t, "bad", gateway.TierDeveloper, gateway.ScopeInference)
	_, good := b.key(t, "good", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "bad", ptr(int64(math.MaxInt64)), nil)
	b.newBatch(t, bad, 1, 10, "", day())
	// Fault injection: the bad account's day is one rung short of overflowing.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE daily_charges SET charged_rungs = $1 WHERE account_id = $2`, int64(math.MaxInt64-1), bad.AccountID)
	require.NoError(t, err)
	owner := uuid.Must(uuid.NewV7())
	b.complete(t, owner, b.claim(t, owner, 10, time.Minute), 20) // folds +10 into a day at MaxInt64-1: overflow

	b.newBatch(t, good, 1, 100, "", day())
	b.complete(t, owner, b.claim(t, owner, 10, time.Minute), 40)

	names := &statementNames{}
	traced := b.traced(t, names)
	n, err := traced.ReconcileSettlements(b.ctx, 1000)
	require.Error(t, err, "the failing account is reported")
	require.Contains(t, err.Error(), bad.AccountID.String())
	require.Equal(t, int64(1), n, "the other account's settlement is folded")
	require.Equal(t, int64(40), b.view(t, good).Daily.Charged)

	// The failing account is set aside: later runs fold everyone else at once,
	// in one statement passing over it.
	b.newBatch(t, good, 1, 100, "", day())
	b.complete(t, owner, b.claim(t, owner, 10, time.Minute), 5)
	names.take()
	n, err = traced.ReconcileSettlements(b.ctx, 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, []string{"ReconcileSettlements"}, names.take())
	require.Equal(t, int64(45), b.view(t, good).Daily.Charged)
}

// TestFoldIsolatesAFailingLease: an expired quota lease whose project's spend
// cannot take it does not stop the other expired leases from coming back.
func TestFoldIsolatesAFailingLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, bad := b.key(t, "bad", gateway.TierDeveloper, gateway.ScopeInference)
	_, good := b.key(t, "good", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "good", nil, ptr(int64(1000)))
	badLease, goodLease := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	b.grant(t, bad, badLease, 10, 1<<30, -time.Second)
	b.grant(t, good, goodLease, 100, 1<<30, -time.Second)
	b.settle(t, bad, &badLease, 50)
	b.settle(t, good, &goodLease, 30)
	// Fault injection: the bad project's spend overflows when the fold adds 50.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE projects SET spent_rungs = $1 WHERE id = $2`, int64(math.MaxInt64-1), bad.ProjectID)
	require.NoError(t, err)

	names := &statementNames{}
	traced := b.traced(t, names)
	n, err := traced.FoldExpiredQuotaLeases(b.ctx, 100)
	require.Error(t, err)
	require.Contains(t, err.Error(), badLease.String())
	require.Equal(t, int64(1), n)
	v := b.view(t, good)
	require.Equal(t, int64(30), v.Daily.Charged)
	require.Equal(t, int64(30), v.Budget.Spent)
	require.Zero(t, v.Budget.Reserved)

	names.take()
	n, err = traced.FoldExpiredQuotaLeases(b.ctx, 100)
	require.NoError(t, err, "the failing lease is set aside")
	require.Zero(t, n)
	require.Equal(t, []string{"FoldQuotaLeases"}, names.take(), "in one statement passing over it")
}

// TestTransient tells the database being away from a statement it refused.
func TestTransient(t *testing.T) {
	t.Parallel()
	require.True(t, store.Transient(fmt.Errorf("error claiming batch items: %w", io.ErrUnexpectedEOF)), "a reply lost")
	require.True(t, store.Transient(&pgconn.ConnectError{}), "refused")
	require.False(t, store.Transient(errors.New("json: unsupported value")), "a bug is not an outage")
	require.True(t, store.Transient(&pgconn.PgError{Code: "57P01"}), "admin shutdown")
	require.True(t, store.Transient(&pgconn.PgError{Code: "08006"}), "connection failure")
	require.True(t, store.Transient(&pgconn.PgError{Code: "40001"}), "serialization failure")
	require.True(t, store.Transient(&pgconn.PgError{Code: "25006"}), "a write refused by a standby")
	require.True(t, store.Transient(&pgconn.PgError{Code: "25P03"}), "a session ended for its transaction's wait")
	require.True(t, store.Transient(&pgconn.PgError{Code: "58030"}), "an I/O error of the server's")
	require.False(t, store.Transient(&pgconn.PgError{Code: "XX001"}), "a corrupted page is some rows' fault")
	require.False(t, store.Transient(&pgconn.PgError{Code: "25001"}), "another invalid transaction state")
	require.False(t, store.Transient(&pgconn.PgError{Code: "22P05"}), "untranslatable character")
	require.False(t, store.Transient(&pgconn.PgError{Code: "22003"}), "numeric value out of range")
	require.True(t, store.Transient(&pgconn.PgError{Code: "53300"}), "too many connections")
	for _, code := range []string{"", "5"} {
		require.False(t, store.Transient(&pgconn.PgError{Code: code}), "an error without a whole code names no class: %q", code)
		require.False(t, store.Away(&pgconn.PgError{Code: code}), "an error without a whole code names no class: %q", code)
	}
	require.False(t, store.Transient(gateway.Errorf(gateway.EBatchNotFound, "x")))
	require.False(t, store.Transient(&gateway.Error{Code: gateway.EInferenceBusy, Cause: io.ErrUnexpectedEOF}),
		"a domain error is the gateway's answer, whatever it came of")
	require.False(t, store.Transient(nil))
	require.False(t, store.Transient(fmt.Errorf("error reading: %w", pgx.ErrNoRows)), "no row is an answer")
	require.True(t, store.Transient(&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}), "a connection reset")
	require.True(t, store.Transient(fmt.Errorf("error reading: %w", pgconn.ErrConnClosed)), "a connection closed")
	require.True(t, store.Transient(io.EOF), "a connection ended")
	require.True(t, store.Transient(unsent{errors.New("tls: internal error")}), "a write that sent nothing")
	require.True(t, store.Transient(fmt.Errorf("error waiting: %w", context.DeadlineExceeded)), "no answer within the deadline")
}

// TestAway: a replica's start waits for a database that is away, not for
// one that refuses the connection's settings (which a serving replica takes
// for an outage all the same).
func TestAway(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	connect := func(url string) error {
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			_ = conn.Close(ctx)
		}
		return err
	}
	refused := connect("postgres://gateway@127.0.0.1:1/none?connect_timeout=5")
	require.Error(t, refused)
	require.True(t, store.Away(refused), "nothing listens: %v", refused)
	u, err := url.Parse(testdb.EmptyURL(t))
	require.NoError(t, err)
	u.Path = "/no_such_database"
	missing := connect(u.String())
	require.Error(t, missing)
	require.False(t, store.Away(missing), "a database that does not exist: %v", missing)
	require.True(t, store.Transient(missing))

	certRefused := connect(requiringClientCertificates(t) + "/none?sslmode=require&connect_timeout=5")
	require.Error(t, certRefused)
	require.False(t, store.Away(certRefused), "a server that refuses the client's certificate (none): %v", certRefused)

	for _, c := range []struct {
		name string
		err  error
		away bool
	}{
		{"starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"shutting down", &pgconn.PgError{Code: "57P01"}, true},
		{"too many connections", &pgconn.PgError{Code: "53300"}, true},
		{"a connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"a password refused", &pgconn.PgError{Code: "28P01"}, false},
		{"a pooler that cannot keep a session's statements", &pgconn.PgError{Code: "42P05"}, false},
		{"a host name that does not resolve", &net.DNSError{Err: "no such host", Name: "db", IsNotFound: true}, false},
		{"a resolver away", &net.DNSError{Err: "server misbehaving", Name: "db", IsTemporary: true}, true},
		{"a connection reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{"a connection ended", io.EOF, true},
		{"no answer within the deadline", fmt.Errorf("error connecting: %w", context.DeadlineExceeded), true},
		{"a certificate that does not verify", errors.New("tls: failed to verify certificate: x509: certificate signed by unknown authority"), false},
		{"no error", nil, false},
	} {
		require.Equal(t, c.away, store.Away(c.err), c.name)
	}
}

// requiringClientCertificates returns the address (postgres://u@host:port)
// of a server that takes a client's request for TLS, as PostgreSQL does, and
// refuses its handshake without a client certificate, as PostgreSQL does
// with an authority of clients set (ssl_ca_file).
func requiringClientCertificates(t *testing.T) string {
	t.Helper()
	creds := testcert.NewAuthority(t, "server").Issue(t, "127.0.0.1", net.IPv4(127, 0, 0, 1))
	pair, err := tls.X509KeyPair(creds.Cert, creds.Key)
	require.NoError(t, err)
	return "postgres://gateway@" + testlisten.Serve(t, func(conn net.Conn) {
		sslRequest := make([]byte, 8)
		if _, err := io.ReadFull(conn, sslRequest); err != nil {
			return
		}
		if _, err := conn.Write([]byte("S")); err != nil {
			return
		}
		server := tls.Server(conn, &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAndVerifyClientCert})
		if server.Handshake() == nil {
			_, _ = io.Copy(io.Discard, server)
		}
	})
}

// unsent is an error that pgx would say sent nothing (a write that failed).
type unsent struct{ error }

func (unsent) SafeToRetry() bool { return true }

// TestACallCancelledBeforeItIsSentIsNotTransient: a statement whose context
// was cancelled before it was sent (which pgx says is safe to retry) is the
// caller's choice, not the database away, and it did not commit.
func TestACallCancelledBeforeItIsSentIsNotTransient(t *testing.T) {
	t.Parallel()
	b := setup(t)
	conn, err := b.store.Pool().Acquire(b.ctx)
	require.NoError(t, err)
	defer conn.Release()
	ctx, cancel := context.WithCancel(b.ctx)
	cancel()
	_, err = conn.Exec(ctx, "SELECT 1")
	require.ErrorIs(t, err, context.Canceled)
	require.True(t, pgconn.SafeToRetry(err), "pgx says nothing was sent")
	require.False(t, store.Transient(err))
	require.False(t, store.MayHaveCommitted(err))
}

// TestARefusedLoginIsTransient: a session the server refuses to open (here
// for a database that is not there; a password or client certificate a
// rotation left behind is refused alike) is the database away, not a fault
// of the statement's, and nothing of it was sent.
func TestARefusedLoginIsTransient(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig(testdb.URL(t))
	require.NoError(t, err)
	cfg.Database = "no_such_database"
	_, err = pgx.ConnectConfig(context.Background(), cfg)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "3D000", pgErr.Code, "the server answered")
	require.True(t, store.Transient(err), "%v", err)
	require.False(t, store.MayHaveCommitted(err))
}

// TestAReadOnlyDatabaseIsNotReady: a database that takes no writes (a
// standby a failover left a connection on; here one whose transactions are
// read-only) is not ready, and its refusal of a write is transient: the
// database away for a moment (503), not a fault of the gateway's (500).
func TestAReadOnlyDatabaseIsNotReady(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.NoError(t, b.store.Ready(b.ctx))
	readOnly := store.New(b.poolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	}))
	require.ErrorContains(t, readOnly.Ready(b.ctx), "takes no writes")
	_, err := readOnly.CreateKey(b.ctx, store.CreateKeyParams{Account: "acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
	require.Error(t, err)
	require.True(t, store.Transient(err), "%v", err)
}

// TestAConnectionToAStandbyIsDropped: a connection whose write the server
// refused as read-only (here every session of the database is made
// read-only, as one to a standby that a failover's address not yet moved
// leads to) is closed, not kept in the pool: once the address leads to a
// server that takes writes (here the setting is reset), the next write is
// made on a new connection and stored.
func TestAConnectionToAStandbyIsDropped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var database string
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, "SELECT current_database()").Scan(&database))
	admin, err := b.store.Pool().Acquire(b.ctx) // a session of before, which takes writes
	require.NoError(t, err)
	defer admin.Release()
	alter := "ALTER DATABASE " + pgx.Identifier{database}.Sanitize()
	_, err = admin.Exec(b.ctx, alter+" SET default_transaction_read_only = on")
	require.NoError(t, err)
	b.store.Pool().Reset() // the pool's sessions from now on are read-only (the admin's is kept)
	create := func() error {
		_, err := b.store.CreateKey(b.ctx, store.CreateKeyParams{Account: "acme", Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference}})
		return err
	}
	err = create()
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "25006", pgErr.Code)
	require.True(t, store.Transient(err))

	_, err = admin.Exec(b.ctx, alter+" RESET default_transaction_read_only")
	require.NoError(t, err)
	require.NoError(t, create(), "the write is made on a new connection, which takes writes")
}

// TestRetryEndsACallWithTheWindow: a call that a database that does not
// answer holds ends with the window.
func TestRetryEndsACallWithTheWindow(t *testing.T) {
	t.Parallel()
	calls := 0
	err := store.Retry(context.Background(), 50*time.Millisecond, time.Millisecond, func(ctx context.Context) error {
		calls++
		<-ctx.Done()
		return ctx.Err()
	})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, 1, calls)
}

// TestMayHaveCommitted: only a reply lost after the statement was sent leaves
// its outcome unknown.
func TestMayHaveCommitted(t *testing.T) {
	t.Parallel()
	require.True(t, store.MayHaveCommitted(fmt.Errorf("error claiming batch items: %w", io.ErrUnexpectedEOF)))
	require.True(t, store.MayHaveCommitted(context.Canceled), "cancelled while waiting for the reply")
	require.False(t, store.MayHaveCommitted(&pgconn.ConnectError{}), "never sent")
	require.False(t, store.MayHaveCommitted(&pgconn.PgError{Code: "57P01"}), "the server answered: rolled back")
	require.False(t, store.MayHaveCommitted(errors.New("json: unsupported value")))
	require.False(t, store.MayHaveCommitted(nil))
}

// TestCompleteItemsRefusesUnstorableOutput: an outcome PostgreSQL cannot hold
// fails its whole group with an error that is not transient, so the drainer
// splits the group instead of retrying it.
func TestCompleteItemsRefusesUnstorableOutput(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.newBatch(t, p, 2, 50, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 10, time.Minute)
	results := []store.ItemResult{
		{BatchID: items[0].BatchID, Index: items[0].Index, Status: "completed", Content: "fine", EvidenceExpiresAt: time.Now().Add(time.Hour)},
		{BatchID: items[1].BatchID, Index: items[1].Index, Status: "completed", Content: "a\x00b", EvidenceExpiresAt: time.Now().Add(time.Hour)},
	}
	_, err := b.store.CompleteItems(b.ctx, owner, results)
	require.Error(t, err)
	require.False(t, store.Transient(err))
	applied, err := b.store.CompleteItems(b.ctx, owner, results[:1])
	require.NoError(t, err)
	require.Len(t, applied, 1, "alone, the clean member commits")
}

// TestRenewLeasesOnlyForHeldItems: an item leased to a live replica that does
// not hold it (its claim's reply was lost) is not renewed; its lease runs out
// and the rescuer reports it INTERRUPTED (D12).
func TestRenewLeasesOnlyForHeldItems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 50, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 10, 100*time.Millisecond)
	require.Len(t, items, 2)
	n, err := b.store.RenewLeases(b.ctx, owner, keysOf(items[:1]), time.Minute)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	time.Sleep(150 * time.Millisecond)
	_, err = b.store.RescueExpiredLeases(b.ctx, 100)
	require.NoError(t, err)
	_, results := b.batch(t, p, id)
	require.Equal(t, gateway.ItemInProgress, results[items[0].Index].Status, "held and renewed")
	require.Equal(t, gateway.ItemFailed, results[items[1].Index].Status, "not held: rescued")
	require.Equal(t, gateway.EInterrupted, results[items[1].Index].Error.Code)
}

// TestReleaseClaim: the items of a claim whose reply was lost go back to the
// queue, unbilled; items of other claims stay where they are.
func TestReleaseClaim(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	b.newBatch(t, p, 3, 100, "", day())
	owner := uuid.Must(uuid.NewV7())
	lost, kept := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	lostItems, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: lost, Max: 2, PerAccount: 2, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, lostItems, 2)
	keptItems, err := b.store.ClaimItems(b.ctx, store.ClaimParams{Owner: owner, ClaimID: kept, Max: 1, PerAccount: 1, Lease: time.Minute})
	require.NoError(t, err)
	require.Len(t, keptItems, 1)
	require.Equal(t, int64(300), b.view(t, p).Budget.Reserved)

	r, err := b.store.ReleaseClaim(b.ctx, owner, lost)
	require.NoError(t, err)
	require.ElementsMatch(t, keysOf(lostItems), r.Queued)
	require.Empty(t, r.Cancelled)
	require.Equal(t, int64(100), b.view(t, p).Budget.Reserved, "their reservations are returned")
	r, err = b.store.ReleaseClaim(b.ctx, uuid.Must(uuid.NewV7()), kept)
	require.NoError(t, err)
	require.Empty(t, r.Queued, "another owner's claim is not touched")
	require.Len(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute), 2)
}

// TestCancelRacingARequeue: a batch cancelled while an item is claimed (its
// batch still queued) waits for it, and the item handed back ends cancelled,
// never queued again (D12).
func TestCancelRacingARequeue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", nil, ptr(int64(1000)))
	id := b.newBatch(t, p, 3, 100, "", day())
	owner := uuid.Must(uuid.NewV7())
	items := b.claim(t, owner, 1, time.Minute)
	require.Len(t, items, 1)

	require.NoError(t, b.store.CancelBatch(b.ctx, p.AccountID, id))
	batch, _ := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCancelling, batch.Status, "an item is out: no terminal batch with an item running")

	r, err := b.store.RequeueItems(b.ctx, owner, keysOf(items))
	require.NoError(t, err)
	require.Equal(t, store.Requeued{Cancelled: keysOf(items)}, r)
	require.NoError(t, b.store.FinishBatches(b.ctx, []uuid.UUID{id}))
	batch, results := b.batch(t, p, id)
	require.Equal(t, gateway.BatchCancelled, batch.Status)
	for _, it := range results {
		require.Equal(t, gateway.ItemCancelled, it.Status)
	}
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute))
	_, err = b.store.ReconcileSettlements(b.ctx, 1000)
	require.NoError(t, err)
	v := b.view(t, p)
	require.Zero(t, v.Daily.Charged, "nothing billed, every estimate given back")
	require.Zero(t, v.Budget.Reserved)
}

// TestClaimSkipsItemsOfCancellingBatches: a queued item of a batch that is
// cancelling or terminal is never claimed (D12).
func TestClaimSkipsItemsOfCancellingBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	id := b.newBatch(t, p, 2, 50, "", day())
	// Fault injection: a cancelling batch that still has a queued item.
	_, err := b.store.Pool().Exec(b.ctx, `UPDATE batches SET status = 'cancelling' WHERE id = $1`, id)
	require.NoError(t, err)
	require.Empty(t, b.claim(t, uuid.Must(uuid.NewV7()), 10, time.Minute))
}

// TestRefusalsWaitingCannotCure: an estimate larger than the whole daily
// ceiling or the whole budget cap is refused without Retry-After, saying what
// to change (D11); one that only does not fit now keeps Retry-After.
func TestRefusalsWaitingCannotCure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.limits(t, "acme", ptr(int64(100)), nil)
	var e *gateway.Error
	_, err := b.store.CreateBatch(b.ctx, b.batchOf(p, 3, 50, "", day()))
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Zero(t, e.RetryAfter, "a batch larger than the whole ceiling")
	require.Contains(t, e.Message, "max_output_rungs")

	b.newBatch(t, p, 1, 60, "", day())
	_, err = b.store.CreateBatch(b.ctx, b.batchOf(p, 1, 50, "", day()))
	require.ErrorAs(t, err, &e)
	require.Equal(t, gateway.ERateLimited, e.Code)
	require.Positive(t, e.RetryAfter, "the day resets: waiting helps")
}

// TestUsageFoldIsolatesAFailingAccount: an account whose sums by minute
// cannot be folded does not stop the other accounts' from being folded.
func TestUsageFoldIsolatesAFailingAccount(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, bad := b.key(t, "bad", gateway.TierDeveloper, gateway.ScopeInference)
	_, good := b.key(t, "good", gateway.TierDeveloper, gateway.ScopeInference)
	past := time.Now().UTC().Truncate(time.Minute).Add(-10 * time.Minute)
	settle := func(p *gateway.Principal, total int64) {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, past, gateway.ModelInstant, total)}}))
	}
	settle(bad, 5)
	_, err := b.store.FoldUsageMinutes(b.ctx, time.Now(), 1000)
	require.NoError(t, err)
	// Fault injection: the bad account's folded minute is one rung short of
	// overflowing.
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE usage_minutes SET total_rungs = $1 WHERE account_id = $2`, int64(math.MaxInt64-1), bad.AccountID)
	require.NoError(t, err)
	settle(bad, 10)
	settle(good, 20)
	settle(good, 30)

	n, err := b.store.FoldUsageMinutes(b.ctx, time.Now(), 1000)
	require.Error(t, err, "the failing account is reported")
	require.Contains(t, err.Error(), bad.AccountID.String())
	require.Positive(t, n)
	unfolded := func(p *gateway.Principal) (rows int) {
		err := b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM usage_minutes WHERE account_id = $1 AND backend <> 0`, p.AccountID).Scan(&rows)
		require.NoError(t, err)
		return rows
	}
	require.Zero(t, unfolded(good), "the other account's rows are folded")
	require.Equal(t, 1, unfolded(bad))
	// Over the hours around past, which in the first minutes of a UTC day
	// is in the day before (b.view shows today).
	view := func(p *gateway.Principal) *gateway.UsageView {
		v, err := b.store.Usage(b.ctx, p, past.Add(-time.Hour), time.Now().Add(time.Hour))
		require.NoError(t, err)
		return v
	}
	v := view(good)
	require.Equal(t, int64(50), v.Totals.TotalRungs)
	require.Equal(t, int64(2), v.Totals.Requests)

	// The failing account is set aside: later runs fold everyone else at once.
	settle(good, 7)
	n, err = b.store.FoldUsageMinutes(b.ctx, time.Now(), 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, 1, unfolded(bad))
	require.Equal(t, int64(57), view(good).Totals.TotalRungs)
}

// TestRequestFoldIsolatesAFailingAccount: an account whose old requests
// cannot be folded into their day's sums does not stop the other accounts'
// from being folded, and is set aside while the others go on.
func TestRequestFoldIsolatesAFailingAccount(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, bad := b.key(t, "bad", gateway.TierDeveloper, gateway.ScopeInference)
	_, good := b.key(t, "good", gateway.TierDeveloper, gateway.ScopeInference)
	horizon := time.Now().Add(-90 * 24 * time.Hour)
	old := horizon.Add(-time.Hour)
	settle := func(p *gateway.Principal, total int64) {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, old, gateway.ModelInstant, total)}}))
	}
	settle(bad, 5)
	n, err := b.store.FoldOldUsage(b.ctx, horizon, 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	// Fault injection: the bad account's day is one rung short of
	// overflowing.
	_, err = b.store.Pool().Exec(b.ctx, `UPDATE usage_days SET total_rungs = $1 WHERE account_id = $2`, int64(math.MaxInt64-1), bad.AccountID)
	require.NoError(t, err)
	settle(bad, 10)
	settle(good, 20)
	settle(good, 30)

	n, err = b.store.FoldOldUsage(b.ctx, horizon, 1000)
	require.Error(t, err, "the failing account is reported")
	require.Contains(t, err.Error(), bad.AccountID.String())
	require.Equal(t, int64(2), n, "the other account's requests are folded")
	kept := func(p *gateway.Principal) (rows int) {
		err := b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM requests WHERE account_id = $1`, p.AccountID).Scan(&rows)
		require.NoError(t, err)
		return rows
	}
	require.Zero(t, kept(good))
	require.Equal(t, 1, kept(bad), "the failing request stays, to be folded once mended")
	day := gateway.UTCDay(old)
	lines, err := b.store.UsageReport(b.ctx, day, day.AddDate(0, 0, 1), "good")
	require.NoError(t, err)
	require.Len(t, lines, 1)
	require.Equal(t, int64(50), lines[0].TotalRungs)

	// The failing account is set aside: later runs fold everyone else at once.
	settle(good, 7)
	n, err = b.store.FoldOldUsage(b.ctx, horizon, 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, 1, kept(bad))
}
