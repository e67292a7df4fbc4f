// Package benchenv starts what the load benchmarks run against: a private
// PostgreSQL with production durability (unless DATABASE_URL names a server),
// databases on it, and gateway processes.
package benchenv

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/proccpu"
	"github.com/rungworks/gateway/pglocal"
	"github.com/rungworks/gateway/store"
)

// Env is a PostgreSQL server and the gateway binary.
type Env struct {
	Binary  string
	cluster *pglocal.Cluster
	dir     string
	// interrupted receives an interrupt or a termination, until Close.
	interrupted chan os.Signal

	mu    sync.Mutex
	procs []*exec.Cmd
}

// Start starts a durable private PostgreSQL (not when DATABASE_URL is set),
// after printing the machine's pace (see Pace). Until Close, an interrupt
// (Ctrl-C) or a termination stops what it started, and the program.
func Start(binary string) (*Env, error) {
	fmt.Printf("%s\n\n", Pace("at the start"))
	e := &Env{Binary: binary, interrupted: make(chan os.Signal, 1)}
	signal.Notify(e.interrupted, os.Interrupt, syscall.SIGTERM)
	go e.stopWhenInterrupted()
	if os.Getenv("DATABASE_URL") != "" {
		return e, nil
	}
	dir, err := os.MkdirTemp("", "gateway-bench-")
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	e.dir = dir
	e.cluster, err = pglocal.Start(context.Background(), pglocal.Options{Dir: filepath.Join(dir, "pg"), Durable: true})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return e, nil
}

// Database creates database name (on the private cluster) and returns its URL.
func (e *Env) Database(name string) (string, error) {
	if e.cluster == nil {
		return os.Getenv("DATABASE_URL"), nil
	}
	if err := e.cluster.CreateDatabase(context.Background(), name); err != nil {
		return "", err
	}
	return e.cluster.URL(name), nil
}

// Fresh creates database name, migrates it for a gateway using upstreamURL,
// and returns the gateway's environment and a key of account "bench" with the
// rate limit and daily ceiling lifted (a benchmark would trip both).
func (e *Env) Fresh(name, upstreamURL string, extra ...string) (env []string, key string, err error) {
	dbURL, err := e.Database(name)
	if err != nil {
		return nil, "", err
	}
	env = append([]string{"DATABASE_URL=" + dbURL, "GATEWAY_UPSTREAM=" + upstreamURL}, extra...)
	if out, err := e.command(env, "migrate").CombinedOutput(); err != nil {
		return nil, "", fmt.Errorf("migrate: %w: %s", err, out)
	}
	keys, err := createKeys(env, freshAccount)
	if err != nil {
		return nil, "", err
	}
	return env, keys[0], nil
}

// freshAccount is the account of the key Fresh makes.
const freshAccount = "bench"

// Tenants returns n accounts and a key of each: Fresh's account and its key,
// then n-1 accounts made in the database of env ("tenant1", …).
func Tenants(env []string, key string, n int) (accounts, keys []string, err error) {
	if n < 1 {
		return nil, nil, fmt.Errorf("at least one tenant, not %d", n)
	}
	accounts = []string{freshAccount}
	for i := 1; i < n; i++ {
		accounts = append(accounts, fmt.Sprintf("tenant%d", i))
	}
	more, err := createKeys(env, accounts[1:]...)
	if err != nil {
		return nil, nil, err
	}
	return accounts, append([]string{key}, more...), nil
}

// createKeys creates a key of each account (created if new, with its daily
// ceiling lifted) in the database of env (from Fresh), and returns them in
// order.
func createKeys(env []string, accounts ...string) ([]string, error) {
	st, err := OpenStore(env)
	if err != nil {
		return nil, err
	}
	defer st.Pool().Close()
	ctx := context.Background()
	lifted := int64(1_000_000_000_000)
	keys := make([]string, len(accounts))
	for i, account := range accounts {
		if keys[i], err = st.CreateKey(ctx, store.CreateKeyParams{Account: account, Project: "default", Scopes: []gateway.Scope{gateway.ScopeInference, gateway.ScopeUsage}}); err != nil {
			return nil, fmt.Errorf("error creating a key of %s: %w", account, err)
		}
		if err := st.SetLimits(ctx, store.SetLimitsParams{Account: account, DailyRungs: &lifted}); err != nil {
			return nil, fmt.Errorf("error lifting the daily ceiling of %s: %w", account, err)
		}
	}
	return keys, nil
}

// CapBudgets gives the default project of each account a budget cap that
// no benchmark reaches, in the database of env (from Fresh): its requests and
// batch items then reserve their estimates.
func CapBudgets(env []string, accounts []string) error {
	st, err := OpenStore(env)
	if err != nil {
		return err
	}
	defer st.Pool().Close()
	budget := int64(1_000_000_000_000)
	for _, account := range accounts {
		if err := st.SetLimits(context.Background(), store.SetLimitsParams{Account: account, Project: "default", BudgetRungs: &budget}); err != nil {
			return fmt.Errorf("error capping the budget of %s: %w", account, err)
		}
	}
	return nil
}

// AddedBy names, in a table of results, what the target named "through X"
// adds over the upstream direct: "added by X".
func AddedBy(target string) string {
	return strings.Replace(target, "through", "added by", 1)
}

// CappedNote is what a run's heading says of its tenants' budgets.
func CappedNote(capped bool) string {
	if capped {
		return ", their projects' budgets capped"
	}
	return ""
}

// CitedNote says, for a heading, whether the fake upstream's replies cite a
// source (each does unless uncited).
func CitedNote(uncited bool) string {
	if uncited {
		return ", no reply citing a source"
	}
	return ", each reply citing a source"
}

// Serve starts `gateway serve` with env and returns its base URL once it is ready.
func (e *Env) Serve(env []string) (string, error) {
	p, err := e.ServeProcess(env)
	return p.Base, err
}

// Process is a started `gateway serve`.
type Process struct {
	// Base is the base URL of its API, Metrics of its metrics listener.
	Base, Metrics string
	PID           int
}

// ServeProcess is Serve that also returns the process id and the metrics
// listener's URL.
func (e *Env) ServeProcess(env []string) (Process, error) {
	addr, err := freeAddr()
	if err != nil {
		return Process{}, err
	}
	metricsAddr, err := freeAddr()
	if err != nil {
		return Process{}, err
	}
	cmd := e.command(append(env, "GATEWAY_LISTEN="+addr, "GATEWAY_METRICS_LISTEN="+metricsAddr, "GATEWAY_RATE_LIMIT=100000000"), "serve")
	// The log goes to /dev/null as a file: no pipe for this process to drain.
	devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return Process{}, err
	}
	defer devNull.Close()
	cmd.Stderr = devNull
	if err := cmd.Start(); err != nil {
		return Process{}, err
	}
	e.mu.Lock()
	e.procs = append(e.procs, cmd)
	e.mu.Unlock()
	p := Process{Base: "http://" + addr, Metrics: "http://" + metricsAddr + "/metrics", PID: cmd.Process.Pid}
	secure, probe := servedOverTLS(env)
	if secure {
		p.Base = "https://" + addr
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if resp, err := probe.Get(p.Base + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
		}
	}
	return Process{}, fmt.Errorf("gateway at %s did not start", p.Base)
}

// freeAddr is a local address no one listens on now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// StopServers stops every gateway process started so far.
func (e *Env) StopServers() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.procs {
		_ = p.Process.Kill()
		_ = p.Wait()
	}
	e.procs = nil
}

// Close stops everything.
func (e *Env) Close() {
	signal.Stop(e.interrupted)
	close(e.interrupted)
	fmt.Printf("\n%s\n", Pace("at the end"))
	e.stop()
}

// stop stops the gateway processes and the private PostgreSQL.
func (e *Env) stop() {
	e.StopServers()
	if e.cluster != nil {
		_ = e.cluster.Stop()
		os.RemoveAll(e.dir)
	}
}

// stopWhenInterrupted stops everything and ends the program on an interrupt
// or a termination, as the deferred Close of the interrupted program would
// not; it returns when Close closes the channel.
func (e *Env) stopWhenInterrupted() {
	sig, ok := <-e.interrupted
	if !ok {
		return
	}
	fmt.Fprintf(os.Stderr, "\n%v: stopping the gateways and PostgreSQL\n", sig)
	e.stop()
	os.Exit(130)
}

func (e *Env) command(env []string, args ...string) *exec.Cmd {
	cmd := exec.Command(e.Binary, args...)
	cmd.Env = append(os.Environ(), env...)
	return cmd
}

// CPU is the CPU time the gateway processes pids, and every PostgreSQL
// process (see PostgresCPU), have used so far.
func CPU(pids ...int) (gateway, postgres time.Duration, err error) {
	for _, pid := range pids {
		c, err := proccpu.Of(pid)
		if err != nil {
			return 0, 0, err
		}
		gateway += c
	}
	postgres, err = PostgresCPU()
	return gateway, postgres, err
}

// PerUnit formats d spread over n units (requests, items) in milliseconds.
func PerUnit(d time.Duration, n int) string {
	return fmt.Sprintf("%.3f ms", d.Seconds()*1000/float64(n))
}

// PostgresCPU is the CPU time every process named postgres on this machine has
// used so far (benchmarks run on a machine whose only PostgreSQL is theirs).
func PostgresCPU() (time.Duration, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var total time.Duration
	for _, e := range entries {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			continue
		}
		if cpu, err := proccpu.Of(pid); err == nil {
			total += cpu
		}
	}
	return total, nil
}

// OpenStore connects to the database of a gateway's environment (from Fresh)
// to read its activity (see Activity); the caller closes its pool.
func OpenStore(env []string) (*store.Store, error) {
	for _, v := range env {
		if url, ok := strings.CutPrefix(v, "DATABASE_URL="); ok {
			pool, err := pgxpool.New(context.Background(), url)
			if err != nil {
				return nil, fmt.Errorf("error connecting to the gateway's database: %w", err)
			}
			return store.New(pool), nil
		}
	}
	return nil, fmt.Errorf("no DATABASE_URL in the gateway's environment")
}

// Activity reads the counters of st's database (see OpenStore) once
// PostgreSQL has published what was done so far, which it does at most once a
// second.
func Activity(st *store.Store) (store.Activity, error) {
	time.Sleep(1100 * time.Millisecond)
	return st.Activity(context.Background())
}
