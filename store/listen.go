package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A listening connection proves itself alive: one that has heard nothing for
// listenIdle is asked for a reply, which must come within listenProbeTimeout.
// A connection the network lost without closing it (a NAT or firewall that
// forgot it, an address a failover moved) delivers no notification and
// reports no error: without the probe its listener would wait on, deaf, for
// as long as the kernel keeps the connection (hours), and a replica would
// serve revoked keys from its cache. With it, a listener learns within
// listenIdle + listenProbeTimeout that it no longer hears, the pool's other
// connections (most likely lost with it) are replaced, and its caller
// listens anew on another connection. The probe is one empty statement a
// second per listener.
const (
	listenIdle         = time.Second
	listenProbeTimeout = 2 * time.Second
	// listenSetupTimeout bounds the connection's acquisition and its LISTEN
	// statements.
	listenSetupTimeout = 5 * time.Second
)

// listen runs the LISTEN statements of setup on a connection of its own,
// calls listening once they have run, then notified with each notification
// until ctx ends or the connection fails or stops answering (see
// listenIdle). The connection, which still listens, is closed rather than
// returned to the pool.
func (s *Store) listen(ctx context.Context, setup func(context.Context, *pgxpool.Conn) error, listening func(), notified func(*pgconn.Notification)) error {
	sctx, cancel := context.WithTimeout(ctx, listenSetupTimeout)
	defer cancel()
	conn, err := s.pool.Acquire(sctx)
	if err != nil {
		return fmt.Errorf("error acquiring listen connection: %w", err)
	}
	defer conn.Release()
	defer func() {
		// Bounded: a close waits for the server's, which a lost
		// connection never sends.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), listenProbeTimeout)
		defer cancel()
		_ = conn.Conn().Close(cctx)
	}()
	if err := setup(sctx, conn); err != nil {
		return fmt.Errorf("error listening: %w", err)
	}
	cancel()
	listening()
	for {
		wctx, cancel := context.WithTimeout(ctx, listenIdle)
		n, err := conn.Conn().WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil:
			notified(n)
			continue
		case ctx.Err() != nil:
			return err
		case wctx.Err() == nil:
			return fmt.Errorf("error waiting for a notification: %w", err)
		}
		pctx, cancel := context.WithTimeout(ctx, listenProbeTimeout)
		err = conn.Ping(pctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			// The pool's connections were most likely lost with this one:
			// new ones are made, rather than each taker finding a lost one
			// in turn, a timeout each.
			s.pool.Reset()
			return fmt.Errorf("error probing the listening connection: %w", err)
		}
	}
}
