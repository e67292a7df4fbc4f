package store

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway/gen/db"
	"github.com/rungworks/gateway/internal/lostpeer"
)

// IdleTransactionTimeout is how long the server lets a transaction of the
// gateway's wait for its next statement before it ends the session
// (idle_in_transaction_session_timeout), unless the database URL sets it.
// The gateway sends a transaction's statements one after the other, so only
// a transaction whose client was lost waits that long: one the network lost
// without closing its connection (a NAT or firewall that forgot it, an
// address a failover moved) would otherwise hold its row locks for as long
// as the server's kernel keeps the connection (two hours and more by
// default), and every replica's statement on those rows would wait for it.
const IdleTransactionTimeout = 10 * time.Second

// PingTimeout bounds the probe of a connection taken from the pool after a
// second or more idle (pgxpool's, unless the database URL sets
// pool_ping_timeout): one that has not answered within it is dropped and
// another taken. A healthy server answers at once; after a network failure
// that left the pool's connections open but lost, each taker would
// otherwise spend its whole deadline on the first it drew.
const PingTimeout = time.Second

// Connect returns a pool on url whose connections encode uuid.UUID
// directly (see RegisterUUID), whose idle connections are probed within
// PingTimeout when taken, whose connections find a server the network lost
// as lostpeer says, and whose sessions the server ends when their
// client is lost: a transaction idle past IdleTransactionTimeout, and a
// connection the network lost, found as the gateway's own connections find
// a lost peer (tcp_keepalives_idle, _interval and _count and
// tcp_user_timeout, as package lostpeer sets them), some 25 s after it went
// silent or stopped acknowledging, not after the two hours and more (15
// minutes with a reply in flight) of the kernel's defaults: lost sessions,
// each network failure's worth of them, would pile up against
// max_connections until the database refused new ones. The database URL's
// own settings are kept. A connection whose write the server refuses as
// read-only (one on a standby) is closed rather than kept. Each new
// connection reads the URL's files again (see rereader). Its sessions are
// named name (application_name, as pg_stat_activity and the server's log
// show them) unless the URL or PGAPPNAME names them. maxConns, when
// positive, caps the pool.
func Connect(ctx context.Context, url, name string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := poolConfig(url, name, maxConns)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("error connecting to PostgreSQL: %w", err)
	}
	return pool, nil
}

// poolConfig is the configuration of Connect's pool.
func poolConfig(url, name string, maxConns int32) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("error parsing database URL: %w", err)
	}
	if _, named := cfg.ConnConfig.RuntimeParams["application_name"]; !named {
		cfg.ConnConfig.RuntimeParams["application_name"] = name
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	if cfg.PingTimeout == 0 {
		cfg.PingTimeout = PingTimeout
	}
	// The gateway's end finds a lost server as the server finds a lost
	// gateway (below): a wait without a deadline of its own (the
	// migrations at start, a command's statements) fails some 25 s after
	// the loss, where pgx's dialer (keepalives after 5 minutes, 9 of them
	// 5 minutes apart) left it waiting close to an hour. Every other wait
	// has a shorter bound of its own.
	cfg.ConnConfig.DialFunc = lostpeer.Dialer(0).DialContext
	// A connection whose write the server refused as read-only is closed
	// (as pgx's own handler closes one whose session a FATAL error ended)
	// rather than kept in the pool: it is on a standby,
	// where a failover's address not yet moved led it, and the connection
	// made in its place goes where the address leads now, the new primary
	// once the failover is done. Kept, it would go on refusing writes
	// until replaced otherwise (the listeners, while they cannot listen
	// there, take and close a pool connection each a second).
	keep := cfg.ConnConfig.OnPgError
	cfg.ConnConfig.OnPgError = func(conn *pgconn.PgConn, pgErr *pgconn.PgError) bool {
		return pgErr.Code != readOnlyTransaction && (keep == nil || keep(conn, pgErr))
	}
	files := &rereader{url: url}
	files.last.Store(cfg.ConnConfig)
	cfg.BeforeConnect = files.beforeConnect
	// The URL's settings, sent when the session started, are kept.
	setting := func(name, value string) string { return cmp.Or(cfg.ConnConfig.RuntimeParams[name], value) }
	bounds := db.BoundLostSessionsParams{
		IdleInTransaction:  setting("idle_in_transaction_session_timeout", milliseconds(IdleTransactionTimeout)),
		KeepalivesIdle:     setting("tcp_keepalives_idle", seconds(lostpeer.KeepAlive.Idle)),
		KeepalivesInterval: setting("tcp_keepalives_interval", seconds(lostpeer.KeepAlive.Interval)),
		KeepalivesCount:    setting("tcp_keepalives_count", strconv.Itoa(lostpeer.KeepAlive.Count)),
		UserTimeout:        setting("tcp_user_timeout", milliseconds(lostpeer.UserTimeout)),
	}
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		RegisterUUID(conn.TypeMap())
		if err := db.New().BoundLostSessions(ctx, conn, bounds); err != nil {
			return fmt.Errorf("error bounding what a lost session holds: %w%s", err, sharedSessionHint(err))
		}
		return nil
	}
	return cfg, nil
}

// rereader gives each new connection what the files of the database URL
// hold now, as libpq reads them for each connection: the password of a
// passfile (when neither the URL nor PGPASSWORD gives one) and the
// authorities of sslrootcert. pgx reads them once, when it parses the URL
// (the client certificate's files it reads for each connection itself), so
// a password or an authority rotated under a running replica would refuse
// its logins until it restarted. What pgx chooses from them (the passfile's
// entry for the URL's first host, as it does) is its own: the URL is parsed
// again and only those values are taken. A file missing or empty while a
// rotation replaces it leaves what was read last: the authorities when the
// URL cannot be parsed, the password when none is found (a server that
// does not ask for one is not sent one).
type rereader struct {
	url  string
	last atomic.Pointer[pgx.ConnConfig] // what was read last
}

// beforeConnect is pgxpool's BeforeConnect: c is a copy of the pool's
// configuration, for one new connection.
func (r *rereader) beforeConnect(_ context.Context, c *pgx.ConnConfig) error {
	now, err := pgx.ParseConfig(r.url)
	if err != nil || len(now.Fallbacks) != len(c.Fallbacks) {
		now = r.last.Load()
	} else {
		if now.Password == "" {
			now.Password = r.last.Load().Password
		}
		r.last.Store(now)
	}
	c.Password = now.Password
	trust(c.TLSConfig, now.TLSConfig)
	for i, fallback := range c.Fallbacks {
		trust(fallback.TLSConfig, now.Fallbacks[i].TLSConfig)
	}
	return nil
}

// trust gives c the authorities of now and the check of the server's
// certificate that uses them (sslmode=verify-ca's), in place: the client
// certificate pgx reads for each connection is bound to c itself.
func trust(c, now *tls.Config) {
	if c == nil || now == nil {
		return
	}
	c.RootCAs, c.ClientCAs, c.VerifyPeerCertificate = now.RootCAs, now.ClientCAs, now.VerifyPeerCertificate
}

// sharedSessionHint names the likely cause of err, when it says that a new
// connection's session was not its own: a statement pgx prepared in it and
// named after its text (stmtcache_…) already there, or gone. Another client
// prepared it, or the statement was prepared in another session: the
// database URL leads to a pooler that shares its server sessions among its
// clients between transactions (PgBouncer's pool_mode=transaction, a hosted
// database's "transaction" pooler), where the gateway needs sessions of its
// own (prepared statements, LISTEN, advisory locks and settings are the
// session's). Through such a pooler, a connection opened after another one
// fails there, at its first statement.
func sharedSessionHint(err error) string {
	const (
		duplicatePreparedStatement = "42P05"
		undefinedPreparedStatement = "26000" // invalid_sql_statement_name
	)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != duplicatePreparedStatement && pgErr.Code != undefinedPreparedStatement) ||
		!strings.Contains(pgErr.Message, `"stmtcache_`) {
		return ""
	}
	return " (the database URL seems to lead to a connection pooler that pools by transaction, sharing its sessions " +
		"among its clients: the gateway needs sessions of its own, from a pooler that pools by session or from the database itself)"
}

// RegisterUUID teaches m to send uuid.UUID as PostgreSQL's binary uuid.
// Without it pgx reaches uuid.UUID only as a driver.Valuer: every value is
// formatted as text, refused by the binary encoder (an error built with
// fmt.Errorf), parsed back and encoded, which showed up as a tenth of the
// gateway's CPU while draining batches (eight uuids per item created). Reads
// are left to uuid.UUID's sql.Scanner, which pgx prefers to any wrapper.
func RegisterUUID(m *pgtype.Map) {
	m.TryWrapEncodePlanFuncs = append([]pgtype.TryWrapEncodePlanFunc{wrapUUIDEncode}, m.TryWrapEncodePlanFuncs...)
}

// pgUUID is uuid.UUID with the method pgx's uuid codec encodes from.
type pgUUID uuid.UUID

// UUIDValue implements pgtype.UUIDValuer.
func (u pgUUID) UUIDValue() (pgtype.UUID, error) {
	return pgtype.UUID{Bytes: u, Valid: true}, nil
}

func wrapUUIDEncode(value any) (pgtype.WrappedEncodePlanNextSetter, any, bool) {
	if u, ok := value.(uuid.UUID); ok {
		return &uuidEncodePlan{}, pgUUID(u), true
	}
	return nil, nil, false
}

type uuidEncodePlan struct{ next pgtype.EncodePlan }

func (p *uuidEncodePlan) SetNext(next pgtype.EncodePlan) { p.next = next }

func (p *uuidEncodePlan) Encode(value any, buf []byte) ([]byte, error) {
	return p.next.Encode(pgUUID(value.(uuid.UUID)), buf)
}

// milliseconds formats d as a setting's value in milliseconds.
func milliseconds(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// seconds formats d as a setting's value in seconds.
func seconds(d time.Duration) string { return strconv.FormatInt(int64(d/time.Second), 10) }
