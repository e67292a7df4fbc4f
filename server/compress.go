package server

import (
	"bytes"
	"cmp"
	"compress/gzip"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/labstack/echo/v4"
)

// CompressMinBytes is the least a reply holds for it to be compressed, as
// the example load balancer has it (deploy/nginx.conf). A shorter one (most
// replies to a response request, every error) is sent as it is: it would
// save a few hundred bytes for the compressor's fixed work, some 10 µs.
// Longer ones (batch results, long outputs, batch lists, the two documents)
// shrink several times over.
const CompressMinBytes = 4 << 10

// gzipWriters are the compressors of replies being compressed. The fastest
// level: JSON of natural text shrinks most of what the slower levels would
// shrink it, for a fraction of their CPU.
var gzipWriters = sync.Pool{New: func() any {
	w, _ := gzip.NewWriterLevel(nil, gzip.BestSpeed)
	return w
}}

// pendingReplies are the buffers of replies not yet long enough to compress.
var pendingReplies = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// compressReplies gzips a reply of CompressMinBytes or more when its
// request accepts gzip (Accept-Encoding). An event stream never is: it
// flushes its head before its first event (D9), and a reply flushed before
// it is long enough goes as it is, its events as they are written. Every
// reply says it varies by Accept-Encoding, for caches.
func compressReplies(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		res := c.Response()
		res.Header().Add("Vary", "Accept-Encoding")
		if !acceptsGzip(c.Request().Header.Values("Accept-Encoding")) {
			return next(c)
		}
		z := &compressing{w: res.Writer}
		res.Writer = z
		defer func() {
			res.Writer = z.w
			if p := recover(); p != nil {
				// A reply cut short on purpose (http.ErrAbortHandler) is
				// left unfinished: no gzip trailer makes it look whole.
				z.drop()
				panic(p)
			}
			z.end()
		}()
		return next(c)
	}
}

// acceptsGzip reports whether Accept-Encoding values accept gzip (or its
// alias x-gzip), by name or by *, with a weight above 0 (RFC 9110 §12.5.3),
// reading them in place (no allocation).
func acceptsGzip(values []string) bool {
	gzipQ, anyQ := -1.0, -1.0
	for _, v := range values {
		for v != "" {
			var coding string
			coding, v, _ = strings.Cut(v, ",")
			name, params, _ := strings.Cut(coding, ";")
			q := 1.0
			for params != "" {
				var param string
				param, params, _ = strings.Cut(params, ";")
				if k, val, ok := strings.Cut(param, "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
					var err error
					if q, err = strconv.ParseFloat(strings.TrimSpace(val), 64); err != nil || !(q >= 0 && q <= 1) {
						q = 0 // a weight that is no weight (RFC 9110: 0 to 1) accepts nothing
					}
				}
			}
			switch name = strings.TrimSpace(name); {
			case strings.EqualFold(name, "gzip"), strings.EqualFold(name, "x-gzip"):
				gzipQ = max(gzipQ, q)
			case name == "*":
				anyQ = max(anyQ, q)
			}
		}
	}
	if gzipQ >= 0 {
		return gzipQ > 0
	}
	return anyQ > 0
}

// compressing is the writer of a reply that may be compressed: it holds the
// reply's status and first bytes until they would reach CompressMinBytes,
// then gzips them and what follows; a reply that ends (or is flushed)
// shorter goes as it is, and so does what follows a flush.
type compressing struct {
	w      http.ResponseWriter
	status int           // the status held, 0 until it is written
	held   *bytes.Buffer // the bytes held, nil once the reply has begun
	gz     *gzip.Writer  // the compressor of a reply compressed
	begun  bool          // the status reached w
}

// Header implements http.ResponseWriter.
func (z *compressing) Header() http.Header { return z.w.Header() }

// WriteHeader implements http.ResponseWriter. An informational status goes
// at once; a final one is held with the reply's first bytes.
func (z *compressing) WriteHeader(code int) {
	if z.begun || code < http.StatusOK {
		z.w.WriteHeader(code)
		return
	}
	z.status = code
}

// Write implements http.ResponseWriter.
func (z *compressing) Write(p []byte) (int, error) {
	if !z.begun && z.status == 0 {
		z.WriteHeader(http.StatusOK)
	}
	switch {
	case z.gz != nil:
		return z.gz.Write(p)
	case z.begun:
		return z.w.Write(p)
	}
	if z.held == nil {
		z.held = pendingReplies.Get().(*bytes.Buffer)
	}
	if z.held.Len()+len(p) < CompressMinBytes {
		return z.held.Write(p)
	}
	// Long enough: what was held, then p, compressed (a buffer never holds
	// more than CompressMinBytes).
	z.begin(z.status, true)
	if err := z.release(); err != nil {
		return 0, err
	}
	return z.gz.Write(p)
}

// FlushError implements the flushing http.ResponseController calls: a reply
// still held goes as it is, since what follows may take long to come (a
// flush before any status sends 200, as net/http's does).
func (z *compressing) FlushError() error {
	if !z.begun {
		z.begin(cmp.Or(z.status, http.StatusOK), false)
		if err := z.release(); err != nil {
			return err
		}
	}
	if z.gz != nil {
		if err := z.gz.Flush(); err != nil {
			return err
		}
	}
	return http.NewResponseController(z.w).Flush()
}

// Unwrap lets http.ResponseController reach the connection's writer (write
// deadlines, hijacking).
func (z *compressing) Unwrap() http.ResponseWriter { return z.w }

// begin writes the status, compressed or not.
func (z *compressing) begin(code int, compress bool) {
	if compress {
		h := z.Header()
		h.Set("Content-Encoding", "gzip")
		h.Del("Content-Length")
		z.gz = gzipWriters.Get().(*gzip.Writer)
		z.gz.Reset(z.w)
	}
	z.w.WriteHeader(code)
	z.begun = true
}

// release writes what was held, if anything, and gives its buffer back.
func (z *compressing) release() error {
	if z.held == nil {
		return nil
	}
	var err error
	if z.gz != nil {
		_, err = z.gz.Write(z.held.Bytes())
	} else {
		_, err = z.w.Write(z.held.Bytes())
	}
	z.putHeld()
	return err
}

// end finishes the reply once its handler returned: what is held goes as it
// is, a compressed reply gets its end. Errors are the connection's, which
// net/http reports.
func (z *compressing) end() {
	if !z.begun && z.status != 0 {
		z.begin(z.status, false)
	}
	_ = z.release()
	if z.gz != nil {
		_ = z.gz.Close()
		z.putCompressor()
	}
}

// drop gives back what the reply held without writing it.
func (z *compressing) drop() {
	if z.held != nil {
		z.putHeld()
	}
	if z.gz != nil {
		z.putCompressor()
	}
}

// putHeld gives the buffer of the bytes held back to its pool.
func (z *compressing) putHeld() {
	z.held.Reset()
	pendingReplies.Put(z.held)
	z.held = nil
}

// putCompressor gives the compressor back to its pool.
func (z *compressing) putCompressor() {
	z.gz.Reset(io.Discard)
	gzipWriters.Put(z.gz)
	z.gz = nil
}
