package metering

import (
	"unicode"
	"unicode/utf8"

	"github.com/tiktoken-go/tokenizer"
)

// counter counts o200k_base tokens without a regular-expression engine: a
// hand-written scanner splits text exactly as the vocabulary's pre-tokenizer
// pattern does,
//
//	[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//	|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//	|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// with that pattern's backtracking semantics, and each piece is merged by
// byte-pair ranks taken from the library's vocabulary. The library's codec is
// the reference (TestCounterMatchesTheCodec, FuzzCounterMatchesTheCodec) and
// counts the rare long piece itself. The counts of pieces merged lately are
// cached (see mergeCache).
type counter struct {
	// short holds the ranks of tokens of up to shortBytes bytes, keyed by
	// shortKey: most lookups, faster than by string, and a table the
	// garbage collector need not scan; long holds the others.
	short  map[uint64]uint32
	long   map[string]uint32
	codec  tokenizer.Codec
	merged *mergeCache
}

// shortBytes is the longest token held in counter.short.
const shortBytes = 7

// shortKey packs s, of up to shortBytes bytes, and its length in a word.
func shortKey(s string) uint64 {
	k := uint64(len(s)) << 56
	for i := range len(s) {
		k |= uint64(s[i]) << (8 * i)
	}
	return k
}

// rank returns the rank of token s, if s is one.
func (c *counter) rank(s string) (uint32, bool) {
	if len(s) <= shortBytes {
		r, ok := c.short[shortKey(s)]
		return r, ok
	}
	r, ok := c.long[s]
	return r, ok
}

// maxMergeBytes bounds the pieces the counter merges itself; a longer piece
// (a long run) is counted by the codec, whose merge is O(n log n).
const maxMergeBytes = 256

// The merge cache's size: 64 shards of 256 entries, 16,384 pieces in 512 KiB.
const (
	mergeCacheShardBits = 6
	mergeCacheSlotBits  = 8
)

// newCounter reads the ranks of every token of codec (o200k_base has 132,360
// of up to shortBytes bytes, and 67,638 longer).
func newCounter(codec tokenizer.Codec) *counter {
	c := &counter{short: make(map[uint64]uint32, 132_360), long: make(map[string]uint32, 67_638), codec: codec, merged: newMergeCache(mergeCacheShardBits, mergeCacheSlotBits)}
	for id := uint(0); id < 200_000; id++ {
		piece, err := codec.Decode([]uint{id})
		switch {
		case err != nil:
		case len(piece) <= shortBytes:
			c.short[shortKey(piece)] = uint32(id)
		default:
			c.long[piece] = uint32(id)
		}
	}
	return c
}

// count returns the number of tokens of s, which must be valid UTF-8.
func (c *counter) count(s string) uint64 {
	var n uint64
	for p := 0; p < len(s); {
		end := nextPiece(s, p)
		n += c.pieceTokens(s[p:end])
		p = end
	}
	return n
}

// pieceTokens counts the tokens of one piece: one if it is a token, else
// what merging it by byte-pair ranks makes.
func (c *counter) pieceTokens(piece string) uint64 {
	if _, ok := c.rank(piece); ok {
		return 1
	}
	if len(piece) > maxMergeBytes {
		n, err := c.codec.Count(piece)
		if err != nil {
			return uint64(len(piece))
		}
		return uint64(n)
	}
	if n, ok := c.merged.get(piece); ok {
		return n
	}
	// The merge stays in this function. As a function of its own, called
	// only on a miss, it made waiting HTTP/2 streams hold 12-16 KiB of
	// stacks each instead of 10 (TestWaitingStreamsKeepSmallStacks), most
	// likely as the handlers' stacks, grown less before they end, were then
	// freed into the size class of the streams' own and stayed held with
	// them.
	const none = ^uint32(0)
	type part struct {
		start int
		rank  uint32
	}
	var buf [maxMergeBytes + 1]part
	parts := buf[:0]
	rank := func(parts []part, i int) uint32 {
		if i+2 < len(parts) {
			if r, ok := c.rank(piece[parts[i].start:parts[i+2].start]); ok {
				return r
			}
		}
		return none
	}
	for i := range len(piece) + 1 {
		parts = append(parts, part{start: i, rank: none})
	}
	for i := range len(parts) - 2 {
		parts[i].rank = rank(parts, i)
	}
	for {
		best, at := none, -1
		for i, p := range parts[:len(parts)-1] {
			if p.rank < best {
				best, at = p.rank, i
			}
		}
		if at < 0 {
			n := uint64(len(parts) - 1)
			c.merged.put(piece, n)
			return n
		}
		parts = append(parts[:at+1], parts[at+2:]...)
		parts[at].rank = rank(parts, at)
		if at > 0 {
			parts[at-1].rank = rank(parts, at-1)
		}
	}
}

// nextPiece returns where the pre-tokenizer's piece starting at p ends: the
// alternatives of the pattern tried in order, each with its backtracking.
func nextPiece(s string, p int) int {
	if end, ok := letters(s, p, true); ok {
		return end
	}
	if end, ok := letters(s, p, false); ok {
		return end
	}
	r, size := utf8.DecodeRuneInString(s[p:])
	if isNumber(r) { // \p{N}{1,3}
		end := p + size
		for k := 1; k < 3 && end < len(s); k++ {
			r, size := utf8.DecodeRuneInString(s[end:])
			if !isNumber(r) {
				break
			}
			end += size
		}
		return end
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n/]*`, its space atomic.
	q := p
	if r == ' ' {
		q++
	}
	if end := runOf(s, q, isPunct); end > q {
		for end < len(s) && (s[end] == '\r' || s[end] == '\n' || s[end] == '/') {
			end++
		}
		return end
	}
	// Whitespace: the run [p, e). \s*[\r\n]+ ends after the line breaks that
	// follow the run's first one: the vocabulary's reference implementation
	// backtracks \s* to the first line break (where PCRE would take the last),
	// and the counts here are to be the reference's.
	e := runOf(s, p, unicode.IsSpace)
	for k := p; k < e; k++ {
		if s[k] == '\r' || s[k] == '\n' {
			for k < len(s) && (s[k] == '\r' || s[k] == '\n') {
				k++
			}
			return k
		}
	}
	if e == len(s) { // \s+(?!\S)
		return e
	}
	if _, last := utf8.DecodeLastRuneInString(s[p:e]); e-last > p {
		return e - last // the run but its last character, which is followed by \S
	}
	return e // \s+
}

// letters matches the first (upperFirst false: `U*L+`) or second (`U+L*`)
// letter alternative at p, each tried with and then without its optional
// leading character, and its optional contraction.
func letters(s string, p int, lowerRequired bool) (int, bool) {
	if r, size := utf8.DecodeRuneInString(s[p:]); r != '\r' && r != '\n' && !isLetter(r) && !isNumber(r) {
		if end, ok := upperLower(s, p+size, lowerRequired); ok {
			return contraction(s, end), true
		}
	}
	if end, ok := upperLower(s, p, lowerRequired); ok {
		return contraction(s, end), true
	}
	return 0, false
}

// upperLower matches [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]* then [\p{Ll}\p{Lm}\p{Lo}\p{M}]+
// (lowerRequired) or [..]+ then [..]* at start, backtracking as the pattern does.
func upperLower(s string, start int, lowerRequired bool) (int, bool) {
	q := runOf(s, start, isUpperish)
	if !lowerRequired {
		if q == start {
			return 0, false
		}
		return runOf(s, q, isLowerish), true
	}
	if r := runOf(s, q, isLowerish); r > q {
		return r, true
	}
	// Give back characters of the upper run until one can start the lower run.
	for k := q; k > start; {
		r, size := utf8.DecodeLastRuneInString(s[start:k])
		k -= size
		if isLowerish(r) {
			return k + size, true
		}
	}
	return 0, false
}

// contraction matches (?i:'s|'t|'re|'ve|'m|'ll|'d) at p, if there is one.
func contraction(s string, p int) int {
	if p >= len(s) || s[p] != '\'' {
		return p
	}
	rest := s[p+1:]
	r, size := utf8.DecodeRuneInString(rest)
	switch r {
	case 's', 'S', 't', 'T', 'ſ', 'm', 'M', 'd', 'D':
		return p + 1 + size
	case 'r', 'R', 'v', 'V':
		if len(rest) > 1 && (rest[1] == 'e' || rest[1] == 'E') {
			return p + 3
		}
	case 'l', 'L':
		if len(rest) > 1 && (rest[1] == 'l' || rest[1] == 'L') {
			return p + 3
		}
	}
	return p
}

// runOf returns the end of the run of runes in set starting at p.
func runOf(s string, p int, in func(rune) bool) int {
	for p < len(s) {
		r, size := utf8.DecodeRuneInString(s[p:])
		if !in(r) {
			break
		}
		p += size
	}
	return p
}

func isLetter(r rune) bool {
	if r < utf8.RuneSelf {
		return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z'
	}
	return unicode.IsLetter(r)
}

func isNumber(r rune) bool {
	if r < utf8.RuneSelf {
		return r >= '0' && r <= '9'
	}
	return unicode.IsNumber(r)
}

// isUpperish is [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}].
func isUpperish(r rune) bool {
	if r < utf8.RuneSelf {
		return r >= 'A' && r <= 'Z'
	}
	return unicode.In(r, unicode.Lu, unicode.Lt, unicode.Lm, unicode.Lo, unicode.M)
}

// isLowerish is [\p{Ll}\p{Lm}\p{Lo}\p{M}].
func isLowerish(r rune) bool {
	if r < utf8.RuneSelf {
		return r >= 'a' && r <= 'z'
	}
	return unicode.In(r, unicode.Ll, unicode.Lm, unicode.Lo, unicode.M)
}

// isPunct is [^\s\p{L}\p{N}].
func isPunct(r rune) bool {
	return !unicode.IsSpace(r) && !isLetter(r) && !isNumber(r)
}
