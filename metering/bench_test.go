package metering_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/wordtext"
	"github.com/rungworks/gateway/metering"
)

func BenchmarkUsage(b *testing.B) {
	rc := defaultCard(b)
	for b.Loop() {
		_, err := rc.Usage(gateway.ModelReasoning, gateway.EntryBatch, 1234, 5678)
		if err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEstimate(b *testing.B) {
	tok, err := metering.DefaultTokenizer()
	require.NoError(b, err)
	est := &metering.Estimator{Tokenizer: tok, RateCard: defaultCard(b)}
	for _, words := range []int{12, 1200} {
		req := gateway.Request{Prompt: strings.Repeat("metering inference in rungs ", words/4), Model: gateway.ModelInstant, MaxOutputRungs: 32000}
		b.Run(fmt.Sprintf("prompt=%dwords", words), func(b *testing.B) {
			for b.Loop() {
				if _, err := est.Estimate(req, gateway.EntryResponses); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEstimateVaried prices prompts of about 2 KiB of words, a
// different stretch of text each time, as a replica serving many clients
// sees them.
func BenchmarkEstimateVaried(b *testing.B) {
	tok, err := metering.DefaultTokenizer()
	require.NoError(b, err)
	est := &metering.Estimator{Tokenizer: tok, RateCard: defaultCard(b)}
	text := wordtext.Random(1 << 20)
	var prompts []string
	for start := 0; start+4096 < len(text) && len(prompts) < 256; start += 4093 {
		from := start + strings.IndexByte(text[start:], ' ') + 1
		prompts = append(prompts, text[from:from+2048])
	}
	b.SetBytes(2048)
	i := 0
	for b.Loop() {
		req := gateway.Request{Prompt: prompts[i%len(prompts)], Model: gateway.ModelInstant, MaxOutputRungs: 32000}
		if _, err := est.Estimate(req, gateway.EntryResponses); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
