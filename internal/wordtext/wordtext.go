// Package wordtext makes text of common words for tests and benchmarks:
// text a tokenizer and a compressor treat about as they treat prose.
package wordtext

import (
	"math/rand/v2"
	"strings"
)

// words are common English words and a few of the gateway's own.
var words = strings.Fields(`the of and to in is that for it as was with be by on not he this are or his from at which
	but have an they you were her she there would their we him been has when who will more no if out so said what up
	its about into than them can only other new some could time these two may then do first any my now such like our
	over man me even most made after also did many before must through back years where much your way well down should
	because each just those people Mr how too little state good very make world still own see men work long get here
	between both life being under never day same another know while last might us great old year off come since against
	go came right used take three gateway metering rungs budget ceiling replica stream batch upstream PostgreSQL ledger`)

// Random is fewer than n bytes (at least n-16 for n above 16) of common
// words, with commas, full stops and line breaks, in an order that never
// repeats a segment; the same for the same n, every time.
func Random(n int) string {
	rng := rand.New(rand.NewPCG(3, 4))
	var b strings.Builder
	for b.Len() < n-16 {
		b.WriteString(words[rng.IntN(len(words))])
		switch rng.IntN(12) {
		case 0:
			b.WriteString(". ")
		case 1:
			b.WriteString(", ")
		case 2:
			b.WriteString("\n")
		default:
			b.WriteByte(' ')
		}
	}
	return b.String()
}
