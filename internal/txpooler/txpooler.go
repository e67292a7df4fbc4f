// Package txpooler is a connection pooler that pools by transaction, for
// tests: the connections it accepts share one server session, each holding
// it from the first message of a transaction to the server's answer that the
// transaction is over, as PgBouncer's pool_mode=transaction shares its
// sessions. What one client leaves in the session (a prepared statement, a
// setting) the next finds there.
package txpooler

import (
	"context"
	"fmt"
	"net"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Pooler accepts connections and runs their transactions in its session.
type Pooler struct {
	listener net.Listener
	session  *pgconn.HijackedConn

	mu sync.Mutex // held by the client whose transaction runs
	wg sync.WaitGroup

	clientsMu sync.Mutex
	clients   map[net.Conn]struct{} // open; nil once closed
}

// Start opens the session on url and listens on a local port.
func Start(ctx context.Context, url string) (*Pooler, error) {
	conn, err := pgconn.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("error opening the pooled session: %w", err)
	}
	session, err := conn.Hijack()
	if err != nil {
		_ = conn.Close(ctx)
		return nil, fmt.Errorf("error taking the pooled session: %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = session.Conn.Close()
		return nil, fmt.Errorf("error listening: %w", err)
	}
	p := &Pooler{listener: l, session: session, clients: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	return p, nil
}

// Addr is the address the pooler listens on.
func (p *Pooler) Addr() string { return p.listener.Addr().String() }

// Close stops listening, ends the session and the clients' connections, and
// waits for their goroutines.
func (p *Pooler) Close() error {
	err := p.listener.Close()
	_ = p.session.Conn.Close()
	p.clientsMu.Lock()
	for conn := range p.clients {
		_ = conn.Close()
	}
	p.clients = nil
	p.clientsMu.Unlock()
	p.wg.Wait()
	return err
}

func (p *Pooler) accept() {
	for {
		conn, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.clientsMu.Lock()
		if p.clients == nil {
			p.clientsMu.Unlock()
			_ = conn.Close()
			return
		}
		p.clients[conn] = struct{}{}
		p.clientsMu.Unlock()
		p.wg.Go(func() {
			defer func() {
				p.clientsMu.Lock()
				delete(p.clients, conn)
				p.clientsMu.Unlock()
				_ = conn.Close()
			}()
			_ = p.serve(conn)
		})
	}
}

// serve answers a client's start itself, then forwards its messages to the
// session and the session's answers back.
func (p *Pooler) serve(conn net.Conn) error {
	client := pgproto3.NewBackend(conn, conn)
	for started := false; !started; {
		msg, err := client.ReceiveStartupMessage()
		if err != nil {
			return err
		}
		switch msg.(type) {
		case *pgproto3.SSLRequest, *pgproto3.GSSEncRequest:
			if _, err := conn.Write([]byte("N")); err != nil {
				return err
			}
		case *pgproto3.StartupMessage:
			started = true
		default: // a cancel request
			return nil
		}
	}
	client.Send(&pgproto3.AuthenticationOk{})
	for name, value := range p.session.ParameterStatuses {
		client.Send(&pgproto3.ParameterStatus{Name: name, Value: value})
	}
	client.Send(&pgproto3.BackendKeyData{ProcessID: p.session.PID, SecretKey: p.session.SecretKey})
	client.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	if err := client.Flush(); err != nil {
		return err
	}

	server := p.session.Frontend
	holding := false
	defer func() {
		if holding {
			p.mu.Unlock()
		}
	}()
	for {
		msg, err := client.Receive()
		if err != nil {
			return err
		}
		if _, ok := msg.(*pgproto3.Terminate); ok {
			return nil
		}
		if !holding {
			p.mu.Lock()
			holding = true
		}
		server.Send(msg)
		switch msg.(type) {
		case *pgproto3.Sync, *pgproto3.Query:
		default:
			continue
		}
		if err := server.Flush(); err != nil {
			return err
		}
		for answered := false; !answered; {
			reply, err := server.Receive()
			if err != nil {
				return err
			}
			client.Send(reply)
			if ready, ok := reply.(*pgproto3.ReadyForQuery); ok {
				answered = true
				if ready.TxStatus == 'I' {
					p.mu.Unlock()
					holding = false
				}
			}
		}
		if err := client.Flush(); err != nil {
			return err
		}
	}
}
