package e2e

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBehindTheExampleLoadBalancer runs a replica behind nginx with
// deploy/nginx.conf (the load balancer of docker-compose.yml): a stream's
// events pass one by one, uncompressed (keep-alive comments of a few bytes
// reach the client while the upstream holds its first token, which a
// buffering proxy would keep; the configuration's proxy_buffering off and
// the replica's X-Accel-Buffering: no each see to it), and a batch's results
// come gzip-compressed to a client that accepts it, the same JSON as the
// replica's, and plain to one that does not. Skipped where nginx is not
// installed.
func TestBehindTheExampleLoadBalancer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.fake.SetChunkDelay(time.Hour) // streams hold their first token
	g := serve(t, b.db, b.fake.BaseURL(), map[string]string{"GATEWAY_SSE_KEEPALIVE": "100ms"})
	lb := &gateway{t: t, base: exampleLoadBalancer(t, g.base)}
	plain := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(plain.CloseIdleConnections)

	t.Run("StreamsPassAsTheyCome", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, lb.base+"/api/v1/responses",
			strings.NewReader(`{"prompt": "held at the upstream", "stream": true}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+b.key)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept-Encoding", "gzip")
		resp, err := plain.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
		require.Empty(t, resp.Header.Get("Content-Encoding"), "a stream is never compressed")
		lines := bufio.NewScanner(resp.Body)
		for comments := 0; comments < 3; {
			require.True(t, lines.Scan(), "the stream ended or stalled before its keep-alives came: %v", lines.Err())
			if strings.HasPrefix(lines.Text(), ":") {
				comments++
			}
		}
	})

	t.Run("ResultsCompressedForWhoAcceptsIt", func(t *testing.T) {
		batch := lb.createBatch(b.key, prompts("a batch read through the load balancer,", 40))
		lb.waitTerminal(b.key, batch.Id.String(), 60*time.Second)
		path := "/api/v1/batch/" + batch.Id.String() + "/results"
		direct := g.call(http.MethodGet, path, b.key, nil)
		require.Equal(t, http.StatusOK, direct.status)
		require.Greater(t, len(direct.body), 4<<10, "large enough to be compressed")

		get := func(encoding string) (*http.Response, []byte) {
			req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, lb.base+path, nil)
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+b.key)
			if encoding != "" {
				req.Header.Set("Accept-Encoding", encoding)
			}
			resp, err := plain.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
			return resp, body
		}
		resp, body := get("gzip")
		require.Equal(t, "gzip", resp.Header.Get("Content-Encoding"))
		require.Contains(t, resp.Header.Values("Vary"), "Accept-Encoding")
		require.Less(t, len(body), len(direct.body))
		unzipped, err := gzip.NewReader(bytes.NewReader(body))
		require.NoError(t, err)
		text, err := io.ReadAll(unzipped)
		require.NoError(t, err)
		require.JSONEq(t, string(direct.body), string(text))

		resp, body = get("")
		require.Empty(t, resp.Header.Get("Content-Encoding"))
		require.JSONEq(t, string(direct.body), string(body))
	})
}

// exampleLoadBalancer runs nginx with deploy/nginx.conf in front of the
// replica at upstream, rewritten only where the test's machine differs from
// docker-compose's (its resolver and the replica's name, the port, and the
// files nginx writes), and returns its base URL. A port another process took
// first is given up for another, as start does. It skips the test where
// nginx is not installed.
func exampleLoadBalancer(t *testing.T, upstream string) string {
	t.Helper()
	binary, err := exec.LookPath("nginx")
	if err != nil {
		if _, statErr := os.Stat("/usr/sbin/nginx"); statErr != nil {
			t.Skip("nginx is not installed: the example load balancer is not exercised")
		}
		binary = "/usr/sbin/nginx"
	}
	conf, err := os.ReadFile(filepath.Join("..", "deploy", "nginx.conf"))
	require.NoError(t, err)
	for attempt := 1; ; attempt++ {
		addr, errorLog, ok := startNginx(t, binary, string(conf), upstream)
		if ok {
			return "http://" + addr
		}
		if !strings.Contains(errorLog, "Address already in use") || attempt == 3 {
			t.Fatalf("nginx did not start; its log:\n%s", errorLog)
		}
	}
}

// startNginx starts nginx with conf, rewritten for this machine and a free
// port, and waits until it listens (it writes its pid file once it holds
// its port) or exits. It returns its address, and its error log when it
// did not start.
func startNginx(t *testing.T, binary, conf, upstream string) (addr, errorLog string, ok bool) {
	t.Helper()
	dir := t.TempDir()
	addr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	pidFile := filepath.Join(dir, "nginx.pid")
	for old, replacement := range map[string]string{
		"resolver 127.0.0.11 valid=5s ipv6=off;": "resolver 127.0.0.1;",
		"http://gateway:8080":                    upstream,
		"listen 8080;":                           "listen " + addr + ";",
		"events {":                               "pid " + pidFile + ";\nevents {",
		"http {": fmt.Sprintf("http {\n    access_log off;\n    client_body_temp_path %[1]s/body;\n    proxy_temp_path %[1]s/proxy;\n"+
			"    fastcgi_temp_path %[1]s/fastcgi;\n    uwsgi_temp_path %[1]s/uwsgi;\n    scgi_temp_path %[1]s/scgi;", dir),
	} {
		require.Equal(t, 1, strings.Count(conf, old), "deploy/nginx.conf has %q once", old)
		conf = strings.Replace(conf, old, replacement, 1)
	}
	path := filepath.Join(dir, "nginx.conf")
	require.NoError(t, os.WriteFile(path, []byte(conf), 0o600))
	logPath := filepath.Join(dir, "error.log")
	cmd := exec.Command(binary, "-c", path, "-e", logPath, "-g", "daemon off;")
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM) // the master stops its workers
		<-exited
	})
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(pidFile); err == nil {
			return addr, "", true
		}
		select {
		case <-exited:
			log, err := os.ReadFile(logPath)
			require.NoError(t, err)
			return addr, string(log), false
		default:
		}
	}
	log, _ := os.ReadFile(logPath)
	t.Fatalf("nginx neither listens nor has exited after 10 s; its log:\n%s", log)
	return
}
