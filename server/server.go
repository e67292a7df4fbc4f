// Package server is the HTTP implementation of the public API: the generated
// Echo strict server, the handlers behind it, authentication and body limits
// derived from the OpenAPI document, and the one place where domain errors
// become HTTP statuses.
package server

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/openapi"
	"github.com/rungworks/gateway/turnstile"
)

// Authenticator resolves a bearer token to its principal.
type Authenticator interface {
	Authenticate(ctx context.Context, token string) (*gateway.Principal, error)
}

// EvidenceReader reads the evidence of an account's request.
type EvidenceReader interface {
	Evidence(ctx context.Context, accountID, requestID uuid.UUID) (*gateway.Evidence, error)
}

// UsageReader reads the usage view of a caller's account.
type UsageReader interface {
	Usage(ctx context.Context, p *gateway.Principal, start, end time.Time) (*gateway.UsageView, error)
}

// BatchCreator validates, prices and stores batches.
type BatchCreator interface {
	// Prepare validates and prices a batch: the part of its creation held
	// to the account's turns.
	Prepare(p *gateway.Principal, items []gateway.RequestInput, idempotencyKey *string, body any) (batch.Prepared, error)
	// Create stores a prepared batch and says whether it was an idempotent
	// replay.
	Create(ctx context.Context, b batch.Prepared) (*gateway.Batch, bool, error)
}

// BatchStore reads and cancels an account's batches.
type BatchStore interface {
	Batch(ctx context.Context, accountID, id uuid.UUID) (*gateway.Batch, error)
	Batches(ctx context.Context, accountID uuid.UUID, after *uuid.UUID, limit int) ([]*gateway.Batch, error)
	// BatchItems returns the items of a batch after index after (-1: from
	// the first), ordered by index, as many as fit in maxBytes of content
	// (at least one).
	BatchItems(ctx context.Context, accountID, id uuid.UUID, after int, maxBytes int64) ([]gateway.BatchItem, error)
	CancelBatch(ctx context.Context, accountID, id uuid.UUID) error
}

// ReadinessChecker says whether the replica's dependencies are ready.
type ReadinessChecker interface {
	Ready(ctx context.Context) error
}

// AllReady is ready when every one of its checkers is; the first that is
// not says why.
type AllReady []ReadinessChecker

// Ready implements ReadinessChecker.
func (a AllReady) Ready(ctx context.Context) error {
	for _, c := range a {
		if err := c.Ready(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Config holds the server's dependencies.
type Config struct {
	Auth      Authenticator
	Inference *inference.Service
	Evidence  EvidenceReader
	Usage     UsageReader
	Batches   BatchCreator
	BatchData BatchStore
	Readiness ReadinessChecker
	Metrics   *metrics.Metrics
	Logger    *slog.Logger
	// CORSOrigins, when set, are the browser origins allowed to call the API;
	// CORS is off otherwise.
	CORSOrigins []string
	// TrustedProxies are the addresses of the proxies (load balancers) in
	// front of the gateway: the client of a request one of them forwards is
	// read from its X-Forwarded-For (see clientAddress). None: the client is
	// the connection's peer.
	TrustedProxies []netip.Prefix
	// SSEKeepalive is the idle time before a keep-alive comment in a
	// stream; zero sends none.
	SSEKeepalive time.Duration
	// StreamWriteTimeout bounds the wait for a client to take one write of
	// a stream: a client that reads nothing for this long (found at a
	// keep-alive beat, so not without SSEKeepalive) has gone, and its stream
	// ends as if it had disconnected. Zero means DefaultStreamWriteTimeout.
	StreamWriteTimeout time.Duration
	// ReplyWriteTimeout bounds the time a client may take to read a reply
	// that is not a stream, from its first byte. Zero means
	// DefaultReplyWriteTimeout.
	ReplyWriteTimeout time.Duration
	// DetachAfter is how long an HTTP/1.1 stream runs before it is served
	// off its connection's goroutine (see serveDetachable); zero means
	// DefaultDetachAfter, a negative value never.
	DetachAfter time.Duration
	// BodyTimeout bounds the time to receive a request body (REQUEST_TIMEOUT);
	// zero means DefaultBodyTimeout.
	BodyTimeout time.Duration
	// TurnPlaces is how many of one account's large requests (batch
	// creations, responses) are priced at once (see takeTurn); zero means
	// DefaultTurnPlaces.
	TurnPlaces int
	// TurnWait is how long such a request waits for a place before it is
	// refused RATE_LIMITED; zero means DefaultTurnWait.
	TurnWait time.Duration
	// Unavailable reports whether an error means the database cannot be reached
	// for the moment (SERVICE_UNAVAILABLE, 503); nil means never.
	Unavailable func(error) bool
	// Compress gzips long replies for clients that accept it (see
	// compressReplies), for deployments whose load balancer does not.
	Compress bool
	// RequestRetention is how long requests and the usage sums by minute are
	// kept (zero: for good); the usage view takes only whole hours at ends
	// older than it (gateway.CheckUsagePeriod).
	RequestRetention time.Duration
}

// DefaultBodyTimeout is how long a request body may take to arrive.
const DefaultBodyTimeout = 30 * time.Second

// DefaultStreamWriteTimeout is how long a write of a stream waits for its
// client to take it.
const DefaultStreamWriteTimeout = 30 * time.Second

// DefaultReplyWriteTimeout is how long a client may take to read a reply that
// is not a stream.
const DefaultReplyWriteTimeout = 2 * time.Minute

// unavailableRetryAfter is suggested to callers while the database is away.
const unavailableRetryAfter = 2 * time.Second

// DatabaseWait bounds how long a request waits for the database for a read
// or the readiness probe (its key's lookup, its rate's lease and a batch's
// creation are bounded alike where they are made): past it,
// the request is answered 503 SERVICE_UNAVAILABLE, as when the database is
// away. A database that does not answer (frozen, or cut off by a network
// that drops its packets) would otherwise hold each request for as long as
// it does not.
const DatabaseWait = 5 * time.Second

// waitForDatabase returns ctx bounded by DatabaseWait, for a request's work
// with the database.
func waitForDatabase(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, DatabaseWait)
}

// Server serves the public API.
type Server struct {
	echo      *echo.Echo
	auth      Authenticator
	inference *inference.Service
	evidence  EvidenceReader
	usage     UsageReader
	batches   BatchCreator
	batchData BatchStore
	ready     ReadinessChecker
	metrics   *metrics.Metrics
	draining  atomic.Bool
	// abort ends with inference.ErrShutdown when the shutdown grace is over:
	// every upstream call still running is cancelled with that cause.
	abort      context.Context
	abortCalls context.CancelCauseFunc
	logger     *slog.Logger
	keepalive  time.Duration
	// streamWriteTimeout bounds each write of a stream (sseWriter),
	// replyWriteTimeout the writing of any other reply (observe).
	streamWriteTimeout time.Duration
	replyWriteTimeout  time.Duration
	detachAfter        time.Duration
	unavailable        func(error) bool
	trustedProxies     []netip.Prefix
	paramForms         map[string]string
	// pathTemplates are the document's operations, for a 404 to name the
	// route a path nearly is.
	pathTemplates routeTemplates
	// routes are the route templates served, the only route label values.
	routes map[string]bool
	// openAPI and schema are the two public documents.
	openAPI, schema document
	// relisten takes connections back from detached streams (see Listener);
	// streams are the detached streams open.
	relisten atomic.Pointer[relistener]
	streams  streamSet
	// turns lets a few of an account's large requests be priced at once
	// (takeTurn, prepare).
	turns    *turnstile.Gate
	turnWait time.Duration
	// requestRetention is Config.RequestRetention.
	requestRetention time.Duration
}

// New builds the server: routes come from the generated RegisterHandlers, and
// each operation gets the authentication and body limit its OpenAPI entry declares.
func New(cfg Config) (*Server, error) {
	doc, err := openapi.JSON()
	if err != nil {
		return nil, err
	}
	schema, err := openapi.JSONSchema()
	if err != nil {
		return nil, err
	}
	policies, err := openapi.Policies()
	if err != nil {
		return nil, err
	}
	paramForms, err := openapi.ParameterForms()
	if err != nil {
		return nil, err
	}
	if cfg.BodyTimeout <= 0 {
		cfg.BodyTimeout = DefaultBodyTimeout
	}
	if cfg.DetachAfter == 0 {
		cfg.DetachAfter = DefaultDetachAfter
	}
	if cfg.Unavailable == nil {
		cfg.Unavailable = func(error) bool { return false }
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	s := &Server{
		echo:               echo.New(),
		auth:               cfg.Auth,
		inference:          cfg.Inference,
		evidence:           cfg.Evidence,
		usage:              cfg.Usage,
		batches:            cfg.Batches,
		batchData:          cfg.BatchData,
		ready:              cfg.Readiness,
		metrics:            cfg.Metrics,
		logger:             logger,
		keepalive:          cfg.SSEKeepalive,
		streamWriteTimeout: cmp.Or(cfg.StreamWriteTimeout, DefaultStreamWriteTimeout),
		replyWriteTimeout:  cmp.Or(cfg.ReplyWriteTimeout, DefaultReplyWriteTimeout),
		detachAfter:        cfg.DetachAfter,
		unavailable:        cfg.Unavailable,
		trustedProxies:     cfg.TrustedProxies,
		paramForms:         paramForms,
		pathTemplates:      newRouteTemplates(policies),
		openAPI:            newDocument("application/json", doc),
		schema:             newDocument("application/schema+json", schema),
		turns:              turnstile.New(cmp.Or(cfg.TurnPlaces, DefaultTurnPlaces())),
		turnWait:           cmp.Or(cfg.TurnWait, DefaultTurnWait),
		requestRetention:   cfg.RequestRetention,
	}
	s.abort, s.abortCalls = context.WithCancelCause(context.Background())
	s.echo.HideBanner = true
	s.echo.HidePort = true
	s.echo.HTTPErrorHandler = s.handleError
	s.echo.Binder = jsonBinder{}
	s.echo.Use(s.observe, middleware.RecoverWithConfig(middleware.RecoverConfig{DisableStackAll: true, LogErrorFunc: s.logPanic}))
	if cfg.Compress {
		s.echo.Use(compressReplies)
	}
	if len(cfg.CORSOrigins) > 0 {
		s.echo.Use(middleware.CORSWithConfig(middleware.CORSConfig{
			AllowOrigins:  cfg.CORSOrigins,
			AllowMethods:  []string{http.MethodGet, http.MethodPost},
			AllowHeaders:  []string{"Authorization", "Content-Type", "Idempotency-Key", ifNoneMatch, RequestIDHeader, "traceparent", "tracestate"},
			ExposeHeaders: []string{"x-service-input-rungs", "x-service-output-rungs", "x-service-total-rungs", "x-ratelimit-limit", "x-ratelimit-remaining", "Retry-After", "x-service-batch-index", "Idempotent-Replayed", "ETag", RequestIDHeader},
			MaxAge:        600,
		}))
	}

	opMiddlewares := map[string][]echo.MiddlewareFunc{}
	for id, p := range policies {
		var mws []echo.MiddlewareFunc
		if !p.Public {
			mws = append(mws, s.authorize(p))
		}
		if strings.Contains(p.Path, "{") {
			mws = append(mws, oneSegmentParams)
		}
		if len(p.Query) > 0 {
			mws = append(mws, s.checkQuery(p.Query))
		}
		if slices.Contains(p.Headers, ifNoneMatch) {
			mws = append(mws, foldList(ifNoneMatch))
		}
		if p.InTurns {
			mws = append(mws, s.takeTurn(p))
		}
		if p.MaxBodyBytes > 0 {
			mws = append(mws, limitBody(p.MaxBodyBytes, cfg.BodyTimeout))
		}
		opMiddlewares[id] = mws
	}
	api.RegisterHandlersWithOptions(s.echo, api.NewStrictHandler(s, nil), api.RegisterHandlersOptions{OperationMiddlewares: opMiddlewares})
	if err := checkRoutes(s.echo.Routes(), policies); err != nil {
		return nil, err
	}
	// HEAD is served wherever GET is (RFC 9110: every general-purpose server
	// supports both), for load balancers' health checks among others.
	for _, r := range s.echo.Routes() {
		if r.Method == http.MethodGet {
			s.echo.HEAD(r.Path, s.headOfGet)
		}
	}
	s.routes = map[string]bool{}
	for _, r := range s.echo.Routes() {
		s.routes[r.Path] = true
	}
	return s, nil
}

// checkRoutes makes sure the generated routes and the document's operations are
// the same set, so no route can run without its policy.
func checkRoutes(routes []*echo.Route, policies map[string]openapi.Policy) error {
	declared := map[string]bool{}
	for _, p := range policies {
		declared[p.Method+" "+pathParam.ReplaceAllString(p.Path, ":$1")] = true
	}
	for _, r := range routes {
		if !declared[r.Method+" "+r.Path] {
			return fmt.Errorf("route %s %s has no operation in the OpenAPI document", r.Method, r.Path)
		}
	}
	if len(routes) != len(declared) {
		return fmt.Errorf("the OpenAPI document declares %d operations but %d routes are registered", len(declared), len(routes))
	}
	return nil
}

var pathParam = regexp.MustCompile(`\{([^}]+)\}`)

// headOfGet answers a HEAD request as its path's GET operation, with that
// operation's middlewares (authentication, parameters): the same status and
// headers. net/http, which sees the request as HEAD, sends no body.
func (s *Server) headOfGet(c echo.Context) error {
	s.echo.Router().Find(http.MethodGet, echo.GetPath(c.Request()), c)
	return c.Handler()(c)
}

// Abort cancels every upstream call still running, as at the end of the
// shutdown grace: JSON requests are answered INFERENCE_BUSY, streams end with
// response.error then response.completed carrying what was billed (D12).
func (s *Server) Abort() { s.abortCalls(inference.ErrShutdown) }

// callContext is the context of a request's upstream call: ctx, ended also by
// Abort. The returned func releases it.
func (s *Server) callContext(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(s.abort, func() { cancel(context.Cause(s.abort)) })
	return ctx, func() { stop(); cancel(nil) }
}

// ServeHTTP implements http.Handler. An HTTP/2 request that may stream is
// served on a goroutine of its own, while net/http's waits here for it, or
// for the stream it leaves running (see serveDetachable).
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor != 2 || r.Method != http.MethodPost || s.detachAfter <= 0 {
		s.echo.ServeHTTP(w, r)
		return
	}
	t := &top{s: s, w: w, served: make(chan struct{})}
	go t.serve(r.WithContext(context.WithValue(r.Context(), topKey{}, t)))
	t.wait()
}

func (s *Server) logPanic(c echo.Context, err error, stack []byte) error {
	s.logger.Error("panic serving request", requestAttrs(c, err, "stack", string(stack))...)
	return err
}
