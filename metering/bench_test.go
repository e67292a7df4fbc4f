package metering_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
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
