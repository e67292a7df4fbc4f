package main

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

// The bare proxy is the floor the gateway's figures are read against, in the
// same run: the least any gateway must do that answers with the upstream's
// output and bills it. It reads the client's JSON, sends the upstream one
// call over a kept-alive connection, reads its reply, commits one row to the
// same PostgreSQL (the same durability) and answers with the content and
// the token counts. It has no keys, limits, estimates, evidence, logs or
// metrics, and commits a row a request with no grouping. Where it adds more
// than a goal allows, no gateway that commits before it answers meets that
// goal on the machine of that run.
//
// It runs as this program started again with floorVar set to the upstream's
// URL (and DATABASE_URL), in a process of its own, so that its CPU is
// counted apart as the gateway's is.

// floorVar names the variable that makes this program the bare proxy.
const floorVar = "BENCH_LOAD_FLOOR_UPSTREAM"

// floorProcess is a started bare proxy.
type floorProcess struct {
	base string
	pid  int
	cmd  *exec.Cmd
}

// startFloor starts the bare proxy with the database of vars (the gateway's
// environment) in front of upstream, and returns once it listens.
func startFloor(vars []string, upstream string) (*floorProcess, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("error finding this program: %w", err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(append(os.Environ(), vars...), floorVar+"="+upstream)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("error starting the bare proxy: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("error starting the bare proxy: %w", err)
	}
	p := &floorProcess{pid: cmd.Process.Pid, cmd: cmd}
	line, err := bufio.NewReader(out).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if err != nil || !ok {
		p.stop()
		return nil, fmt.Errorf("the bare proxy did not start (it said %q): %w", line, err)
	}
	p.base = "http://" + addr
	return p, nil
}

// stop kills the bare proxy and waits for it.
func (p *floorProcess) stop() {
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
}

// serveFloor runs this process as the bare proxy in front of upstream until
// it is killed; it writes "listening ADDR" on a line once it accepts.
func serveFloor(upstream string) error {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		return fmt.Errorf("error reading DATABASE_URL: %w", err)
	}
	// A connection for each of the saturation's clients: commits sent
	// together share PostgreSQL's flushes, the grouping a server gives free.
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("error connecting to PostgreSQL: %w", err)
	}
	q := floordb.New()
	if err := q.CreateFloorTable(ctx, pool); err != nil {
		return fmt.Errorf("error creating the bare proxy's table: %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("error listening: %w", err)
	}
	fmt.Printf("listening %s\n", l.Addr())
	f := &floor{
		upstream: upstream + "/chat/completions",
		client:   &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute}},
		pool:     pool,
		queries:  q,
	}
	srv := &http.Server{Handler: f, ReadHeaderTimeout: 10 * time.Second}
	return srv.Serve(l)
}

// floor is the bare proxy's handler.
type floor struct {
	upstream string
	client   *http.Client
	pool     *pgxpool.Pool
	queries  *floordb.Queries
}

// floorRequest is what the bare proxy reads of a request, the gateway's shape.
type floorRequest struct {
	Prompt         string `json:"prompt"`
	MaxOutputRungs int    `json:"max_output_rungs"`
}

// floorUpstreamReply is what it reads of the upstream's reply.
type floorUpstreamReply struct {
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

func (f *floor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	reply, err := f.proxy(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(reply)
}

// proxy runs one request: the upstream call, the row committed, the reply.
func (f *floor) proxy(r *http.Request) ([]byte, error) {
	var in floorRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&in); err != nil {
		return nil, fmt.Errorf("error reading the request: %w", err)
	}
	call, err := json.Marshal(map[string]any{
		"model":                 "instant",
		"max_completion_tokens": in.MaxOutputRungs,
		"messages":              []map[string]string{{"role": "user", "content": in.Prompt}},
	})
	if err != nil {
		return nil, fmt.Errorf("error writing the upstream call: %w", err)
	}
	resp, err := f.client.Post(f.upstream, "application/json", bytes.NewReader(call))
	if err != nil {
		return nil, fmt.Errorf("error calling the upstream: %w", err)
	}
	defer resp.Body.Close()
	var up floorUpstreamReply
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&up); err != nil {
		return nil, fmt.Errorf("error reading the upstream's reply: %w", err)
	}
	if resp.StatusCode != http.StatusOK || len(up.Choices) == 0 {
		return nil, errors.New("the upstream failed")
	}
	id := uuid.Must(uuid.NewV7())
	if err := f.queries.InsertFloorRow(r.Context(), f.pool, floordb.InsertFloorRowParams{
		RequestID: id, TotalTokens: up.Usage.PromptTokens + up.Usage.CompletionTokens,
	}); err != nil {
		return nil, fmt.Errorf("error committing the row: %w", err)
	}
	return json.Marshal(map[string]any{
		"request_id": id,
		"content":    up.Choices[0].Message.Content,
		"usage":      map[string]int64{"input_tokens": up.Usage.PromptTokens, "output_tokens": up.Usage.CompletionTokens},
	})
}
