// Package e2e runs the real gateway binary against a fake OpenAI-compatible
// upstream and a real PostgreSQL, and checks every reply against the OpenAPI
// document.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/internal/testdb"
)

var binary string

// builtVersion and builtRevision are what the binary is linked to say of
// itself (gateway --version, gateway_build_info), as the image's build
// links them.
const (
	builtVersion  = "v0.0.0-e2e"
	builtRevision = "0123456789abcdef0123456789abcdef01234567"
)

func TestMain(m *testing.M) {
	os.Exit(runWithBinary(m))
}

// runWithBinary builds the gateway into a temporary directory, runs the tests
// against it and removes the directory before the process exits.
func runWithBinary(m *testing.M) int {
	dir, err := os.MkdirTemp("", "gateway-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binary = filepath.Join(dir, "gateway")
	const linked = "github.com/rungworks/gateway/internal/version"
	build := exec.Command("go", "build", "-ldflags", "-X "+linked+".Version="+builtVersion+" -X "+linked+".Revision="+builtRevision, "-o", binary, "../cmd/gateway")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "error building gateway:", err)
		return 1
	}
	return testdb.Run(m)
}

// environ is the process environment without the gateway's own variables, plus extra.
func environ(extra map[string]string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GATEWAY_") || strings.HasPrefix(kv, "DATABASE_URL=") {
			continue
		}
		env = append(env, kv)
	}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	return env
}

// cli runs a gateway subcommand to completion and returns its stdout.
func cli(t *testing.T, dbURL string, args ...string) (string, error) {
	t.Helper()
	return cliWith(t, map[string]string{"DATABASE_URL": dbURL}, args...)
}

// cliWith runs a gateway subcommand in the environment env (see environ) to
// completion and returns its stdout.
func cliWith(t *testing.T, env map[string]string, args ...string) (string, error) {
	t.Helper()
	stdout, stderr, err := cliIn(t, "", env, args...)
	if err != nil {
		return stdout, fmt.Errorf("%w: %s", err, stderr)
	}
	return stdout, nil
}

// cliTimeout bounds a subcommand run to completion: one that does not end
// (a command that should have refused serves instead, say) is killed and
// fails its test, instead of holding the run until the run's own timeout.
const cliTimeout = 2 * time.Minute

// cliIn runs a gateway subcommand to completion in dir (the test's own if
// empty) with env (see environ), returning its stdout, stderr and error.
func cliIn(t *testing.T, dir string, env map[string]string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cliTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Dir = dir
	cmd.Env = environ(env)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("gateway %v did not end within %v: %w", args, cliTimeout, err)
	}
	return stdout.String(), stderr.String(), err
}

func mustCLI(t *testing.T, dbURL string, args ...string) string {
	t.Helper()
	out, err := cli(t, dbURL, args...)
	require.NoError(t, err, "gateway %v", args)
	return out
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// gateway is one running `gateway serve` (or `dev`) process.
type gateway struct {
	t       *testing.T
	cmd     *exec.Cmd
	base    string
	metrics string // base URL of the metrics listener
	stderr  *syncbuf.Buffer
	stdout  *syncbuf.Buffer
	// logReader is the reading end of the pipe of standard error, when
	// started piped; while logsHeld is set, it is not read (holdLogs);
	// logsRead is closed when the reads end.
	logReader *os.File
	logsHeld  atomic.Pointer[chan struct{}]
	logsRead  chan struct{}
	done      chan error
	// client sends call's requests; nil is http.DefaultClient.
	client *http.Client
}

// start runs the binary with args and env, and waits until it serves. The
// ports are picked free and handed over, so another process may take one
// first: a replica that cannot bind is started again on other ports, and a
// replica is ready only once it has said that it listens on its own address
// (another test's gateway could answer on that port meanwhile).
func start(t *testing.T, env map[string]string, args ...string) *gateway {
	t.Helper()
	return launch(t, false, env, args...)
}

// launch is start, with the process's standard error on a pipe whose
// reading end, logReader, the test may close (or hold) when piped.
func launch(t *testing.T, piped bool, env map[string]string, args ...string) *gateway {
	t.Helper()
	for attempt := 1; ; attempt++ {
		g, err := startOnce(t, piped, env, args...)
		if err == nil {
			return g
		}
		if !strings.Contains(g.stderr.String(), "address already in use") || attempt == 3 {
			t.Fatalf("%v\nstderr: %s", err, g.stderr.String())
		}
	}
}

func startOnce(t *testing.T, piped bool, env map[string]string, args ...string) (*gateway, error) {
	t.Helper()
	port, metricsPort := freePort(t), freePort(t)
	env["GATEWAY_LISTEN"] = fmt.Sprintf("127.0.0.1:%d", port)
	if env["GATEWAY_METRICS_LISTEN"] != "off" {
		env["GATEWAY_METRICS_LISTEN"] = fmt.Sprintf("127.0.0.1:%d", metricsPort)
	}
	if _, ok := env["GATEWAY_DRAIN_DELAY"]; !ok {
		env["GATEWAY_DRAIN_DELAY"] = "0s" // tests that stop replicas need no load balancer to notice
	}
	scheme, probe := "http", http.DefaultClient
	if env["GATEWAY_TLS_CERT"] != "" {
		// The readiness probe does not check the certificate (the test
		// does, with a client of its own).
		scheme = "https"
		probe = &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
		defer probe.CloseIdleConnections()
	}
	g := spawn(t, piped, env, args...)
	g.base, g.metrics = fmt.Sprintf("%s://127.0.0.1:%d", scheme, port), fmt.Sprintf("http://127.0.0.1:%d", metricsPort)

	// Ready, as a load balancer would wait for: the database answers and the
	// key cache listens for changes.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if g.listening(port) {
			resp, err := probe.Get(g.base + "/readyz")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return g, nil
				}
			}
		}
		select {
		case err := <-g.done:
			g.done <- err
			if g.logsRead != nil {
				<-g.logsRead // what it wrote, read to its end
			}
			return g, fmt.Errorf("gateway exited before serving: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return g, fmt.Errorf("gateway did not serve within 60s")
		}
	}
}

// spawn starts the gateway with args in the environment env (see environ),
// its output read into g.stdout and g.stderr (the latter through a pipe the
// test may close or hold when piped: launch), and stops it when the test
// ends, showing its standard error if the test failed. It does not wait for
// the process to serve.
func spawn(t *testing.T, piped bool, env map[string]string, args ...string) *gateway {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = environ(env)
	cmd.SysProcAttr = childAttr()
	g := &gateway{t: t, cmd: cmd, stderr: &syncbuf.Buffer{}, stdout: &syncbuf.Buffer{}, done: make(chan error, 1)}
	cmd.Stdout, cmd.Stderr = g.stdout, g.stderr
	var logWriter *os.File
	if piped {
		var err error
		g.logReader, logWriter, err = os.Pipe()
		require.NoError(t, err)
		t.Cleanup(func() { g.logReader.Close() })
		cmd.Stderr = logWriter
		g.logsRead = make(chan struct{})
		go g.readLogs()
	}
	require.NoError(t, cmd.Start())
	if logWriter != nil {
		require.NoError(t, logWriter.Close()) // the process has its own
	}
	go func() { g.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = g.stop()
		if t.Failed() {
			t.Logf("gateway stderr:\n%s", g.stderr.String())
		}
	})
	return g
}

// readLogs copies what the process writes to its piped standard error into
// g.stderr, until the process or the test closes the pipe, and waits while
// the test holds the logs: the pipe then fills, as when a log reader stalls.
func (g *gateway) readLogs() {
	defer close(g.logsRead)
	buf := make([]byte, 32<<10)
	for {
		if held := g.logsHeld.Load(); held != nil {
			<-*held
		}
		n, err := g.logReader.Read(buf)
		_, _ = g.stderr.Write(buf[:n])
		if err != nil {
			return
		}
	}
}

// holdLogs stops the reads of the piped standard error (after the one under
// way) until release.
func (g *gateway) holdLogs() (release func()) {
	held := make(chan struct{})
	g.logsHeld.Store(&held)
	return sync.OnceFunc(func() {
		g.logsHeld.Store(nil)
		close(held)
	})
}

// listening reports whether the gateway has logged that it listens on port.
func (g *gateway) listening(port int) bool {
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for _, line := range strings.Split(g.stderr.String(), "\n") {
		if strings.Contains(line, "gateway listening") && strings.Contains(line, addr) {
			return true
		}
	}
	return false
}

// serve starts `gateway serve` on dbURL with the upstream and extra settings.
func serve(t *testing.T, dbURL, upstreamURL string, extra map[string]string) *gateway {
	t.Helper()
	return launchServe(t, false, dbURL, upstreamURL, extra)
}

// servePiped is serve without extra settings, its standard error on a pipe
// (launch).
func servePiped(t *testing.T, dbURL, upstreamURL string) *gateway {
	t.Helper()
	return launchServe(t, true, dbURL, upstreamURL, nil)
}

// launchServe launches `gateway serve` on dbURL with the upstream and extra
// settings.
func launchServe(t *testing.T, piped bool, dbURL, upstreamURL string, extra map[string]string) *gateway {
	t.Helper()
	env := map[string]string{"DATABASE_URL": dbURL, "GATEWAY_UPSTREAM": upstreamURL}
	for k, v := range extra {
		env[k] = v
	}
	return launch(t, piped, env, "serve")
}

// stop sends SIGTERM and waits for the process to end.
func (g *gateway) stop() error {
	select {
	case err := <-g.done: // it has ended already
		g.done <- err
		return err
	default:
	}
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-g.done:
		g.done <- err
		return err
	case <-time.After(30 * time.Second):
		_ = g.cmd.Process.Kill()
		return fmt.Errorf("gateway did not stop on SIGTERM")
	}
}

type reply struct {
	status int
	proto  int // the HTTP major version it came over
	header http.Header
	body   []byte
}

// call sends a request and validates the reply against the OpenAPI document.
func (g *gateway) call(method, path, key string, body any) reply {
	g.t.Helper()
	return g.callWith(method, path, key, body, nil)
}

// callWith is call with extra request headers.
func (g *gateway) callWith(method, path, key string, body any, header http.Header) reply {
	g.t.Helper()
	var raw []byte
	if body != nil {
		var err error
		raw, err = json.Marshal(body)
		require.NoError(g.t, err)
	}
	newReq := func() *http.Request {
		req, err := http.NewRequestWithContext(context.Background(), method, g.base+path, bytes.NewReader(raw))
		require.NoError(g.t, err)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		for k, v := range header {
			req.Header[k] = v
		}
		return req
	}
	resp, err := g.httpClient().Do(newReq())
	require.NoError(g.t, err)
	defer resp.Body.Close()
	got := apitest.Validate(g.t, newReq(), resp)
	return reply{status: resp.StatusCode, proto: resp.ProtoMajor, header: resp.Header, body: got}
}

// httpClient is the client that sends g's requests.
func (g *gateway) httpClient() *http.Client {
	if g.client == nil {
		return http.DefaultClient
	}
	return g.client
}

func jsonBody(t *testing.T, v any) io.Reader {
	t.Helper()
	raw, err := json.Marshal(v)
	require.NoError(t, err)
	return bytes.NewReader(raw)
}

// expect requires r to have status and returns its body decoded as T.
func expect[T any](t *testing.T, r reply, status int) T {
	t.Helper()
	require.Equal(t, status, r.status, string(r.body))
	var v T
	require.NoError(t, json.Unmarshal(r.body, &v), string(r.body))
	return v
}

func (r reply) object(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

func (r reply) code(t *testing.T) string {
	t.Helper()
	e, ok := r.object(t)["error"].(map[string]any)
	require.True(t, ok, "an error envelope: %s", r.body)
	return e["code"].(string)
}

// waitForLine reads lines of r until one contains s, returning it.
func waitForLine(t *testing.T, b *syncbuf.Buffer, s string) string {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		sc := bufio.NewScanner(strings.NewReader(b.String()))
		for sc.Scan() {
			if strings.Contains(sc.Text(), s) {
				return sc.Text()
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("no line with %q in:\n%s", s, b.String())
	return ""
}
