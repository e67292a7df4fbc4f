package logbuffer

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// recorder keeps each write it is given apart.
type recorder struct {
	mu     sync.Mutex
	writes []string
}

func (r *recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.writes = append(r.writes, string(p))
	return len(p), nil
}

func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.writes...)
}

func TestLinesGoOutTogetherInOrder(t *testing.T) {
	t.Parallel()
	out := &recorder{}
	w := New(out, time.Hour)
	for i := range 100 {
		_, err := fmt.Fprintf(w, "line %d\n", i)
		require.NoError(t, err)
	}
	require.Empty(t, out.all(), "lines wait for their delay")
	require.NoError(t, w.Flush())
	writes := out.all()
	require.Len(t, writes, 1)
	var want strings.Builder
	for i := range 100 {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	require.Equal(t, want.String(), writes[0])
	require.NoError(t, w.Flush())
	require.Len(t, out.all(), 1, "nothing waits: nothing is written")
}

func TestALineGoesOutAfterItsDelay(t *testing.T) {
	t.Parallel()
	out := &recorder{}
	w := New(out, time.Millisecond)
	_, err := w.Write([]byte("first\n"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(out.all()) == 1 }, 10*time.Second, time.Millisecond)
	_, err = w.Write([]byte("second\n"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(out.all()) == 2 }, 10*time.Second, time.Millisecond,
		"a line after a write waits its own delay")
	require.Equal(t, []string{"first\n", "second\n"}, out.all())
}

func TestAFullBufferGoesOutAtOnce(t *testing.T) {
	t.Parallel()
	out := &recorder{}
	w := New(out, time.Hour)
	line := bytes.Repeat([]byte("x"), 1023)
	line = append(line, '\n')
	for range maxBuffered / len(line) {
		_, err := w.Write(line)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return len(out.all()) == 1 }, 10*time.Second, time.Millisecond,
		"the line that filled the buffer sent it out, without its delay (an hour)")
	require.Len(t, out.all()[0], maxBuffered)
}

// stalled is an output whose writes wait until it is opened, as a pipe's do
// once its reader stops reading.
type stalled struct {
	recorder
	entered chan struct{} // a write has begun
	open    chan struct{}
}

func newStalled() *stalled {
	return &stalled{entered: make(chan struct{}, 1), open: make(chan struct{})}
}

func (s *stalled) Write(p []byte) (int, error) {
	select {
	case s.entered <- struct{}{}:
	default:
	}
	<-s.open
	return s.recorder.Write(p)
}

// stall returns a Writer whose limit is 100 bytes and whose output blocks
// in the write of a first line, "first\n".
func stall(t *testing.T) (*stalled, *Writer) {
	t.Helper()
	out := newStalled()
	w := New(out, time.Millisecond)
	w.limit = 100
	_, err := w.Write([]byte("first\n"))
	require.NoError(t, err)
	<-out.entered
	return out, w
}

// writeLines writes n lines of 8 bytes each to w: prefix (4 bytes) and their
// numbers from 0.
func writeLines(w io.Writer, prefix string, n int) {
	for i := range n {
		_, _ = fmt.Fprintf(w, "%s %02d\n", prefix, i)
	}
}

// lines is what writeLines writes.
func lines(prefix string, n int) string {
	var b strings.Builder
	writeLines(&b, prefix, n)
	return b.String()
}

// requireWrittenAfterStall lets the output of stall take writes again and
// requires it to hold, once w is flushed, its first line and then want.
func requireWrittenAfterStall(t *testing.T, out *stalled, w *Writer, want string) {
	t.Helper()
	close(out.open)
	require.NoError(t, w.Flush())
	require.Equal(t, "first\n"+want, strings.Join(out.all(), ""))
}

// TestAStalledOutputHoldsUpNoWriter: while the output blocks, writes return
// at once; past the limit, lines are dropped and counted; once it takes
// writes again, the lines kept go out in their order.
func TestAStalledOutputHoldsUpNoWriter(t *testing.T) {
	t.Parallel()
	out, w := stall(t)
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		writeLines(w, "line", 30) // 12 fit the limit
	}()
	select {
	case <-wrote:
	case <-time.After(time.Minute):
		t.Fatal("a write waited for the stalled output")
	}
	require.EqualValues(t, 18, w.Dropped())
	requireWrittenAfterStall(t, out, w, lines("line", 12))
}

// TestKeptLinesOutlastAStall: while the output blocks, the lines written
// through Kept are kept where the others are dropped, up to twice the limit,
// and go out in their order among the others.
func TestKeptLinesOutlastAStall(t *testing.T) {
	t.Parallel()
	out, w := stall(t)
	writeLines(w, "line", 15) // 12 fit the limit
	require.EqualValues(t, 3, w.Dropped())
	writeLines(w.Kept(), "kept", 15) // 13 more fill twice the limit
	require.EqualValues(t, 5, w.Dropped(), "past twice the limit, kept lines are dropped too")
	writeLines(w, "last", 1)
	require.EqualValues(t, 6, w.Dropped())
	requireWrittenAfterStall(t, out, w, lines("line", 12)+lines("kept", 13))
}

func TestCloseWritesWhatWaits(t *testing.T) {
	t.Parallel()
	out := &recorder{}
	w := New(out, time.Hour)
	_, err := w.Write([]byte("last\n"))
	require.NoError(t, err)
	require.NoError(t, w.Close(time.Minute))
	require.Equal(t, []string{"last\n"}, out.all())
}

// TestCloseGivesUpOnAStalledOutput: a process whose log reader stalled exits,
// after Close's wait, without the lines that waited.
func TestCloseGivesUpOnAStalledOutput(t *testing.T) {
	t.Parallel()
	out := newStalled()
	defer close(out.open)
	w := New(out, time.Hour)
	_, err := w.Write([]byte("never read\n"))
	require.NoError(t, err)
	require.ErrorIs(t, w.Close(10*time.Millisecond), errStalled)
	require.Empty(t, out.all())
}

// slow is an output that takes its time over each write.
type slow struct{ recorder }

func (s *slow) Write(p []byte) (int, error) {
	time.Sleep(200 * time.Microsecond)
	return s.recorder.Write(p)
}

// TestConcurrentLinesStayWhole: lines from concurrent writers, to an output
// slower than they are, go out whole, each writer's in its order, one write
// at a time.
func TestConcurrentLinesStayWhole(t *testing.T) {
	t.Parallel()
	out := &slow{}
	w := New(out, 100*time.Microsecond)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 5000 { // 12 times the 64 KiB that starts a write at once
				_, _ = fmt.Fprintf(w, "writer %d line %d\n", g, i)
			}
		})
	}
	wg.Wait()
	require.NoError(t, w.Flush())
	require.Zero(t, w.Dropped())
	got := strings.Join(out.all(), "")
	lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
	require.Len(t, lines, 8*5000)
	next := make(map[int]int)
	for _, l := range lines {
		var g, i int
		_, err := fmt.Sscanf(l, "writer %d line %d", &g, &i)
		require.NoError(t, err, l)
		require.Equal(t, next[g], i, "each writer's lines in its order")
		next[g]++
	}
}

// BenchmarkWrite floods the buffer with lines of some 450 bytes (as a
// serving replica's access log's) from every core as fast as each can, to a
// file: the most it takes, far past any replica's rate.
func BenchmarkWrite(b *testing.B) {
	out, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	require.NoError(b, err)
	defer out.Close()
	w := New(out, DefaultDelay)
	line := append(bytes.Repeat([]byte("x"), 449), '\n')
	b.SetBytes(int64(len(line)))
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			_, _ = w.Write(line)
		}
	})
	require.NoError(b, w.Flush())
}
