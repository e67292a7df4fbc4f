package logbuffer

import (
	"bytes"
	"fmt"
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
	writes := out.all()
	require.Len(t, writes, 1, "the line that filled the buffer wrote it")
	require.Len(t, writes[0], maxBuffered)
}

func TestConcurrentLinesStayWhole(t *testing.T) {
	t.Parallel()
	out := &recorder{}
	w := New(out, 100*time.Microsecond)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				_, _ = fmt.Fprintf(w, "writer %d line %d\n", g, i)
			}
		})
	}
	wg.Wait()
	require.NoError(t, w.Flush())
	got := strings.Join(out.all(), "")
	lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
	require.Len(t, lines, 8*500)
	next := make(map[int]int)
	for _, l := range lines {
		var g, i int
		_, err := fmt.Sscanf(l, "writer %d line %d", &g, &i)
		require.NoError(t, err, l)
		require.Equal(t, next[g], i, "each writer's lines in its order")
		next[g]++
	}
}
