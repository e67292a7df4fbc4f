// Package lostlines counts the log lines that could not be written: a replica
// whose log reader is gone (a broken pipe, a full disk) goes on serving, and
// says in its metrics how many lines it lost.
package lostlines

import (
	"bytes"
	"io"
	"sync/atomic"
)

// Writer passes writes to its output and counts the lines of those that
// failed. It is safe for concurrent use as long as its output is.
type Writer struct {
	out  io.Writer
	lost atomic.Uint64
}

// New returns a Writer to out.
func New(out io.Writer) *Writer {
	return &Writer{out: out}
}

// Write writes p to the output; when that fails, the lines of p not written
// whole are counted lost.
func (w *Writer) Write(p []byte) (int, error) {
	n, err := w.out.Write(p)
	if err != nil {
		w.lost.Add(uint64(bytes.Count(p[min(max(n, 0), len(p)):], []byte{'\n'})))
	}
	return n, err
}

// Lost is how many lines failed writes have lost so far.
func (w *Writer) Lost() uint64 {
	return w.lost.Load()
}
