package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/retry"
)

// Transient reports whether err means the database did not answer (connection
// refused or lost, server shutting down or overloaded, a serialization failure
// or deadlock, a write refused by a standby while a failover settles, a
// session ended for its transaction's wait, an I/O error of the server's) or
// could not be used (a session that could not be opened, the server's
// refusal of the login included: a password or client certificate that a
// rotation left behind, a database not there yet): the same work may succeed
// later. An error the server answered with for this statement and its data
// (a constraint, a bad value, an overflow, a corrupted page) is not
// transient: retrying it fails the same way. Anything else (an encoding
// bug, a closed pool) is not transient either.
func Transient(err error) bool {
	const idleInTransaction = "25P03" // the server ended a session whose transaction waited too long (see IdleTransactionTimeout)
	var pgErr *pgconn.PgError
	var domain *gateway.Error
	var connectErr *pgconn.ConnectError
	switch {
	case err == nil, errors.Is(err, context.Canceled), errors.As(err, &domain):
		return false
	case errors.As(err, &connectErr): // whatever the server answered, no statement was run
		return true
	case errors.As(err, &pgErr):
		if pgErr.Code == readOnlyTransaction || pgErr.Code == idleInTransaction {
			return true
		}
		switch sqlstateClass(pgErr.Code) {
		case "08", // connection exception
			"40", // serialization failure, deadlock
			"53", // insufficient resources (too many connections, disk full)
			"57", // operator intervention (shutdown, crash, cannot connect now, statement timeout)
			"58": // the server's system failing under it (an I/O error): no row's fault
			return true
		}
		return false
	}
	// Not a reply of the server: did the connection or a deadline fail?
	return pgconn.SafeToRetry(err) || errors.Is(err, pgconn.ErrConnClosed) || connectionFailed(err)
}

// connectionFailed reports whether err is a connection's failure or a
// deadline's, not a reply of the server: pgx's timeouts wrap a deadline, or
// a net.Error, or a cancel.
func connectionFailed(err error) bool {
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		errors.Is(err, context.DeadlineExceeded)
}

// sqlstateClass is the class of a SQLSTATE code, its first two characters,
// or "" when the code is too short to have one: a server (or a pooler in
// front of it) that sent an error without its code is answered as one
// whose code names no class, not with a panic.
func sqlstateClass(code string) string {
	if len(code) < 2 {
		return ""
	}
	return code[:2]
}

// Away reports whether err means the database is not there to take work
// yet: not listening (refused, reset, timed out), starting up, shutting down
// or restarting, out of connections. A replica's start waits for such a
// database. Unlike Transient, the server's refusal of the connection's login
// or database name, a server certificate that does not verify, a client
// certificate the server refuses in the handshake (its TLS alert), a host
// name that does not resolve, and whatever a session said once opened (a
// pooler that cannot keep sessions) are not: they are the configuration's
// to mend.
func Away(err error) bool {
	var pgErr *pgconn.PgError
	var dnsErr *net.DNSError
	var opErr *net.OpError
	switch {
	case errors.As(err, &pgErr):
		switch sqlstateClass(pgErr.Code) {
		case "08", // connection exception
			"53", // insufficient resources (too many connections)
			"57": // operator intervention (starting up, shutting down, cannot connect now)
			return true
		}
		return false
	case errors.As(err, &dnsErr):
		return !dnsErr.IsNotFound
	case errors.As(err, &opErr) && opErr.Op == tlsAlert:
		return false
	}
	return connectionFailed(err)
}

// tlsAlert is the operation of crypto/tls's error for an alert the peer
// sent (a refused certificate, say).
const tlsAlert = "remote error"

// MayHaveCommitted reports whether a statement that failed with err may still
// have committed: its reply was lost (the connection broke or timed out after
// the statement was sent). Not when nothing was sent (the connection could not
// be made) or when the server answered with an error (it rolled back).
func MayHaveCommitted(err error) bool {
	var pgErr *pgconn.PgError
	var connectErr *pgconn.ConnectError
	switch {
	case err == nil, errors.As(err, &pgErr), errors.As(err, &connectErr), pgconn.SafeToRetry(err):
		return false
	}
	return Transient(err) || errors.Is(err, context.Canceled)
}

// readOnlyTransaction is a write's refusal by a server that takes none: a
// standby, as a failover may leave a connection on one, or a database set
// read-only.
const readOnlyTransaction = "25006"

// notSent is the error of an operation that ended before it sent anything to
// the database: transient, and certainly not committed (pgconn.SafeToRetry,
// which Transient and MayHaveCommitted consult, says so).
type notSent struct{ error }

func (e notSent) Unwrap() error { return e.error }

// SafeToRetry says that nothing was sent.
func (notSent) SafeToRetry() bool { return true }

// Retry calls fn until it succeeds, fails for a reason other than the
// database being away (see Transient), ctx ends, or window has passed,
// waiting between calls from 100 ms, doubled each time up to maxBackoff. It
// returns fn's last error. A call ends with the window at the latest (its
// context does): one that a database that does not answer holds fails then,
// instead of holding the caller for as long as the database does not answer.
func Retry(ctx context.Context, window, maxBackoff time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, window)
	defer cancel()
	return retry.Until(ctx, window, maxBackoff, Transient, fn)
}

// quarantinePeriod is how long a member whose rows fail a group operation is
// left out of it before it is tried again.
const quarantinePeriod = time.Minute

// quarantine is the set of members (accounts) a group operation sets aside
// because their rows fail it, so that they stop no one else (D11).
type quarantine struct {
	mu    sync.Mutex
	until map[uuid.UUID]time.Time
}

func (q *quarantine) add(id uuid.UUID) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.until == nil {
		q.until = map[uuid.UUID]time.Time{}
	}
	q.until[id] = time.Now().Add(quarantinePeriod)
}

// isolated runs a group operation, run, over every member not set aside
// (accounts, or leases: kind names them in errors), and, when it fails for a
// reason other than the database being away, over each member list names
// alone (see each): one member's rows never stop the others' (D11). what
// names the operation in errors ("reconciling settlements").
func (q *quarantine) isolated(what, kind string, run func(skip []uuid.UUID, member *uuid.UUID) (int64, error), list func(skip []uuid.UUID) ([]uuid.UUID, error)) (int64, error) {
	skip := q.members()
	n, err := run(skip, nil)
	if err == nil || Transient(err) {
		if err != nil {
			return 0, fmt.Errorf("error %s: %w", what, err)
		}
		return n, nil
	}
	members, lerr := list(skip)
	if lerr != nil {
		return 0, fmt.Errorf("error %s: %w (listing %ss: %v)", what, err, kind, lerr)
	}
	return q.each(members, "error "+what+" of "+kind, func(m uuid.UUID) (int64, error) {
		return run(skip, &m)
	})
}

// each runs fn for every member alone, after a group operation failed for its
// data: a member that fails for its own rows is set aside (one the database
// was away for is not), and named in the joined error as the kind of what it
// is; the others go on. It returns the sum of what fn counted.
func (q *quarantine) each(members []uuid.UUID, what string, fn func(uuid.UUID) (int64, error)) (int64, error) {
	var n int64
	var failures []error
	for _, m := range members {
		c, err := fn(m)
		switch {
		case err == nil:
			n += c
		case Transient(err):
			failures = append(failures, fmt.Errorf("%s %s: %w", what, m, err))
		default:
			q.add(m)
			failures = append(failures, fmt.Errorf("%s %s (set aside for %s): %w", what, m, quarantinePeriod, err))
		}
	}
	return n, errors.Join(failures...)
}

// members returns the members still set aside, never nil.
func (q *quarantine) members() []uuid.UUID {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := []uuid.UUID{}
	for id, until := range q.until {
		if time.Now().After(until) {
			delete(q.until, id)
			continue
		}
		out = append(out, id)
	}
	return out
}
