package e2e

import "syscall"

// childAttr has a replica the tests start stopped (SIGTERM: a dev stops its
// database too) when the test process dies before its cleanups run, as on a
// test timeout's panic, instead of running on with no one to stop it.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
}
