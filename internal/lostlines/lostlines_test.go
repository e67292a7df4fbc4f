package lostlines_test

import (
	"errors"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/lostlines"
)

// partial writes its first n bytes of each write, then fails.
type partial struct{ n int }

func (p partial) Write(b []byte) (int, error) {
	return min(p.n, len(b)), errors.New("disk full")
}

func TestLinesOfFailedWritesAreCounted(t *testing.T) {
	t.Parallel()
	t.Run("written", func(t *testing.T) {
		t.Parallel()
		r, w, err := os.Pipe()
		require.NoError(t, err)
		defer r.Close()
		lw := lostlines.New(w)
		n, err := lw.Write([]byte("one\ntwo\n"))
		require.NoError(t, err)
		require.Equal(t, 8, n)
		require.Zero(t, lw.Lost())
		require.NoError(t, w.Close())
	})
	t.Run("broken pipe", func(t *testing.T) {
		t.Parallel()
		r, w, err := os.Pipe()
		require.NoError(t, err)
		defer w.Close()
		require.NoError(t, r.Close()) // the reader is gone
		lw := lostlines.New(w)
		_, err = lw.Write([]byte("one\ntwo\n"))
		require.ErrorIs(t, err, syscall.EPIPE)
		_, err = lw.Write([]byte("three\n"))
		require.Error(t, err)
		require.EqualValues(t, 3, lw.Lost())
	})
	t.Run("partly written", func(t *testing.T) {
		t.Parallel()
		lw := lostlines.New(partial{n: 6}) // "one\ntw" written
		n, err := lw.Write([]byte("one\ntwo\nthree\n"))
		require.Error(t, err)
		require.Equal(t, 6, n)
		require.EqualValues(t, 2, lw.Lost(), "the line cut and the one after it")
		lw = lostlines.New(partial{n: 0})
		_, err = lw.Write([]byte("no end"))
		require.Error(t, err)
		require.Zero(t, lw.Lost(), "no line ended in it")
	})
}
