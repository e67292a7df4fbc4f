// Package tcpproxy forwards TCP connections to a target for tests, and can
// cut the connections open at a moment without closing them, as a network
// that starts losing their packets does (a NAT or firewall that forgot them,
// an address moved by a failover): each end waits for the other, which sends
// nothing and never closes. Connections made afterwards are forwarded as
// before.
package tcpproxy

import (
	"net"
	"sync"
	"sync/atomic"
)

// Proxy forwards the connections it accepts to its target.
type Proxy struct {
	listener net.Listener

	mu     sync.Mutex
	target string
	pairs  map[*pair]struct{}
	closed bool
	wg     sync.WaitGroup
}

// pair is a forwarded connection: what was accepted and what was dialled.
type pair struct {
	in, out net.Conn
	cut     atomic.Bool
}

// close closes both ends.
func (c *pair) close() {
	_ = c.in.Close()
	_ = c.out.Close()
}

// Start listens on a local port and forwards what it accepts to target.
func Start(target string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{listener: l, target: target, pairs: map[*pair]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the address the proxy listens on.
func (p *Proxy) Addr() string { return p.listener.Addr().String() }

// Retarget forwards the connections accepted from now on to target, as an
// address a failover moved; those open now stay with the old one.
func (p *Proxy) Retarget(target string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = target
}

// Cut stops forwarding on every connection open now, in both directions, and
// returns how many it cut. A cut connection stays open at both ends until
// Drop or Close: what either end sends is dropped, and neither learns that
// the other closed.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.pairs {
		if !c.cut.Swap(true) {
			n++
		}
	}
	return n
}

// Drop closes both ends of every cut connection, as the server's TCP
// keepalives, in time, close its end of one its client lost.
func (p *Proxy) Drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.pairs {
		if c.cut.Load() {
			c.close()
			delete(p.pairs, c)
		}
	}
}

// Close stops listening and closes every connection, cut or not.
func (p *Proxy) Close() error {
	err := p.listener.Close()
	p.mu.Lock()
	p.closed = true
	for c := range p.pairs {
		c.close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		target := p.target
		p.mu.Unlock()
		out, err := net.Dial("tcp", target)
		if err != nil {
			_ = in.Close()
			continue
		}
		c := &pair{in: in, out: out}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.close()
			return
		}
		p.pairs[c] = struct{}{}
		p.wg.Add(2)
		p.mu.Unlock()
		go p.forward(c, c.in, c.out)
		go p.forward(c, c.out, c.in)
	}
}

// forward copies from src to dst until src ends, dropping what it reads once
// c is cut. A connection that ends uncut closes both ends; a cut one is left
// open for Drop or Close.
func (p *Proxy) forward(c *pair, src, dst net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !c.cut.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil && !c.cut.Load() {
				err = werr
			}
		}
		if err != nil {
			if c.cut.Load() {
				return // the other end is not told: it waits on, as across a lost network
			}
			p.mu.Lock()
			delete(p.pairs, c)
			p.mu.Unlock()
			c.close()
			return
		}
	}
}
