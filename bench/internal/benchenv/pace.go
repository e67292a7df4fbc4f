package benchenv

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"syscall"
	"time"
)

// Pace measures the machine as a run finds it and returns a line saying so:
// how long one core takes to hash 64 MiB, what a system call costs, and what
// a round trip costs between two threads that each sleep in the kernel until
// the other wakes it. On a shared machine the CPU time a unit of work costs
// moves with the neighbours (the same binary has drained 3,500 and 5,400
// items/s minutes apart); Start and Close print the pace, so that runs made
// at different moments, or on different machines, can be told apart. The
// hashing is arithmetic alone; a request crosses processes several times and
// pays for system calls and wake-ups, which a virtual machine can charge for
// many times over while it hashes as fast as ever.
//
// It also times a durable write where the private PostgreSQL keeps its files
// (the temporary directory): a commit waits for one, and on these machines
// it has taken from 93 to over 400 µs on different days, which moves every
// latency figure of a run.
func Pace(when string) string {
	line := fmt.Sprintf("machine pace %s: 64 MiB hashed in %.0f ms, a system call %.2f µs", when, ms(hashTime()), us(syscallTime()))
	if rt, err := wakeRoundTrip(20_000); err != nil {
		line += fmt.Sprintf(", no wake-up round trip measured (%v)", err)
	} else {
		line += fmt.Sprintf(", a wake-up round trip between two threads %.1f µs", us(rt))
	}
	if d, err := syncTime(os.TempDir(), 200); err != nil {
		line += fmt.Sprintf(", no durable write measured (%v)", err)
	} else {
		line += fmt.Sprintf(", an 8 KiB write and fsync %.0f µs (median)", us(d))
	}
	return line
}

// syncTime is the median of n writes of 8 KiB at the start of a file in dir,
// each followed by fsync, as a commit writes and flushes a WAL page
// (pg_test_fsync's "one 8kB write").
func syncTime(dir string, n int) (time.Duration, error) {
	f, err := os.CreateTemp(dir, "pace-sync-")
	if err != nil {
		return 0, fmt.Errorf("error creating the file to sync: %w", err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	page := make([]byte, 8<<10)
	times := make([]time.Duration, n)
	for i := range times {
		start := time.Now()
		if _, err := f.WriteAt(page, 0); err != nil {
			return 0, fmt.Errorf("error writing the file to sync: %w", err)
		}
		if err := f.Sync(); err != nil {
			return 0, fmt.Errorf("error syncing: %w", err)
		}
		times[i] = time.Since(start)
	}
	slices.Sort(times)
	return times[n/2], nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }

// hashTime is how long hashing 64 MiB takes.
func hashTime() time.Duration {
	buf := make([]byte, 1<<20)
	h := sha256.New()
	start := time.Now()
	for range 64 {
		h.Write(buf)
	}
	h.Sum(nil)
	return time.Since(start)
}

// syscallTime is what one system call costs: getppid, which the kernel
// answers at once (no vDSO shortcut, no runtime bookkeeping around it).
func syscallTime() time.Duration {
	const n = 200_000
	start := time.Now()
	for range n {
		syscall.Getppid()
	}
	return time.Since(start) / n
}

// wakeRoundTrip is what one round trip costs between two threads over two
// pipes, each thread blocked in read until the other writes, as in `perf
// bench sched pipe`.
func wakeRoundTrip(n int) (time.Duration, error) {
	var ping, pong [2]int
	if err := syscall.Pipe2(ping[:], syscall.O_CLOEXEC); err != nil {
		return 0, fmt.Errorf("error creating a pipe: %w", err)
	}
	defer syscall.Close(ping[0])
	if err := syscall.Pipe2(pong[:], syscall.O_CLOEXEC); err != nil {
		syscall.Close(ping[1])
		return 0, fmt.Errorf("error creating a pipe: %w", err)
	}
	defer syscall.Close(pong[0])
	defer syscall.Close(pong[1])
	echoed := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		echoed <- relay(ping[0], pong[1], n)
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start := time.Now()
	err := pingPong(ping[1], pong[0], n)
	elapsed := time.Since(start)
	// Closing ping's writer ends the relay should it still wait (pingPong
	// gave up); the pipes it reads and writes are closed only once it has
	// returned, so it never touches a descriptor number used again.
	syscall.Close(ping[1])
	if relayErr := <-echoed; err == nil {
		err = relayErr
	}
	return elapsed / time.Duration(n), err
}

// pingPong writes a byte to out and reads one back from in, n times.
func pingPong(out, in, n int) error {
	b := []byte{0}
	for range n {
		if _, err := syscall.Write(out, b); err != nil {
			return fmt.Errorf("error writing to a pipe: %w", err)
		}
		if _, err := syscall.Read(in, b); err != nil {
			return fmt.Errorf("error reading from a pipe: %w", err)
		}
	}
	return nil
}

// relay reads n bytes one at a time from in and writes each to out. It
// stops when in's writer is closed (wakeRoundTrip gave up), writing nothing
// more.
func relay(in, out, n int) error {
	b := []byte{0}
	for range n {
		m, err := syscall.Read(in, b)
		if err != nil {
			return fmt.Errorf("error reading from a pipe: %w", err)
		}
		if m == 0 {
			return errors.New("the pipe's writer closed it")
		}
		if _, err := syscall.Write(out, b); err != nil {
			return fmt.Errorf("error writing to a pipe: %w", err)
		}
	}
	return nil
}
