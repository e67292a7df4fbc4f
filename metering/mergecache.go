package metering

import (
	"hash/maphash"
	"sync"
)

// maxCachedBytes bounds the pieces a mergeCache holds: words, not runs.
const maxCachedBytes = 30

// mergeCache remembers, process-wide, how many tokens recently merged pieces
// made: a word's merge costs a dozen or more rank lookups, and text repeats
// its words, within a prompt and across requests. Each entry holds its piece
// whole, so a hit is exact; a piece evicts whatever shares its slot (text
// made to miss costs what it did without the cache). Shards, each under its
// own lock, keep concurrent requests from waiting on one another.
type mergeCache struct {
	seed      maphash.Seed
	shardBits uint
	slotMask  uint64
	shards    []cacheShard
}

type cacheShard struct {
	mu    sync.Mutex
	slots []cacheEntry
	_     [40]byte // a shard's lock apart from its neighbours' (cache lines)
}

// cacheEntry is a piece of up to maxCachedBytes and its count; n 0 is empty.
type cacheEntry struct {
	n     uint8
	count uint8
	piece [maxCachedBytes]byte
}

// newMergeCache returns a cache of 2^shardBits shards of 2^slotBits entries.
func newMergeCache(shardBits, slotBits uint) *mergeCache {
	c := &mergeCache{seed: maphash.MakeSeed(), shardBits: shardBits, slotMask: 1<<slotBits - 1, shards: make([]cacheShard, 1<<shardBits)}
	for i := range c.shards {
		c.shards[i].slots = make([]cacheEntry, 1<<slotBits)
	}
	return c
}

// slot is where piece is kept, and the lock over it.
func (c *mergeCache) slot(piece string) (*sync.Mutex, *cacheEntry) {
	h := maphash.String(c.seed, piece)
	s := &c.shards[h&(1<<c.shardBits-1)]
	return &s.mu, &s.slots[(h>>c.shardBits)&c.slotMask]
}

// get returns the count cached for piece, if it is there.
func (c *mergeCache) get(piece string) (uint64, bool) {
	if len(piece) == 0 || len(piece) > maxCachedBytes {
		return 0, false
	}
	mu, e := c.slot(piece)
	mu.Lock()
	defer mu.Unlock()
	if int(e.n) != len(piece) || string(e.piece[:e.n]) != piece {
		return 0, false
	}
	return uint64(e.count), true
}

// put caches count for piece, when both fit an entry.
func (c *mergeCache) put(piece string, count uint64) {
	if len(piece) == 0 || len(piece) > maxCachedBytes || count > 255 {
		return
	}
	mu, e := c.slot(piece)
	mu.Lock()
	defer mu.Unlock()
	e.n, e.count = uint8(len(piece)), uint8(count)
	copy(e.piece[:], piece)
}
