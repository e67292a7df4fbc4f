// Command testpg runs a command (the test suite) with TEST_DATABASE_URL pointing
// at one throwaway PostgreSQL cluster made from the machine's own binaries, so a
// whole test run shares one cluster. With TEST_DATABASE_URL or DATABASE_URL
// already set it runs the command unchanged.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/rungworks/gateway/pglocal"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "usage: testpg COMMAND [ARG...]")
		return 2
	}
	if os.Getenv("TEST_DATABASE_URL") == "" && os.Getenv("DATABASE_URL") == "" {
		dir, err := os.MkdirTemp("", "gateway-testpg-")
		if err == nil {
			err = os.Chmod(dir, 0o755) // the server's user must reach its folder inside
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "testpg:", err)
			return 1
		}
		defer os.RemoveAll(dir)
		cluster, err := pglocal.Start(context.Background(), pglocal.Options{Dir: filepath.Join(dir, "pg")})
		if err != nil {
			fmt.Fprintln(os.Stderr, "testpg:", err)
			return 1
		}
		defer cluster.Stop()
		os.Setenv("TEST_DATABASE_URL", cluster.URL("postgres"))
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	signal.Ignore(syscall.SIGINT) // the child gets the terminal's interrupt and ends; then the cluster stops
	err := cmd.Run()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		return exitErr.ExitCode()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "testpg:", err)
		return 1
	}
	return 0
}
