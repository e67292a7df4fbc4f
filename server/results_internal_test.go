package server

import (
	"bytes"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// deadlineRecorder is a response that records, for each write deadline set,
// how many bytes had been written before it.
type deadlineRecorder struct {
	*httptest.ResponseRecorder
	at []int
}

func (d *deadlineRecorder) SetWriteDeadline(time.Time) error {
	d.at = append(d.at, d.Body.Len())
	return nil
}

// TestStridedWriterRenewsItsDeadline: a results reply's write deadline is
// renewed before each resultsStride written and before a write that comes
// late, so a client has ReplyWriteTimeout for each stride, not the whole;
// what is written is written whole, in order.
func TestStridedWriterRenewsItsDeadline(t *testing.T) {
	t.Parallel()
	t.Run("EachStride", func(t *testing.T) {
		t.Parallel()
		rec := &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
		out := &stridedWriter{w: rec, timeout: time.Hour, set: time.Now()}
		big := bytes.Repeat([]byte("0123456789abcdef"), (3*resultsStride+100)/16)
		require.NoError(t, out.write([]byte("head")))
		require.NoError(t, out.write(big))
		require.NoError(t, out.write([]byte("tail")))
		head := len("head")
		require.Equal(t, []int{head + resultsStride, head + 2*resultsStride, head + 3*resultsStride}, rec.at,
			"the first stride under the deadline the reply started with (observe's)")
		require.Equal(t, "head"+string(big)+"tail", rec.Body.String())
	})
	t.Run("SmallRepliesKeepTheirFirst", func(t *testing.T) {
		t.Parallel()
		rec := &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
		out := &stridedWriter{w: rec, timeout: time.Hour, set: time.Now()}
		for range 100 {
			require.NoError(t, out.write(bytes.Repeat([]byte("x"), 500)))
		}
		require.Empty(t, rec.at)
		require.Equal(t, 50_000, rec.Body.Len())
	})
	t.Run("LateWrites", func(t *testing.T) {
		t.Parallel()
		rec := &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
		// Long enough that a busy machine's pause between the writer's start
		// and its first write stays under a quarter of it.
		const timeout = 400 * time.Millisecond
		out := &stridedWriter{w: rec, timeout: timeout, set: time.Now()}
		require.NoError(t, out.write([]byte("a page")))
		time.Sleep(timeout / 2) // a page read, a long item encoded
		require.NoError(t, out.write([]byte("the next")))
		require.Equal(t, []int{len("a page")}, rec.at, "renewed before the late write")
	})
}
