package server

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCompressingWriter: a reply is held until it is CompressMinBytes long,
// then gzipped whole, however it was written; one that ends shorter goes as
// it is, with its status; a flush sends what is held as it is (before any
// status, with 200, as net/http does) and what follows too, and a flush of
// a compressed reply sends what it has compressed; each reaches the
// connection. A reply dropped writes nothing.
func TestCompressingWriter(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("0123456789abcdef", CompressMinBytes/16)
	// flush flushes z, and requires the flush to reach the connection.
	flush := func(z *compressing) {
		require.NoError(t, http.NewResponseController(z).Flush())
		require.True(t, z.w.(*httptest.ResponseRecorder).Flushed, "the flush reaches the connection")
	}
	for _, tc := range []struct {
		name       string
		write      func(z *compressing)
		status     int
		compressed bool
		body       string
	}{{
		name:   "short",
		write:  func(z *compressing) { z.WriteHeader(http.StatusAccepted); _, _ = z.Write([]byte("short")) },
		status: http.StatusAccepted, body: "short",
	}, {
		name: "long, in pieces",
		write: func(z *compressing) {
			z.WriteHeader(http.StatusCreated)
			for _, piece := range []string{"{", long[:100], long[100:], "}"} {
				_, _ = z.Write([]byte(piece))
			}
		},
		status: http.StatusCreated, compressed: true, body: "{" + long + "}",
	}, {
		name:   "long, without a status",
		write:  func(z *compressing) { _, _ = z.Write([]byte(long)) },
		status: http.StatusOK, compressed: true, body: long,
	}, {
		name: "flushed short, then long",
		write: func(z *compressing) {
			z.WriteHeader(http.StatusOK)
			_, _ = z.Write([]byte("head"))
			flush(z)
			_, _ = z.Write([]byte(long))
		},
		status: http.StatusOK, body: "head" + long,
	}, {
		name: "flushed before a status",
		write: func(z *compressing) {
			flush(z)
			_, _ = z.Write([]byte(long))
		},
		status: http.StatusOK, body: long,
	}, {
		name: "long, flushed, then more",
		write: func(z *compressing) {
			_, _ = z.Write([]byte(long))
			flush(z)
			_, _ = z.Write([]byte("tail"))
		},
		status: http.StatusOK, compressed: true, body: long + "tail",
	}, {
		name:   "nothing",
		write:  func(*compressing) {},
		status: http.StatusOK, body: "",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			z := &compressing{w: rec}
			tc.write(z)
			z.end()
			require.Equal(t, tc.status, rec.Code)
			body := rec.Body.Bytes()
			if tc.compressed {
				require.Equal(t, "gzip", rec.Header().Get("Content-Encoding"))
				zr, err := gzip.NewReader(bytes.NewReader(body))
				require.NoError(t, err)
				body, err = io.ReadAll(zr)
				require.NoError(t, err)
			} else {
				require.Empty(t, rec.Header().Get("Content-Encoding"))
			}
			require.Equal(t, tc.body, string(body))
		})
	}

	t.Run("dropped", func(t *testing.T) {
		for _, n := range []int{10, len(long)} {
			rec := httptest.NewRecorder()
			z := &compressing{w: rec}
			_, _ = z.Write([]byte(long[:n]))
			z.drop()
			if n < CompressMinBytes {
				require.False(t, rec.Flushed)
				require.Empty(t, rec.Body.Bytes(), "nothing held is written")
				continue
			}
			zr, err := gzip.NewReader(bytes.NewReader(rec.Body.Bytes()))
			if err == nil {
				_, err = io.ReadAll(zr)
			}
			require.Error(t, err, "a compressed reply dropped has no end")
		}
	})
}
