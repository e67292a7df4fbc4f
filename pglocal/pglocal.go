// Package pglocal runs a private PostgreSQL cluster from the machine's own
// PostgreSQL binaries, in a folder of its own: the embedded default of `gateway
// dev`, and the test database when no Docker engine or test server is given.
// PostgreSQL refuses to run as root, so as root the cluster runs as the
// `postgres` user.
package pglocal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrNoBinaries says what to install when no PostgreSQL server binaries are found.
var ErrNoBinaries = errors.New("no PostgreSQL server binaries (initdb, pg_ctl) found on PATH or in /usr/lib/postgresql/*/bin, /usr/local/opt/postgresql*/bin, /opt/homebrew/opt/postgresql*/bin; install PostgreSQL (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql@16) or set DATABASE_URL")

// ErrPortInUse is returned when the cluster's port is taken.
var ErrPortInUse = errors.New("the PostgreSQL port is in use")

// Options configure a cluster.
type Options struct {
	// Dir holds the data folder, the socket and the log.
	Dir string
	// Port is the TCP port on 127.0.0.1; 0 picks a free one.
	Port int
	// Durable keeps fsync on; tests turn it off for speed.
	Durable bool
}

// Cluster is a running private PostgreSQL.
type Cluster struct {
	dir   string
	port  int
	bin   string
	runAs string
}

// ErrOtherVersion is returned when a cluster's data was made by a major
// version of PostgreSQL whose binaries are not found.
var ErrOtherVersion = errors.New("no binaries of the PostgreSQL that made the cluster's data")

// FindBinaries returns the folder holding initdb and pg_ctl: PATH first, then
// the usual Debian and Homebrew places (highest version first).
func FindBinaries() (string, error) {
	return binariesFor("", 0)
}

// binaryDirs lists the folders holding initdb and pg_ctl, in FindBinaries'
// order.
func binaryDirs() []string {
	var dirs []string
	// A pg_ctl on PATH may be a link into the real bin folder, which also holds
	// createdb and the server.
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil && isFile(filepath.Join(filepath.Dir(real), "initdb")) {
			dirs = append(dirs, filepath.Dir(real))
		}
	}
	var candidates []string
	for _, pattern := range []string{"/usr/lib/postgresql/*/bin", "/usr/local/opt/postgresql*/bin", "/opt/homebrew/opt/postgresql*/bin", "/usr/pgsql-*/bin"} {
		m, _ := filepath.Glob(pattern)
		candidates = append(candidates, m...)
	}
	slices.SortFunc(candidates, func(a, b string) int { return versionOf(b) - versionOf(a) })
	for _, dir := range candidates {
		if isFile(filepath.Join(dir, "initdb")) && isFile(filepath.Join(dir, "pg_ctl")) && !slices.Contains(dirs, dir) {
			dirs = append(dirs, dir)
		}
	}
	return dirs
}

// binariesFor returns the folder of the binaries of PostgreSQL's major
// version want, which made the data folder dataDir; with want 0 (no data
// yet), the first of binaryDirs.
func binariesFor(dataDir string, want int) (string, error) {
	dirs := binaryDirs()
	if len(dirs) == 0 {
		return "", ErrNoBinaries
	}
	if want == 0 {
		return dirs[0], nil
	}
	var found []string
	for _, dir := range dirs {
		v := binaryVersion(dir)
		if v == want {
			return dir, nil
		}
		found = append(found, strconv.Itoa(v))
	}
	return "", fmt.Errorf("%w: %s was made by PostgreSQL %d, and the binaries found are of %s; install PostgreSQL %d, or remove the folder (its data with it) to start anew",
		ErrOtherVersion, dataDir, want, strings.Join(found, ", "), want)
}

// binaryVersion is the major version of the binaries in dir: from the
// folder's name where it says (/usr/lib/postgresql/15/bin), otherwise from
// pg_ctl --version; 0 if neither tells.
func binaryVersion(dir string) int {
	if v := versionOf(dir); v > 0 {
		return v
	}
	out, err := exec.Command(filepath.Join(dir, "pg_ctl"), "--version").Output()
	if err != nil {
		return 0
	}
	// "pg_ctl (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
	_, rest, _ := strings.Cut(string(out), ") ")
	major, _, _ := strings.Cut(rest, ".")
	v, _ := strconv.Atoi(strings.TrimSpace(major))
	return v
}

// dataVersion is the major version of PostgreSQL that made the data folder
// dataDir, from its PG_VERSION; 0 when there is none yet (or it is older
// than 10, numbered otherwise).
func dataVersion(dataDir string) int {
	b, err := os.ReadFile(filepath.Join(dataDir, "PG_VERSION"))
	if err != nil {
		return 0
	}
	v, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return v
}

func versionOf(dir string) int {
	digits := strings.TrimFunc(filepath.Base(filepath.Dir(dir)), func(r rune) bool { return r < '0' || r > '9' })
	if i := strings.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		digits = digits[:i]
	}
	n, _ := strconv.Atoi(digits)
	return n
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

// Start initialises the cluster on first use (reusing its data afterwards) and
// starts it.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	c, err := prepare(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := c.start(ctx, opts.Durable); err != nil {
		return nil, err
	}
	return c, nil
}

// StopLeftover stops the server of the cluster in dir if one runs there: one
// that a process which ended without stopping it (killed, or crashed) left
// behind, holding the cluster's data and port. It reports whether one ran.
// Call it only when no live process uses the cluster (gateway dev holds a
// lock on its folder while it runs).
func StopLeftover(ctx context.Context, dir string) (bool, error) {
	c, err := locate(dir)
	if err != nil {
		return false, err
	}
	if !isFile(filepath.Join(c.dataDir(), "postmaster.pid")) {
		return false, nil
	}
	if _, err := c.run(ctx, "pg_ctl", "-D", c.dataDir(), "status"); err != nil {
		return false, nil // not running: a stale pid file, which the start replaces
	}
	return true, c.Stop()
}

// locate finds the binaries of a cluster in dir (those of the version that
// made its data, if it has any) and the user it runs as.
func locate(dir string) (*Cluster, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("error resolving %s: %w", dir, err)
	}
	c := &Cluster{dir: abs}
	if c.bin, err = binariesFor(c.dataDir(), dataVersion(c.dataDir())); err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		c.runAs = "postgres"
	}
	return c, nil
}

// prepare makes the cluster's folder, the server's user's, and picks its
// port.
func prepare(ctx context.Context, opts Options) (*Cluster, error) {
	c, err := locate(opts.Dir)
	if err != nil {
		return nil, err
	}
	dir := c.dir
	port := opts.Port
	if port == 0 {
		if port, err = freePort(); err != nil {
			return nil, err
		}
	} else if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err != nil {
		return nil, fmt.Errorf("%w: 127.0.0.1:%d", ErrPortInUse, port)
	} else {
		_ = l.Close()
	}
	c.port = port
	// The parent must be traversable by the server's user; the folder itself is private.
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, fmt.Errorf("error creating %s: %w", filepath.Dir(dir), err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("error creating %s: %w", dir, err)
	}
	if err := c.Chown(); err != nil {
		return nil, err
	}
	if c.runAs != "" {
		if err := exec.CommandContext(ctx, "runuser", "-u", c.runAs, "--", "test", "-w", dir).Run(); err != nil {
			return nil, fmt.Errorf("as root, PostgreSQL runs as the %q user, which cannot reach %s; choose a data folder whose parents it can enter (e.g. under /tmp or /work)", c.runAs, dir)
		}
	}
	return c, nil
}

// start initialises the cluster when its folder holds none, and starts it.
func (c *Cluster) start(ctx context.Context, durable bool) error {
	if !isFile(filepath.Join(c.dataDir(), "PG_VERSION")) {
		if _, err := c.run(ctx, "initdb", "-D", c.dataDir(), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale", "--no-sync"); err != nil {
			return fmt.Errorf("error initialising PostgreSQL in %s: %w", c.dataDir(), err)
		}
		// initdb trusts 127.0.0.1; every loopback address is this host's,
		// and tests connect from others (internal/blackhole).
		hba, err := os.OpenFile(filepath.Join(c.dataDir(), "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("error opening pg_hba.conf: %w", err)
		}
		_, err = fmt.Fprintln(hba, "host all all 127.0.0.0/8 trust")
		if err = errors.Join(err, hba.Close()); err != nil {
			return fmt.Errorf("error writing pg_hba.conf: %w", err)
		}
	}
	settings := fmt.Sprintf("-k %s -p %d -c listen_addresses=127.0.0.1 -c max_connections=300", c.dir, c.port)
	if !durable {
		settings += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
	}
	if _, err := c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-l", filepath.Join(c.dir, "postgres.log"), "-w", "-t", "60", "-o", settings, "start"); err != nil {
		return fmt.Errorf("error starting PostgreSQL (log: %s): %w", filepath.Join(c.dir, "postgres.log"), err)
	}
	return nil
}

// URL is the connection string of the cluster's database name db.
func (c *Cluster) URL(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, db)
}

// Stop shuts the cluster down (fast mode: running sessions are ended).
func (c *Cluster) Stop() error { return c.stop("fast") }

// Crash stops the cluster as a crash would (immediate mode: every process
// quits at once, without a checkpoint; the next start recovers from the
// WAL).
func (c *Cluster) Crash() error { return c.stop("immediate") }

// Freeze stops every process of the cluster where it stands (SIGSTOP):
// connections are accepted by the kernel and never answered, as those of a
// server that hangs, or of one behind a network that drops its packets.
// Thaw lets it go on. Its processes are found in /proc (Linux).
func (c *Cluster) Freeze() error { return c.signal(syscall.SIGSTOP) }

// Thaw lets a frozen cluster go on (SIGCONT).
func (c *Cluster) Thaw() error { return c.signal(syscall.SIGCONT) }

// signal sends sig to the postmaster, then to each of its children (each
// in a session of its own, so not in the postmaster's process group).
func (c *Cluster) signal(sig syscall.Signal) error {
	pidFile := filepath.Join(c.dataDir(), "postmaster.pid")
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return fmt.Errorf("error reading the postmaster's pid: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	postmaster, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return fmt.Errorf("error reading the postmaster's pid from %s: %w", pidFile, err)
	}
	if err := syscall.Kill(postmaster, sig); err != nil {
		return fmt.Errorf("error signalling PostgreSQL (%v): %w", sig, err)
	}
	// Listed once the postmaster is stopped: it starts no other meanwhile.
	children, err := childrenOf(postmaster)
	if err != nil {
		return err
	}
	for _, pid := range children {
		if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("error signalling PostgreSQL's process %d (%v): %w", pid, sig, err)
		}
	}
	return nil
}

// childrenOf returns the processes whose parent is pid, read from /proc.
func childrenOf(pid int) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("error listing processes: %w", err)
	}
	parent := strconv.Itoa(pid)
	var children []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // ended meanwhile
		}
		// pid (comm) state ppid …: comm may hold spaces and parentheses.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) > 1 && fields[1] == parent {
			children = append(children, child)
		}
	}
	return children, nil
}

func (c *Cluster) stop(mode string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-m", mode, "-w", "stop"); err != nil {
		return fmt.Errorf("error stopping PostgreSQL (%s): %w", mode, err)
	}
	return nil
}

func (c *Cluster) dataDir() string { return filepath.Join(c.dir, "data") }

// Chown hands the cluster's folder, with what was written into it since
// (a test's certificates), to the user the server runs as: as root, the
// postgres user, which reads a key file only if it owns it.
func (c *Cluster) Chown() error {
	if c.runAs == "" {
		return nil
	}
	u, err := user.Lookup(c.runAs)
	if err != nil {
		return fmt.Errorf("running as root needs the %q user to run PostgreSQL: %w", c.runAs, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return filepath.Walk(c.dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
}

func (c *Cluster) run(ctx context.Context, tool string, args ...string) (string, error) {
	path := filepath.Join(c.bin, tool)
	var cmd *exec.Cmd
	if c.runAs != "" {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", c.runAs, "--", path}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, path, args...)
	}
	cmd.Dir = c.dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s: %w: %s", tool, err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("error finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// CreateDatabase creates database name unless it exists.
func (c *Cluster) CreateDatabase(ctx context.Context, name string) error {
	out, err := c.run(ctx, "createdb", "-h", c.dir, "-p", strconv.Itoa(c.port), "-U", "postgres", name)
	if err != nil && !strings.Contains(out, "already exists") {
		return fmt.Errorf("error creating database %s: %w", name, err)
	}
	return nil
}

// Standby copies the running cluster into opts.Dir (a base backup, with the
// settings that make the copy follow it) and starts the copy as its
// standby: it replays the cluster's changes and takes no writes until
// promoted.
func (c *Cluster) Standby(ctx context.Context, opts Options) (*Cluster, error) {
	standby, err := prepare(ctx, opts)
	if err != nil {
		return nil, err
	}
	if _, err := standby.run(ctx, "pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.port), "-U", "postgres",
		"-D", standby.dataDir(), "--write-recovery-conf", "--checkpoint=fast", "--no-sync"); err != nil {
		return nil, fmt.Errorf("error copying PostgreSQL into %s: %w", standby.dir, err)
	}
	if err := standby.start(ctx, opts.Durable); err != nil {
		return nil, err
	}
	return standby, nil
}

// Promote ends a standby's recovery: it takes writes from then on.
func (c *Cluster) Promote(ctx context.Context) error {
	if _, err := c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-w", "promote"); err != nil {
		return fmt.Errorf("error promoting PostgreSQL: %w", err)
	}
	return nil
}

// Port is the cluster's TCP port on 127.0.0.1.
func (c *Cluster) Port() int { return c.port }
