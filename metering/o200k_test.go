package metering

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"github.com/tiktoken-go/tokenizer"
)

// corpus holds text of every kind the pre-tokenizer pattern tells apart.
var corpus = []string{
	"Hello, world! How are you today?", "  leading and  double  spaces ", "tabs\tand\nnew\r\nlines\n\n\n",
	"I'm sure they'll say we've done what you'd LIKE'S and IT'S SHE'LL", "don'tstop ‘quotes’ “double” 'single'",
	"HTTPServer parseJSONBody XMLHttpRequest iPhone McDonald's", "12345 3.14159 1,000,000 ٣٤٥ 五六",
	"función análisis über straße ΣΊΣΥΦΟΣ Ελληνικά русский язык", "東京は日本の首都です。中文文本，标点！",
	"emoji 😀😃😄 👍🏽 family 👨‍👩‍👧 flags 🇫🇷", "e\u0301 a\u0300\u0301 combining ̀marks", "  \u00a0\u2003nbsp and em spaces\u3000",
	"code: func main() { fmt.Println(\"hi\") } // x := a[i]+b/c", "path/to/file.go:12:3 https://example.org/a?b=c&d",
	"----====****////\\\\\\\\\n\n", "!!!???...,,,;;;::: ", " ' 's 'S 'ſ 're 'RE 've 'm 'll 'LL 'd 'x", "\r\r\n\n \n \t\n",
	"ǅemo ǈ ǋ titlecase ʰʲ modifier ʰletters", "x", " ", "\n", "'", "a'", "1'", "ab  \n  cd", "end with spaces   ",
	"WE'VEN SHE'LLS THEY'REX it'ſa I'Mx I'ſtS A'lLE", "carriage\rreturn 3rd 42nd x1y", "½¾ ⅫⅣ ①② x² ³⁄₄", "nul\x00\x00\x00 bytes\x00",
	"babaaaabb abbbaaaaaa llllel", // merges where the same pair repeats: leftmost first
}

func referenceCodec(t testing.TB) tokenizer.Codec {
	t.Helper()
	codec, err := tokenizer.Get(tokenizer.O200kBase)
	require.NoError(t, err)
	return codec
}

// TestCounterMatchesTheCodec: the hand-written counter gives exactly the
// library codec's count, on every kind of text and on random mixes of it.
func TestCounterMatchesTheCodec(t *testing.T) {
	t.Parallel()
	tok, err := DefaultTokenizer()
	require.NoError(t, err)
	codec := referenceCodec(t)
	check := func(s string) {
		want, err := codec.Count(s)
		require.NoError(t, err)
		require.Equal(t, uint64(want), tok.fast.count(s), "%q", s)
	}
	for _, s := range corpus {
		check(s)
	}
	rng := rand.New(rand.NewPCG(7, 11))
	runes := []rune(strings.Join(corpus, ""))
	for range 2000 {
		var b strings.Builder
		for range 1 + rng.IntN(40) {
			b.WriteRune(runes[rng.IntN(len(runes))])
		}
		check(b.String())
	}
	check(strings.Repeat("a", 1000) + " " + strings.Repeat("b", 300)) // pieces past maxMergeBytes
}

// FuzzCounterMatchesTheCodec: on any valid UTF-8 text the library codec
// covers whole, the counter and the codec agree.
func FuzzCounterMatchesTheCodec(f *testing.F) {
	for _, s := range corpus {
		f.Add(s)
	}
	tok, err := DefaultTokenizer()
	if err != nil {
		f.Fatal(err)
	}
	codec := referenceCodec(f)
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		ids, pieces, err := codec.Encode(s)
		if err != nil || strings.Join(pieces, "") != s {
			t.Skip("the reference drops part of its input (it skips U+007F, for one)")
		}
		want := len(ids)
		if got := tok.fast.count(s); got != uint64(want) {
			t.Fatalf("%q: %d tokens, the codec counts %d", s, got, want)
		}
	})
}
