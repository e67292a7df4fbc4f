// Package floor is the bare proxy that the benchmarks measure beside the
// gateway, in the same run, as the floor of its figures: the least any
// gateway must do that answers with the upstream's output and bills it.
//
// Per request it reads the client's JSON (the gateway's shape), sends the
// upstream one call over a kept-alive connection, and commits one row to
// the same PostgreSQL (the same durability): before it answers with the
// content and the token counts, or, for a stream, after relaying the
// upstream's events as they come. It has no keys, limits, estimates,
// evidence, logs or metrics, and commits a row a request with no grouping.
// Where it adds more than a goal allows, no gateway that commits before it
// answers meets that goal on the machine of that run.
//
// It runs as the benchmark's own program started again with Var set to the
// upstream's URL (and DATABASE_URL), in a process of its own, so that its
// CPU is counted apart as the gateway's is: a benchmark's main calls
// ServeIfAsked first.
package floor

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway/gen/floordb"
)

// Var names the variable that makes a benchmark's program the bare proxy.
const Var = "BENCH_FLOOR_UPSTREAM"

// Process is a started bare proxy.
type Process struct {
	// Base is its base URL; it answers on every path.
	Base string
	PID  int
	cmd  *exec.Cmd
	// alive is the proxy's standard input, held open while it is to run:
	// when this program ends, however it ends, the proxy reads its end and
	// ends too.
	alive io.WriteCloser
}

// Start starts the bare proxy with the database of vars (the gateway's
// environment) in front of upstream, and returns once it listens.
func Start(vars []string, upstream string) (*Process, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("error finding this program: %w", err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(append(os.Environ(), vars...), Var+"="+upstream)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("error starting the bare proxy: %w", err)
	}
	alive, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("error starting the bare proxy: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("error starting the bare proxy: %w", err)
	}
	p := &Process{PID: cmd.Process.Pid, cmd: cmd, alive: alive}
	line, err := bufio.NewReader(out).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if err != nil || !ok {
		p.Stop()
		return nil, fmt.Errorf("the bare proxy did not start (it said %q): %w", line, err)
	}
	p.Base = "http://" + addr
	return p, nil
}

// Stop kills the bare proxy and waits for it.
func (p *Process) Stop() {
	_ = p.cmd.Process.Kill()
	_ = p.alive.Close()
	_ = p.cmd.Wait()
}

// ServeIfAsked makes this process the bare proxy when Var is set: it serves
// until killed or until its standard input ends (the program that started
// it has ended), and never returns. Otherwise it returns at once.
func ServeIfAsked() {
	upstream := os.Getenv(Var)
	if upstream == "" {
		return
	}
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	err := serve(upstream)
	fmt.Fprintln(os.Stderr, "bare proxy:", err)
	os.Exit(1)
}

// serve runs the bare proxy in front of upstream; it writes "listening
// ADDR" on a line once it accepts.
func serve(upstream string) error {
	p, err := newProxy(context.Background(), os.Getenv("DATABASE_URL"), upstream)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("error listening: %w", err)
	}
	fmt.Printf("listening %s\n", l.Addr())
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	return srv.Serve(l)
}

// newProxy connects to the database at databaseURL, makes the bare proxy's
// table there and returns the proxy in front of upstream.
func newProxy(ctx context.Context, databaseURL, upstream string) (*proxy, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("error reading the database's URL: %w", err)
	}
	// A connection for each of a saturation's clients: commits sent
	// together share PostgreSQL's flushes, the grouping a server gives free.
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("error connecting to PostgreSQL: %w", err)
	}
	q := floordb.New()
	if err := q.CreateFloorTable(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("error creating the bare proxy's table: %w", err)
	}
	return &proxy{
		upstream: upstream + "/chat/completions",
		client:   &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute}},
		pool:     pool,
		queries:  q,
	}, nil
}

// proxy is the bare proxy's handler.
type proxy struct {
	upstream string
	client   *http.Client
	pool     *pgxpool.Pool
	queries  *floordb.Queries
}

// request is what the bare proxy reads of a request, the gateway's shape.
type request struct {
	Prompt         string `json:"prompt"`
	MaxOutputRungs int    `json:"max_output_rungs"`
	Stream         bool   `json:"stream"`
}

// reply is what it reads of the upstream's reply, or of a stream's event.
type reply struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int64 `json:"prompt_tokens"`
		CompletionTokens int64 `json:"completion_tokens"`
	} `json:"usage"`
}

// ServeHTTP runs one request: whole, or streamed when it asks to be.
func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var in request
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&in); err != nil {
		http.Error(w, "error reading the request: "+err.Error(), http.StatusBadRequest)
		return
	}
	if in.Stream {
		p.stream(r.Context(), w, in)
		return
	}
	resp, err := p.call(in)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	body, err := p.answer(r.Context(), resp.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// call sends the upstream the request's one call.
func (p *proxy) call(in request) (*http.Response, error) {
	call := map[string]any{
		"model":                 "instant",
		"max_completion_tokens": in.MaxOutputRungs,
		"messages":              []map[string]string{{"role": "user", "content": in.Prompt}},
	}
	if in.Stream {
		call["stream"] = true
		call["stream_options"] = map[string]bool{"include_usage": true}
	}
	body, err := json.Marshal(call)
	if err != nil {
		return nil, fmt.Errorf("error writing the upstream call: %w", err)
	}
	resp, err := p.client.Post(p.upstream, "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("error calling the upstream: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("the upstream answered %d", resp.StatusCode)
	}
	return resp, nil
}

// answer reads a whole reply, commits its row and returns the answer.
func (p *proxy) answer(ctx context.Context, body io.Reader) ([]byte, error) {
	var up reply
	if err := json.NewDecoder(io.LimitReader(body, 1<<20)).Decode(&up); err != nil {
		return nil, fmt.Errorf("error reading the upstream's reply: %w", err)
	}
	if len(up.Choices) == 0 {
		return nil, errors.New("the upstream's reply has no choice")
	}
	id, err := p.commit(ctx, up)
	if err != nil {
		return nil, err
	}
	return json.Marshal(map[string]any{
		"request_id": id,
		"content":    up.Choices[0].Message.Content,
		"usage":      map[string]int64{"input_tokens": up.Usage.PromptTokens, "output_tokens": up.Usage.CompletionTokens},
	})
}

// stream sends the head of a stream before it calls the upstream, as the
// interface has it (and as the gateway does), passes the upstream's lines on
// as they come, then commits its row with the usage of its last event that
// has one.
func (p *proxy) stream(ctx context.Context, w http.ResponseWriter, in request) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	if flusher != nil {
		flusher.Flush()
	}
	resp, err := p.call(in)
	if err != nil {
		fmt.Fprintf(w, "event: error\ndata: %q\n\n", err.Error())
		return
	}
	defer resp.Body.Close()
	var usage reply
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	newline := []byte{'\n'}
	for sc.Scan() {
		line := sc.Bytes()
		if data, ok := bytes.CutPrefix(line, []byte("data: ")); ok && bytes.Contains(data, []byte(`"usage"`)) {
			_ = json.Unmarshal(data, &usage)
		}
		_, _ = w.Write(line)
		if _, err := w.Write(newline); err != nil {
			return
		}
		if len(line) == 0 && flusher != nil {
			flusher.Flush()
		}
	}
	if _, err := p.commit(ctx, usage); err != nil {
		fmt.Fprintf(w, "event: error\ndata: %q\n\n", err.Error())
	}
}

// commit stores the request's row.
func (p *proxy) commit(ctx context.Context, up reply) (uuid.UUID, error) {
	id := uuid.Must(uuid.NewV7())
	err := p.queries.InsertFloorRow(ctx, p.pool, floordb.InsertFloorRowParams{
		RequestID: id, TotalTokens: up.Usage.PromptTokens + up.Usage.CompletionTokens,
	})
	if err != nil {
		return id, fmt.Errorf("error committing the row: %w", err)
	}
	return id, nil
}
