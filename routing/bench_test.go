package routing_test

import (
	"context"
	"testing"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
)

// BenchmarkRouter measures what routing adds to a call: the same in-process
// provider called directly, and through a router of one and of two targets.
func BenchmarkRouter(b *testing.B) {
	req := request("p")
	b.Run("direct", func(b *testing.B) {
		p := upstream.Guard(&counting{}, nil)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = p.Complete(context.Background(), req)
		}
	})
	for _, strategy := range []routing.Strategy{routing.Ordered, routing.Weighted} {
		b.Run(string(strategy), func(b *testing.B) {
			r, err := routing.New(routing.Config{Routes: map[gateway.Model]routing.Route{gateway.ModelInstant: {
				Strategy: strategy,
				Targets: []routing.Target{
					{Provider: "a", UpstreamModel: "m", Weight: 1, Client: &counting{}},
					{Provider: "b", UpstreamModel: "m", Weight: 1, Client: &counting{}},
				},
			}}})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				_, _ = r.Complete(context.Background(), req)
			}
		})
	}
}
