package metering

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMergeCacheIsExact: however pieces share slots and evict one another, a
// hit is the count put for that very piece; what does not fit is not kept.
func TestMergeCacheIsExact(t *testing.T) {
	t.Parallel()
	c := newMergeCache(1, 1) // four entries: every slot is shared
	want := map[string]uint64{}
	rng := rand.New(rand.NewPCG(1, 2))
	hits := 0
	for i := range 5000 {
		piece := fmt.Sprintf("p%d", rng.IntN(40))
		if n, ok := c.get(piece); ok {
			hits++
			require.Equal(t, want[piece], n, "%q", piece)
		}
		want[piece] = uint64(len(piece) + i%3)
		c.put(piece, want[piece])
		n, ok := c.get(piece)
		require.True(t, ok, "just put")
		require.Equal(t, want[piece], n)
	}
	require.Positive(t, hits)

	long := strings.Repeat("x", maxCachedBytes+1)
	c.put(long, 2)
	_, ok := c.get(long)
	require.False(t, ok, "longer than an entry")
	c.put("big", 256)
	_, ok = c.get("big")
	require.False(t, ok, "a count past a byte")
	c.put("", 0)
	_, ok = c.get("")
	require.False(t, ok)
}

// TestCounterCountsConcurrently: requests counting at once share the merge
// cache and each gets its own text's count (run with -race).
func TestCounterCountsConcurrently(t *testing.T) {
	t.Parallel()
	tok, err := DefaultTokenizer()
	require.NoError(t, err)
	codec := referenceCodec(t)
	want := make([]uint64, len(corpus))
	for i, s := range corpus {
		n, err := codec.Count(s)
		require.NoError(t, err)
		want[i] = uint64(n)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for k := range 200 {
				i := (g + k) % len(corpus)
				if got := tok.fast.count(corpus[i]); got != want[i] {
					t.Errorf("%q: %d tokens, want %d", corpus[i], got, want[i])
					return
				}
			}
		})
	}
	wg.Wait()
}
