package connwatch

import (
	"net"
	"os"
	"sync"
	"syscall"
)

// poller is an epoll instance in which watched connections wait, one shot
// each, for something to read. The instance is itself read through the
// runtime's poller, by one goroutine.
type poller struct {
	fd      int
	mu      sync.Mutex
	next    uint64
	pending map[uint64]*watch
}

// watch is a connection in the poller.
type watch struct {
	c    net.Conn
	done Done
	// read is closed once the read that followed the event has returned.
	read chan struct{}
}

var (
	startOnce sync.Once
	// shared is the process's poller; nil when epoll is not available.
	shared *poller
)

// watchByPoller watches c in the process's poller, if c has a descriptor to
// put there.
func watchByPoller(c net.Conn, done Done) (func(), bool) {
	startOnce.Do(start)
	sc, ok := c.(syscall.Conn)
	if shared == nil || !ok {
		return nil, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, false
	}
	return shared.add(c, rc, done)
}

// start creates the process's poller and its goroutine.
func start() {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		_ = syscall.Close(fd)
		return
	}
	// Non-blocking, the file is read through the runtime's poller: it is
	// readable when some watched connection is.
	f := os.NewFile(uintptr(fd), "connwatch")
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return
	}
	shared = &poller{fd: fd, pending: map[uint64]*watch{}}
	go shared.run(rc)
}

// add puts c in the poller.
func (p *poller) add(c net.Conn, rc syscall.RawConn, done Done) (func(), bool) {
	w := &watch{c: c, done: done, read: make(chan struct{})}
	p.mu.Lock()
	p.next++
	id := p.next
	p.pending[id] = w
	p.mu.Unlock()
	var ctlErr error
	err := rc.Control(func(fd uintptr) {
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT}
		ev.Fd, ev.Pad = int32(uint32(id)), int32(uint32(id>>32))
		ctlErr = syscall.EpollCtl(p.fd, syscall.EPOLL_CTL_ADD, int(fd), &ev)
	})
	if err != nil || ctlErr != nil {
		p.mu.Lock()
		delete(p.pending, id)
		p.mu.Unlock()
		return nil, false
	}
	return func() { p.remove(id, w, rc) }, true
}

// remove ends the watch id of w, whose connection's descriptor is rc's.
func (p *poller) remove(id uint64, w *watch, rc syscall.RawConn) {
	p.mu.Lock()
	_, pending := p.pending[id]
	delete(p.pending, id)
	p.mu.Unlock()
	// Taken out while the descriptor is open (a closed one left the
	// instance with it): its number may be another connection's next.
	_ = rc.Control(func(fd uintptr) {
		_ = syscall.EpollCtl(p.fd, syscall.EPOLL_CTL_DEL, int(fd), nil)
	})
	if !pending {
		cut(w.c, w.read)
	}
}

// run reads the instance's events until it fails, which it does not.
func (p *poller) run(rc syscall.RawConn) {
	events := make([]syscall.EpollEvent, 128)
	for {
		var n int
		err := rc.Read(func(fd uintptr) bool {
			n, _ = syscall.EpollWait(int(fd), events, 0)
			return n > 0
		})
		if err != nil {
			return
		}
		for _, ev := range events[:n] {
			p.fire(uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32)
		}
	}
}

// fire starts the read of the watch id, if it is still pending.
func (p *poller) fire(id uint64) {
	p.mu.Lock()
	w := p.pending[id]
	delete(p.pending, id)
	p.mu.Unlock()
	if w == nil {
		return
	}
	go func() {
		defer close(w.read)
		readOne(w.c, w.done)
	}()
}
