// Package tracing exports OpenTelemetry traces when an operator asks for them
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): a span
// per API request, continuing the caller's W3C trace context, a span per batch
// item, a child span per upstream attempt whose context travels upstream in
// traceparent, a child span for the settlement of a request's usage, and a
// span for each commit of settlements or of batch item outcomes, linked to
// the spans of the requests or items it stores.
// Attributes follow the OpenTelemetry GenAI semantic conventions (gen_ai.*).
// Prompts and outputs stay out of spans unless the operator opts in
// (GATEWAY_TRACE_CONTENT). Without an endpoint nothing is recorded and every
// function here returns at once, without allocating.
package tracing

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Attribute keys of the GenAI semantic conventions, and the gateway's own.
const (
	OperationName     = attribute.Key("gen_ai.operation.name")
	System            = attribute.Key("gen_ai.system")
	ProviderName      = attribute.Key("gen_ai.provider.name")
	RequestModel      = attribute.Key("gen_ai.request.model")
	RequestMaxTokens  = attribute.Key("gen_ai.request.max_tokens")
	ResponseModel     = attribute.Key("gen_ai.response.model")
	InputTokens       = attribute.Key("gen_ai.usage.input_tokens")
	OutputTokens      = attribute.Key("gen_ai.usage.output_tokens")
	InputMessages     = attribute.Key("gen_ai.input.messages")
	OutputMessages    = attribute.Key("gen_ai.output.messages")
	ErrorType         = attribute.Key("error.type")
	Attempt           = attribute.Key("gateway.attempt")
	InputRungs        = attribute.Key("gateway.usage.input_rungs")
	OutputRungs       = attribute.Key("gateway.usage.output_rungs")
	RequestID         = attribute.Key("gateway.request_id")
	BatchID           = attribute.Key("gateway.batch_id")
	BatchIndex        = attribute.Key("gateway.batch_index")
	BatchItems        = attribute.Key("gateway.batch_items")
	Requests          = attribute.Key("gateway.requests")
	operationChat     = "chat"
	instrumentationID = "github.com/rungworks/gateway"
)

var (
	enabled atomic.Bool
	content atomic.Bool
	tracer                                = otel.Tracer(instrumentationID)
	prop    propagation.TextMapPropagator = propagation.TraceContext{}
)

// Options configure Setup.
type Options struct {
	// Content records prompts and outputs in spans (GATEWAY_TRACE_CONTENT).
	Content bool
	// Logger gets the SDK's errors (an export that failed, its spans lost)
	// as warnings; nil is slog.Default().
	Logger *slog.Logger
	// Failed, when set, is called for each of those errors (the metrics
	// count them).
	Failed func()
}

// configured reports whether the environment names an OTLP endpoint.
func configured() bool {
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// Setup starts exporting spans over OTLP/HTTP when configured (the exporter
// reads the standard OTEL_EXPORTER_OTLP_* variables, the SDK OTEL_TRACES_SAMPLER
// and OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME defaults to "gateway"). The
// returned func flushes and stops the exporter; it is a no-op when tracing is
// off.
func Setup(ctx context.Context, opts Options) (func(context.Context) error, error) {
	if !configured() {
		return func(context.Context) error { return nil }, nil
	}
	exporter, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("error creating the OTLP trace exporter: %w", err)
	}
	res, err := resource.Merge(resource.NewSchemaless(attribute.String("service.name", "gateway")), resource.Environment())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("error reading OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	// A collector away is the operator's to know, counted, and as a
	// warning in the replica's log, sampled as its others are: not as a
	// line the SDK writes through the log package each export.
	logger := cmp.Or(opts.Logger, slog.Default())
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		if opts.Failed != nil {
			opts.Failed()
		}
		logger.Warn("error exporting traces; the spans of the export are lost", "error", err)
	}))
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	otel.SetTracerProvider(provider)
	otel.SetTextMapPropagator(prop)
	tracer = provider.Tracer(instrumentationID)
	content.Store(opts.Content)
	enabled.Store(true)
	return func(ctx context.Context) error {
		enabled.Store(false)
		return provider.Shutdown(ctx)
	}, nil
}

// noop is the span returned while tracing is off.
var noop = trace.SpanFromContext(context.Background())

// Request starts the server span of an HTTP request named "METHOD route",
// continuing the trace of the caller's traceparent header, if any; client is
// the address the request came from (client.address).
func Request(ctx context.Context, r *http.Request, route, client string) (context.Context, trace.Span) {
	if !enabled.Load() {
		return ctx, noop
	}
	ctx = prop.Extract(ctx, propagation.HeaderCarrier(r.Header))
	return tracer.Start(ctx, r.Method+" "+route, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("http.route", route),
			attribute.String("client.address", client)))
}

// EndRequest ends a request's span with the response status.
func EndRequest(span trace.Span, status int) {
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(attribute.Int("http.response.status_code", status))
	if status >= 500 {
		span.SetStatus(codes.Error, http.StatusText(status))
	}
	span.End()
}

// BatchItem starts the span of one batch item's run, a root span.
func BatchItem(ctx context.Context, batchID string, index int, model string) (context.Context, trace.Span) {
	if !enabled.Load() {
		return ctx, noop
	}
	return tracer.Start(ctx, operationChat+" "+model, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
		OperationName.String(operationChat), RequestModel.String(model), BatchID.String(batchID), BatchIndex.Int(index)))
}

// Inference describes, on the span of ctx, the inference a request asks for.
func Inference(ctx context.Context, requestID, model string, maxTokens uint64, system, prompt string) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(OperationName.String(operationChat), RequestModel.String(model),
		RequestMaxTokens.Int64(clampInt64(maxTokens)), RequestID.String(requestID))
	if content.Load() {
		msgs := make([]message, 0, 2)
		if system != "" {
			msgs = append(msgs, textMessage("system", system))
		}
		span.SetAttributes(InputMessages.String(marshal(append(msgs, textMessage("user", prompt)))))
	}
}

// Usage records, on the span of ctx, the tokens and rungs billed.
func Usage(ctx context.Context, inputTokens, outputTokens, inputRungs, outputRungs int64, output string) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(InputTokens.Int64(inputTokens), OutputTokens.Int64(outputTokens),
		InputRungs.Int64(inputRungs), OutputRungs.Int64(outputRungs))
	if content.Load() {
		span.SetAttributes(OutputMessages.String(marshal([]message{textMessage("assistant", output)})))
	}
}

// Fail marks the span of ctx as failed with kind (a fixed set, e.g. upstream.Kind).
func Fail(ctx context.Context, kind string) { fail(trace.SpanFromContext(ctx), kind) }

func fail(span trace.Span, kind string) {
	if kind == "" || !span.IsRecording() {
		return
	}
	span.SetAttributes(ErrorType.String(kind))
	span.SetStatus(codes.Error, kind)
}

// StartAttempt starts the client span of attempt n (from 1) at a target.
func StartAttempt(ctx context.Context, provider, upstreamModel string, n int) (context.Context, trace.Span) {
	if !enabled.Load() {
		return ctx, noop
	}
	return tracer.Start(ctx, operationChat+" "+upstreamModel, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		OperationName.String(operationChat), System.String(provider), ProviderName.String(provider),
		RequestModel.String(upstreamModel), Attempt.Int(n)))
}

// EndAttempt ends an attempt's span with its outcome: the usage the target
// reported, or the kind of its failure.
func EndAttempt(span trace.Span, upstreamModel string, usageReported bool, inputTokens, outputTokens uint64, kind string) {
	if !span.IsRecording() {
		return
	}
	if kind == "" {
		span.SetAttributes(ResponseModel.String(upstreamModel))
		if usageReported {
			span.SetAttributes(InputTokens.Int64(clampInt64(inputTokens)), OutputTokens.Int64(clampInt64(outputTokens)))
		}
	}
	fail(span, kind)
	span.End()
}

// StartSettlement starts the span of a request's settlement: the wait for the
// durable commit of its usage and evidence, with its group, and the retries
// while the database is away. The context returned carries it.
func StartSettlement(ctx context.Context) (context.Context, trace.Span) {
	if !enabled.Load() {
		return ctx, noop
	}
	return tracer.Start(ctx, "settle usage", trace.WithSpanKind(trace.SpanKindInternal))
}

// EndSettlement ends a settlement's span, failed with outcome unless it is
// empty (a fixed set: see inference).
func EndSettlement(span trace.Span, outcome string) {
	fail(span, outcome)
	span.End()
}

// On reports whether spans are recorded, for callers to skip gathering what
// only a span would use.
func On() bool { return enabled.Load() }

// SpanRef identifies a span, for the commit that stores its work with others'
// to link to.
type SpanRef = trace.SpanContext

// SpanRefOf returns the span of ctx.
func SpanRefOf(ctx context.Context) SpanRef {
	if !enabled.Load() {
		return SpanRef{}
	}
	return trace.SpanContextFromContext(ctx)
}

// StartOutcomesCommit starts the span of one transaction storing batch item
// outcomes together, linked to the span of each item it stores.
func StartOutcomesCommit(items []SpanRef) trace.Span {
	return startCommit("commit batch outcomes", items, BatchItems)
}

// StartSettlementsCommit starts the span of one transaction storing the
// settlements of requests together, linked to the settlement span of each.
func StartSettlementsCommit(requests []SpanRef) trace.Span {
	return startCommit("commit settlements", requests, Requests)
}

// startCommit starts the span of a transaction storing the work of several
// spans: a trace of its own (each of them is in its own), linked to them,
// with their number as count.
func startCommit(name string, refs []SpanRef, count attribute.Key) trace.Span {
	if !enabled.Load() {
		return noop
	}
	links := make([]trace.Link, 0, len(refs))
	for _, sc := range refs {
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	_, span := tracer.Start(context.Background(), name, trace.WithNewRoot(),
		trace.WithSpanKind(trace.SpanKindInternal), trace.WithLinks(links...), trace.WithAttributes(count.Int(len(refs))))
	return span
}

// EndCommit ends a commit's span, failed when it failed.
func EndCommit(span trace.Span, failed bool) {
	if failed {
		fail(span, "store")
	}
	span.End()
}

// Inject writes the trace context of ctx into an outgoing request's headers.
func Inject(ctx context.Context, h http.Header) {
	if enabled.Load() {
		prop.Inject(ctx, propagation.HeaderCarrier(h))
	}
}

// message is a GenAI semantic-conventions chat message with text parts.
type message struct {
	Role  string `json:"role"`
	Parts []part `json:"parts"`
}

type part struct {
	Type    string `json:"type"`
	Content string `json:"content"`
}

func textMessage(role, text string) message {
	return message{Role: role, Parts: []part{{Type: "text", Content: text}}}
}

func marshal(msgs []message) string {
	b, _ := json.Marshal(msgs) // strings only: cannot fail
	return string(b)
}

func clampInt64(v uint64) int64 { return int64(min(v, 1<<63-1)) }
