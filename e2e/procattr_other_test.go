//go:build !linux

package e2e

import "syscall"

// childAttr is nil where no signal tells a process that its parent died.
func childAttr() *syscall.SysProcAttr { return nil }
