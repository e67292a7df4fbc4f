// Package tryout calls each upstream target of a configuration once asked
// for a whole reply and once streamed, with a short prompt, and reports how
// it answered: what an operator checks before serving the configuration
// (gateway config check --call).
package tryout

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream"
)

// The call each target is sent: a prompt of a few tokens, and an output
// ceiling that leaves a reasoning model room to answer.
const (
	Prompt          = "Reply with the word OK."
	MaxOutputTokens = 64
)

// Target is one provider's upstream model, with the canonical models it serves.
type Target struct {
	Provider      string
	UpstreamModel string
	Models        []gateway.Model
	Client        upstream.Provider
}

// Targets lists the targets of routes once each, in the order of the
// canonical models and of their routes' targets.
func Targets(routes map[gateway.Model]routing.Route) []Target {
	var out []Target
	seen := map[[2]string]int{}
	for _, model := range gateway.Models {
		for _, t := range routes[model].Targets {
			key := [2]string{t.Provider, t.UpstreamModel}
			if i, ok := seen[key]; ok {
				out[i].Models = append(out[i].Models, model)
				continue
			}
			seen[key] = len(out)
			out = append(out, Target{Provider: t.Provider, UpstreamModel: t.UpstreamModel, Models: []gateway.Model{model}, Client: t.Client})
		}
	}
	return out
}

// Call is how one call went: its result, its error, how long it took and,
// streamed, when its first output came (zero: none came).
type Call struct {
	Result      upstream.Result
	Err         error
	Took        time.Duration
	FirstOutput time.Duration
}

// Report is a target's two calls.
type Report struct {
	Target          Target
	Whole, Streamed Call
}

// Failed says whether either call failed.
func (r Report) Failed() bool { return r.Whole.Err != nil || r.Streamed.Err != nil }

// Run calls each target in turn, each call bounded by timeout, and returns
// their reports in the targets' order. The calls are real: the upstreams
// bill them.
func Run(ctx context.Context, targets []Target, timeout time.Duration) []Report {
	out := make([]Report, 0, len(targets))
	for _, t := range targets {
		req := upstream.Request{Model: t.Models[0], UpstreamModel: t.UpstreamModel, Prompt: Prompt, MaxOutputTokens: MaxOutputTokens}
		r := Report{Target: t}
		r.Whole = call(ctx, timeout, func(ctx context.Context) (upstream.Result, error) {
			return t.Client.Complete(ctx, &req)
		})
		var first time.Duration
		r.Streamed = call(ctx, timeout, func(ctx context.Context) (upstream.Result, error) {
			start := time.Now()
			return t.Client.Stream(ctx, &req, func(upstream.Delta) error {
				if first == 0 {
					first = time.Since(start)
				}
				return nil
			})
		})
		r.Streamed.FirstOutput = first
		out = append(out, r)
	}
	return out
}

// call makes one call within timeout and times it.
func call(ctx context.Context, timeout time.Duration, do func(context.Context) (upstream.Result, error)) Call {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	res, err := do(ctx)
	return Call{Result: res, Err: err, Took: time.Since(start)}
}

// String describes the report in three lines: the target and the models it
// serves, then each call.
func (r Report) String() string {
	models := make([]string, len(r.Target.Models))
	for i, m := range r.Target.Models {
		models[i] = string(m)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%s (%s)\n", r.Target.Provider, r.Target.UpstreamModel, strings.Join(models, ", "))
	fmt.Fprintf(&b, "  whole:    %s\n", r.Whole.describe())
	fmt.Fprintf(&b, "  streamed: %s\n", r.Streamed.describe())
	return b.String()
}

// describe says how c went, and when its first output came if it streamed;
// and of a reasoning model's, how much thinking came beside its text.
func (c Call) describe() string {
	if c.Err != nil {
		return fmt.Sprintf("failed after %s: %v", ms(c.Took), c.Err)
	}
	s := "ok in " + ms(c.Took)
	if c.FirstOutput > 0 {
		s += ", first output after " + ms(c.FirstOutput)
	}
	s += fmt.Sprintf(": %s, ", gateway.Quote(c.Result.Content))
	if c.Result.Reasoning != "" {
		s += fmt.Sprintf("thinking of %d bytes (output, not sent), ", len(c.Result.Reasoning))
	}
	if !c.Result.UsageReported {
		return s + "no usage reported (billed from the gateway's tokenizer)"
	}
	return s + fmt.Sprintf("usage %d in, %d out", c.Result.InputTokens, c.Result.OutputTokens)
}

// ms is d in milliseconds, to a tenth.
func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
