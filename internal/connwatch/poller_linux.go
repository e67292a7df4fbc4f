package connwatch

import (
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

// poller is an epoll instance in which watched connections wait, one shot
// each, for something to read. The instance is itself read through the
// runtime's poller, by one goroutine.
type poller struct {
	// fd is the instance's descriptor, file the same read through the
	// runtime's poller.
	fd   int
	file *os.File
	mu   sync.Mutex
	next uint64
	// pending are the watches waiting in the instance; dead: it can no
	// longer be read, and takes no more.
	pending map[uint64]*watch
	dead    bool
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
// put there (see Descriptor).
func watchByPoller(c net.Conn, done Done) (func(), bool) {
	startOnce.Do(start)
	sc, ok := Descriptor(c)
	if shared == nil || !ok {
		return nil, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, false
	}
	return shared.add(c, rc, done)
}

// start creates the process's poller, if the system lets it.
func start() {
	if p, err := newPoller(); err == nil {
		shared = p
	}
}

// newPoller creates a poller and starts its goroutine.
func newPoller() (*poller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		_ = syscall.Close(fd)
		return nil, err
	}
	// Non-blocking, the file is read through the runtime's poller (it is
	// readable when some watched connection is), which takes deadlines only
	// for the files it polls.
	f := os.NewFile(uintptr(fd), "connwatch")
	rc, err := f.SyscallConn()
	if err == nil {
		err = f.SetReadDeadline(time.Time{})
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	p := &poller{fd: fd, file: f, pending: map[uint64]*watch{}}
	go p.run(rc)
	return p, nil
}

// add puts c in the poller.
func (p *poller) add(c net.Conn, rc syscall.RawConn, done Done) (func(), bool) {
	w := &watch{c: c, done: done, read: make(chan struct{})}
	p.mu.Lock()
	if p.dead {
		p.mu.Unlock()
		return nil, false
	}
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
	dead := p.dead
	p.mu.Unlock()
	if !dead {
		// Taken out while the descriptor is open (a closed one left the
		// instance with it): its number may be another connection's next.
		_ = rc.Control(func(fd uintptr) {
			_ = syscall.EpollCtl(p.fd, syscall.EPOLL_CTL_DEL, int(fd), nil)
		})
	}
	if !pending {
		cut(w.c, w.read)
	}
}

// run reads the instance's events until it cannot (its file closed). Then
// the watches still pending are read by goroutines, as new ones are.
func (p *poller) run(rc syscall.RawConn) {
	events := make([]syscall.EpollEvent, 128)
	for {
		var n int
		err := rc.Read(func(fd uintptr) bool {
			n, _ = syscall.EpollWait(int(fd), events, 0)
			return n > 0
		})
		if err != nil {
			p.mu.Lock()
			p.dead = true
			left := p.pending
			p.pending = map[uint64]*watch{}
			p.mu.Unlock()
			for _, w := range left {
				readInBackground(w.c, w.done, w.read)
			}
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
	if w != nil {
		readInBackground(w.c, w.done, w.read)
	}
}
