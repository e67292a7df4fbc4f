// Package blackhole has the network drop every packet sent to a loopback
// address of a test's own, as a network that lost the connections to it does
// (a NAT or firewall that forgot them, an address a failover moved): no end
// is told, and what the kernels send to it is lost, keepalive probes
// included, which a proxy's kernel would answer (internal/tcpproxy). It
// needs Linux, ip(8) and the right to change routes (root); a test without
// them is skipped.
package blackhole

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"testing"
)

// Hole is a loopback address whose packets the network drops once asked.
type Hole struct {
	t       testing.TB
	addr    string
	dropped bool // the route is in place
}

// New returns a loopback address of t's own (in 127.0.0.0/8, whose
// addresses are all this host's) to listen on or dial from; the network
// delivers what is sent to it until Drop. t is skipped where routes cannot
// be changed.
func New(t testing.TB) *Hole {
	t.Helper()
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("blackhole: needs Linux and root, to change routes")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skipf("blackhole: %v", err)
	}
	h := &Hole{t: t, addr: fmt.Sprintf("127.%d.%d.%d", 100+rand.IntN(100), rand.IntN(256), 1+rand.IntN(254))}
	if out, err := h.route("replace"); err != nil {
		t.Skipf("blackhole: cannot change routes: %v: %s", err, out)
	}
	if out, err := h.route("del"); err != nil {
		t.Fatalf("blackhole: %v: %s", err, out)
	}
	return h
}

// Addr is the address, without a port.
func (h *Hole) Addr() string { return h.addr }

// Drop has the network drop every packet sent to the address from now until
// Restore or the test's end.
func (h *Hole) Drop() {
	h.t.Helper()
	if out, err := h.route("replace"); err != nil {
		h.t.Fatalf("blackhole: %v: %s", err, out)
	}
	if !h.dropped {
		h.t.Cleanup(h.Restore)
	}
	h.dropped = true
}

// Restore has the network deliver what is sent to the address again, as a
// network whose partition healed: the kernels send again what was lost.
func (h *Hole) Restore() {
	if !h.dropped {
		return
	}
	if out, err := h.route("del"); err != nil {
		h.t.Errorf("blackhole: %v: %s", err, out)
	}
	h.dropped = false
}

// route adds (replace) or removes (del) the blackhole route of the address
// in the table of local addresses, which the kernel reads first.
func (h *Hole) route(verb string) ([]byte, error) {
	return exec.Command("ip", "route", verb, "blackhole", h.addr+"/32", "table", "local").CombinedOutput()
}
