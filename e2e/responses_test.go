package e2e

import (
	"context"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/pglocal"
)

type testBundle struct {
	db   string
	fake *fakeupstream.Server
	key  string
}

// setup gives a test a migrated database, a fake upstream and a developer key
// issued by the CLI.
func setup(t *testing.T) *testBundle {
	t.Helper()
	db := testdb.EmptyURL(t)
	mustCLI(t, db, "migrate")
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	out := mustCLI(t, db, "keys", "create", "--account", "acme")
	key := strings.TrimSpace(out)
	require.Regexp(t, `^igw_[a-z2-7]{52}$`, key, "stdout is the key alone")
	return &testBundle{db: db, fake: fake, key: key}
}

func TestResponsesEndToEnd(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{
		"GATEWAY_MODEL_MAP":    "instant=small-model,reasoning=deep-model",
		"GATEWAY_MULTIPLIERS":  "instant=3,reasoning=4,elements=2",
		"GATEWAY_UPSTREAM_KEY": "upstream-secret",
	})

	prompt := "what is a rung"
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt, "max_output_rungs": 50, "web_search": true, "custom_instructions": "short"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	body := r.object(t)
	require.Equal(t, fakeupstream.Reply(prompt), body["content"])
	require.Equal(t, "instant", body["model"])
	pt, ct := fakeupstream.Usage(prompt)
	want := map[string]any{"input_rungs": float64(pt * 3), "output_rungs": float64(ct * 3), "total_rungs": float64((pt + ct) * 3), "regions_activated": nil}
	require.Equal(t, want, body["usage"])
	require.Equal(t, []any{map[string]any{"title": "Example doc", "url": "https://example.org/doc", "snippet": "echo"}}, body["sources"])

	calls := b.fake.Calls()
	require.Len(t, calls, 1)
	require.Equal(t, "web_search", calls[0].Header.Get("X-Gateway-Hints"))
	require.Equal(t, "Bearer upstream-secret", calls[0].Header.Get("Authorization"))
	calls[0].At, calls[0].Header = time.Time{}, nil
	require.Equal(t, fakeupstream.Call{Model: "small-model", System: "short", Prompt: prompt, MaxCompletionTokens: 50}, calls[0])

	// The evidence is served from the database.
	ev := g.call(http.MethodGet, body["sources_url"].(string), b.key, nil)
	require.Equal(t, http.StatusOK, ev.status)
	require.Equal(t, body["sources"], ev.object(t)["sources"])

	// A model left out of the map is unavailable and never reaches the upstream.
	r = g.call(http.MethodPost, "/api/v1/chat", b.key, map[string]any{"prompt": "p", "model": "elements"})
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "MODEL_UNAVAILABLE", r.code(t))
	require.Len(t, b.fake.Calls(), 1)

	// A reply citing nothing has empty evidence, served all the same.
	b.fake.SetCitations(false)
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	body = r.object(t)
	require.Equal(t, []any{}, body["sources"])
	ev = g.call(http.MethodGet, body["sources_url"].(string), b.key, nil)
	require.Equal(t, http.StatusOK, ev.status, string(ev.body))
	require.Equal(t, map[string]any{"request_id": body["request_id"], "sources": []any{}}, ev.object(t))

	// Revoking the key through the CLI locks it out as soon as the replica
	// hears of it.
	mustCLI(t, b.db, "keys", "revoke", b.key[:12])
	require.Eventually(t, func() bool {
		r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": prompt})
		return r.status == http.StatusUnauthorized
	}, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, "UNAUTHORIZED", r.code(t))
}

func TestUpstreamFailures(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)

	b.fake.SetMode(fakeupstream.Down)
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))

	b.fake.SetMode(fakeupstream.Reject)
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	require.Contains(t, string(r.body), "content policy violation", "the upstream's own reason is passed on")

	b.fake.SetMode(fakeupstream.OK)
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusOK, r.status)

	// An upstream that asks to wait: the caller is told how long; once the
	// failures open the circuit (three), the upstream is left alone for as
	// long as it asked, and the caller is told what is left of it.
	b.fake.SetStatus(http.StatusTooManyRequests)
	b.fake.SetReplyHeader("Retry-After", "8")
	for range 3 {
		r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
		require.Equal(t, http.StatusServiceUnavailable, r.status)
		require.Equal(t, "INFERENCE_BUSY", r.code(t))
		require.Equal(t, "8", r.header.Get("Retry-After"))
	}
	calls := len(b.fake.Calls())
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Contains(t, []string{"7", "8"}, r.header.Get("Retry-After"))
	require.Len(t, b.fake.Calls(), calls, "not sent while the upstream asked to wait")
}

func TestUnreachableUpstream(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.Close()
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	r := g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "p"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
}

// TestHTTPSUpstreamWithAPrivateCA: an https upstream whose certificate the
// machine does not trust is never called (INFERENCE_BUSY); trusted through
// SSL_CERT_DIR, as the README says, it serves calls and streams over HTTP/2,
// chosen in the TLS handshake.
func TestHTTPSUpstreamWithAPrivateCA(t *testing.T) {
	t.Parallel()
	b := setup(t)
	up := fakeupstream.NewTLS()
	t.Cleanup(up.Close)

	untrusting := serve(t, b.db, up.BaseURL(), nil)
	r := untrusting.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "untrusted"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, "INFERENCE_BUSY", r.code(t))
	require.Empty(t, up.Calls())

	dir := t.TempDir()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw})
	require.NoError(t, os.WriteFile(filepath.Join(dir, "upstream-ca.pem"), ca, 0o600))
	g := serve(t, b.db, up.BaseURL(), map[string]string{"SSL_CERT_DIR": "/etc/ssl/certs:" + dir})
	r = g.call(http.MethodPost, "/api/v1/responses", b.key, map[string]any{"prompt": "over TLS"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	require.Equal(t, fakeupstream.Reply("over TLS"), r.object(t)["content"])
	_, s := g.stream(b.key, map[string]any{"prompt": "streamed over TLS"})
	require.Equal(t, "response.completed", s.Events[len(s.Events)-1].Name)
	require.Len(t, up.Calls(), 2)
	require.Equal(t, 2, up.HTTP2Calls())
}

func TestReplicasStartTogetherOnAnEmptyDatabase(t *testing.T) {
	t.Parallel()
	db := testdb.EmptyURL(t)
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	// Three replicas race to migrate the same empty database.
	var wg sync.WaitGroup
	gws := make([]*gateway, 3)
	for i := range gws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gws[i] = serve(t, db, fake.BaseURL(), nil)
		}()
	}
	wg.Wait()
	key := strings.TrimSpace(mustCLI(t, db, "keys", "create", "--account", "acme"))
	for _, g := range gws {
		r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "p"})
		require.Equal(t, http.StatusOK, r.status)
	}
}

func TestCLI(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Tier, scopes and project flags.
	free := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "freeco", "--project", "p1", "--tier", "free", "--scopes", "usage"))
	require.Regexp(t, `^igw_`, free)
	_, err := cli(t, b.db, "keys", "create", "--account", "x", "--scopes", "admin")
	require.Error(t, err)
	_, err = cli(t, b.db, "keys", "create")
	require.Error(t, err, "--account is required")

	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--daily-rungs", "5000")
	_, err = cli(t, b.db, "limits", "set", "--account", "acme", "--project", "research", "--budget-rungs", "100")
	require.ErrorContains(t, err, `no such project "research"`, "limits never create what they limit")
	mustCLI(t, b.db, "keys", "create", "--account", "acme", "--project", "research")
	mustCLI(t, b.db, "limits", "set", "--account", "acme", "--project", "research", "--budget-rungs", "100")
	_, err = cli(t, b.db, "limits", "set", "--account", "nobody", "--daily-rungs", "1")
	require.ErrorContains(t, err, "no such account")
	_, err = cli(t, b.db, "limits", "set", "--account", "acme")
	require.ErrorContains(t, err, "nothing to set")
	_, err = cli(t, b.db, "limits", "set", "--account", "acme", "--daily-rungs", "-1")
	require.ErrorContains(t, err, "--daily-rungs: want a whole number of rungs (0 or more) or default")
	_, err = cli(t, b.db, "limits", "set", "--account", "acme", "--budget-rungs", "lots")
	require.ErrorContains(t, err, "or none")

	// Showing the limits, and clearing them.
	shown := strings.Split(mustCLI(t, b.db, "limits", "show", "--account", "acme"), "\n")
	require.Equal(t, []string{"ACCOUNT", "TIER", "DAILY", "CEILING", "CHARGED", "TODAY", "REMAINING", "RESETS"}, strings.Fields(shown[0]))
	require.Equal(t, []string{"acme", "developer", "5000", "0", "5000"}, strings.Fields(shown[1])[:5])
	require.Equal(t, []string{"PROJECT", "BUDGET", "CAP", "SPENT", "RESERVED", "REMAINING"}, strings.Fields(shown[3]))
	require.Equal(t, []string{"default", "none", "0", "0", "-"}, strings.Fields(shown[4]))
	require.Equal(t, []string{"research", "100", "0", "0", "100"}, strings.Fields(shown[5]))
	// Setting shows what it stored, as show does.
	shown = strings.Split(mustCLI(t, b.db, "limits", "set", "--account", "acme", "--daily-rungs", "default", "--project", "research", "--budget-rungs", "none"), "\n")
	require.Equal(t, []string{"acme", "developer", "10000000", "(tier", "default)", "0", "10000000"}, strings.Fields(shown[1])[:7])
	require.Equal(t, []string{"research", "none", "0", "0", "-"}, strings.Fields(shown[5]))
	_, err = cli(t, b.db, "limits", "show", "--account", "nobody")
	require.ErrorContains(t, err, "no such account")

	_, err = cli(t, b.db, "keys", "revoke", "igw_doesnotex")
	require.Error(t, err)

	// Listing finds a key to revoke, never its secret.
	mustCLI(t, b.db, "keys", "revoke", free[:12])
	listed := mustCLI(t, b.db, "keys", "list", "--account", "freeco")
	lines := strings.Split(strings.TrimSpace(listed), "\n")
	require.Len(t, lines, 2, listed)
	require.Equal(t, []string{"PREFIX", "ACCOUNT", "TIER", "PROJECT", "SCOPES", "CREATED", "EXPIRES", "REVOKED", "ID"}, strings.Fields(lines[0]))
	row := strings.Fields(lines[1])
	require.Equal(t, []string{free[:12], "freeco", "free", "p1", "usage"}, row[:5])
	require.Equal(t, "-", row[6], "issued without an end")
	require.NotEqual(t, "-", row[7], "revoked, with when")
	require.NotContains(t, listed, free)
	all := mustCLI(t, b.db, "keys", "list")
	require.Len(t, strings.Split(strings.TrimSpace(all), "\n"), 4, "freeco's key and acme's two: "+all)
	_, err = cli(t, b.db, "keys", "list", "--account", "freecoo")
	require.ErrorContains(t, err, `no such account "freecoo"`)

	_, err = cli(t, "", "serve")
	require.ErrorContains(t, err, "DATABASE_URL is required")

	// The container health check.
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	_, err = cli(t, "", "probe", g.base+"/readyz")
	require.NoError(t, err)
	_, err = cli(t, "", "probe", g.base+"/nowhere")
	require.ErrorContains(t, err, "404")

	// A key issued with an end serves until then, and is refused after.
	_, err = cli(t, b.db, "keys", "create", "--account", "acme", "--expires", "soon")
	require.ErrorContains(t, err, `--expires: want a time from now (90d, 12h) or a time`)
	// Used at once (its end comes 3 s after it was made), then listed.
	brief := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "acme", "--expires", "3s"))
	res := g.call(http.MethodPost, "/api/v1/responses", brief, map[string]any{"prompt": "before the end"})
	require.Equal(t, http.StatusOK, res.status, string(res.body))
	listedEnd := ""
	for _, line := range strings.Split(mustCLI(t, b.db, "keys", "list", "--account", "acme"), "\n") {
		if row := strings.Fields(line); len(row) > 6 && row[0] == brief[:12] {
			listedEnd = row[6]
		}
	}
	require.Regexp(t, `^20\d\d-\d\d-\d\dT`, listedEnd, "listed with its end")
	require.Eventually(t, func() bool {
		return g.call(http.MethodPost, "/api/v1/responses", brief, map[string]any{"prompt": "after the end"}).status == http.StatusUnauthorized
	}, 15*time.Second, 100*time.Millisecond, "refused once expired, though cached")

	// A rotation: the new key serves at once; without a grace, the old one is
	// refused by the replica that had it cached.
	old := strings.TrimSpace(mustCLI(t, b.db, "keys", "create", "--account", "acme"))
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", old, map[string]any{"prompt": "cached"}).status)
	_, err = cli(t, b.db, "keys", "rotate", brief[:12])
	require.ErrorContains(t, err, "no active key", "an ended key does not rotate")
	rotated := strings.TrimSpace(mustCLI(t, b.db, "keys", "rotate", old[:12], "--grace", "0s"))
	require.Regexp(t, `^igw_`, rotated)
	require.Equal(t, http.StatusOK, g.call(http.MethodPost, "/api/v1/responses", rotated, map[string]any{"prompt": "the new key"}).status)
	require.Eventually(t, func() bool {
		return g.call(http.MethodPost, "/api/v1/responses", old, map[string]any{"prompt": "the old key"}).status == http.StatusUnauthorized
	}, 10*time.Second, 50*time.Millisecond, "the old key is refused")
}

// TestBadConfigurationStopsStart: a mistake in the configuration stops the
// start with a message naming it, before a database is connected to (here
// none answers), so it is reported as itself.
func TestBadConfigurationStopsStart(t *testing.T) {
	t.Parallel()
	keyless := filepath.Join(t.TempDir(), "gateway.yaml")
	require.NoError(t, os.WriteFile(keyless, []byte("providers:\n  p: {type: openai, base_url: http://127.0.0.1:9/v1, api_key_env: GATEWAY_TEST_UNSET_KEY}\nmodels:\n  instant: {targets: [p/m]}\n"), 0o600))
	for name, env := range map[string]map[string]string{
		"upstream":    {"GATEWAY_UPSTREAM": "ftp://nowhere"},
		"multipliers": {"GATEWAY_MULTIPLIERS": "instant=1"},
		"model map":   {"GATEWAY_MODEL_MAP": "gpt=4"},
		"discount":    {"GATEWAY_BATCH_DISCOUNT": "2"},
		"file":        {"GATEWAY_CONFIG": filepath.Join(t.TempDir(), "missing.yaml")},
		"unset key":   {"GATEWAY_CONFIG": keyless},
		"proxies":     {"GATEWAY_TRUSTED_PROXIES": "10.0.0.0/8,lb.internal"},
	} {
		env["GATEWAY_LISTEN"] = "127.0.0.1:0"
		env["GATEWAY_METRICS_LISTEN"] = "off"
		env["DATABASE_URL"] = "postgres://gateway@127.0.0.1:1/none?connect_timeout=1"
		stdout, stderr, err := cliIn(t, "", env, "serve")
		out := stdout + stderr
		require.Error(t, err, name)
		require.Contains(t, out, "GATEWAY_", name)
		require.NotContains(t, out, "127.0.0.1:1", "%s: reported before the database is dialled", name)
	}
}

// devKey is the API key that g, a gateway dev, printed.
func (g *gateway) devKey() string {
	g.t.Helper()
	return strings.TrimSpace(strings.TrimPrefix(waitForLine(g.t, g.stdout, "API key:"), "API key:"))
}

// postmasterPID is the file that says the private PostgreSQL of the dev
// data folder dataDir runs.
func postmasterPID(dataDir string) string {
	return filepath.Join(dataDir, "postgres", "data", "postmaster.pid")
}

func TestDevRunsAndReusesItsData(t *testing.T) {
	t.Parallel()
	dataDir := filepath.Join(reachableTempDir(t), "data")
	run := func(revoke bool) string {
		// GATEWAY_DRAIN_DELAY empty: dev's own default, not the harness's.
		g := start(t, map[string]string{"GATEWAY_SIM_TOKEN_LATENCY": "0s", "GATEWAY_DRAIN_DELAY": ""}, "dev", "--data", dataDir, "--pg-port", "0")
		key := g.devKey()
		defer func() {
			if revoke {
				database := strings.TrimSpace(strings.TrimPrefix(waitForLine(t, g.stdout, "Database:"), "Database:"))
				mustCLI(t, database, "keys", "revoke", key[:12])
			}
			require.NoError(t, g.cmd.Process.Signal(syscall.SIGINT))
			require.NoError(t, <-g.done, "dev stops cleanly on Ctrl-C: %s", g.stderr.String())
			g.done <- nil
			require.Contains(t, g.stderr.String(), `"drain_delay":"0s"`, "with no load balancer in front, dev stops without waiting for one")
		}()
		require.Contains(t, g.stdout.String(), "curl -s "+g.base+"/api/v1/responses")
		require.Contains(t, g.stdout.String(), "(upstream: sim)")
		r := g.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "hello", "web_search": true})
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		require.Equal(t, "supported", r.object(t)["evidence_verdict"])
		return key
	}
	first := run(false)
	second := run(true)
	require.Equal(t, first, second, "a second run reuses the data and the key")
	require.NotEqual(t, second, run(false), "a key revoked meanwhile is replaced by one that works")
}

// TestDevOwnsItsFolder: a second `gateway dev` on the folder of one running
// is refused at once, with what to do; and a dev killed (-9) before it could
// stop its PostgreSQL leaves it running, holding the folder's data and
// port, until the next dev on the folder stops it and starts its own, which
// serves with the same key.
func TestDevOwnsItsFolder(t *testing.T) {
	t.Parallel()
	dataDir := filepath.Join(reachableTempDir(t), "data")
	env := map[string]string{"GATEWAY_SIM_TOKEN_LATENCY": "0s"}
	args := []string{"dev", "--data", dataDir, "--pg-port", "0"}
	first := start(t, env, args...)
	key := first.devKey()

	_, out, err := cliIn(t, "", map[string]string{"GATEWAY_LISTEN": fmt.Sprintf("127.0.0.1:%d", freePort(t)), "GATEWAY_METRICS_LISTEN": "off"}, args...)
	require.Error(t, err, "a second dev on the folder is refused: %s", out)
	require.Contains(t, out, "another gateway dev runs on "+dataDir)

	// Should the test end before a dev stops it, the killed dev's
	// PostgreSQL is not left running.
	t.Cleanup(func() { _, _ = pglocal.StopLeftover(context.Background(), filepath.Join(dataDir, "postgres")) })
	require.NoError(t, first.cmd.Process.Kill())
	<-first.done
	first.done <- nil
	postmaster := postmasterPID(dataDir)
	require.FileExists(t, postmaster, "the killed dev's PostgreSQL runs on")

	again := start(t, env, args...)
	require.Contains(t, again.stderr.String(), "stopped the PostgreSQL that a gateway dev which ended without stopping it (killed) left running")
	require.Equal(t, key, again.devKey())
	require.Equal(t, http.StatusOK, again.call(http.MethodPost, "/api/v1/responses", key, map[string]any{"prompt": "hello"}).status)
	require.NoError(t, again.stop())
	require.NoFileExists(t, postmaster)
}

// TestDevStopsWhenItsTerminalHangsUp: `gateway dev` (make run) runs in a
// terminal; closing it sends SIGHUP, which stops dev and its PostgreSQL as
// Ctrl-C does, instead of leaving both running, holding their ports, with no
// terminal. (`gateway serve` reloads its routes on SIGHUP.)
func TestDevStopsWhenItsTerminalHangsUp(t *testing.T) {
	t.Parallel()
	dataDir := filepath.Join(reachableTempDir(t), "data")
	g := start(t, map[string]string{"GATEWAY_SIM_TOKEN_LATENCY": "0s"}, "dev", "--data", dataDir, "--pg-port", "0")
	postmaster := postmasterPID(dataDir)
	require.FileExists(t, postmaster)

	require.NoError(t, g.cmd.Process.Signal(syscall.SIGHUP))
	select {
	case err := <-g.done:
		require.NoError(t, err, "a clean exit: %s", g.stderr.String())
		g.done <- err
	case <-time.After(30 * time.Second):
		t.Fatalf("still running 30 s after its terminal hung up: %s", g.stderr.String())
	}
	require.NoFileExists(t, postmaster, "its PostgreSQL stopped with it")
}
