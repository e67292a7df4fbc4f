// Package proccpu reads the CPU time a process has used, from /proc (Linux).
package proccpu

import (
	"fmt"
	"os"
	"strings"
	"time"
)

// clockTick is the unit of CPU times in /proc (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// Of is the CPU time (user and system) process pid has used so far, to the
// clock tick (10 ms).
func Of(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: fields start after it.
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 13 {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	var utime, stime int64
	if _, err := fmt.Sscan(fields[11], &utime); err != nil {
		return 0, err
	}
	if _, err := fmt.Sscan(fields[12], &stime); err != nil {
		return 0, err
	}
	return time.Duration(utime+stime) * clockTick, nil
}
