// Package drainer runs batch items in every gateway replica: it claims queued
// items (woken by LISTEN/NOTIFY, with a polling fallback), dispatches them to
// the upstream, and commits their outcomes in groups. Leases renewed by a
// heartbeat tell a slow item from a dead replica. While the upstream is
// unavailable, items go back to the queue unbilled and claiming pauses, probing
// with one item at a time under exponential backoff.
package drainer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

// Store is what the drainer needs of PostgreSQL.
type Store interface {
	ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error)
	CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error)
	RequeueItems(ctx context.Context, owner uuid.UUID, keys []store.ItemKey) (int64, error)
	RenewLeases(ctx context.Context, owner uuid.UUID, lease time.Duration) (int64, error)
	StartBatches(ctx context.Context, ids []uuid.UUID) error
	FinishBatches(ctx context.Context, ids []uuid.UUID) error
	ListenBatchCreated(ctx context.Context, wake func()) error
}

// Defaults of Config.
const (
	DefaultConcurrency  = 32
	DefaultLease        = 30 * time.Second
	DefaultPollInterval = time.Second
	DefaultMaxBackoff   = 30 * time.Second
	DefaultGrace        = 30 * time.Second
	minBackoff          = 250 * time.Millisecond
	// completeWindow and completeBatch bound how long and how many outcomes the
	// completer gathers before one commit.
	completeWindow = 2 * time.Millisecond
	completeBatch  = 64
)

// Config configures a Drainer.
type Config struct {
	// Owner identifies this replica's leases.
	Owner uuid.UUID
	// Concurrency is the number of items in flight.
	Concurrency int
	// Lease is how long a claimed item is held without a heartbeat.
	Lease time.Duration
	// PollInterval bounds the wait for work when no notification arrives.
	PollInterval time.Duration
	// MaxBackoff bounds the pause between probes during an upstream outage.
	MaxBackoff time.Duration
	// Grace is how long running items may finish once Run's context ends;
	// items still running then are cancelled and handed back unbilled.
	Grace time.Duration
	// EvidenceRetention is how long a completed item's evidence is held.
	EvidenceRetention time.Duration
	// Metrics, when set, records claims, upstream calls, rungs and outcomes.
	Metrics *metrics.Metrics
}

// Drainer drains batch items.
type Drainer struct {
	cfg       Config
	store     Store
	provider  upstream.Provider
	models    upstream.ModelMap
	estimator *metering.Estimator
	logger    *slog.Logger

	results chan store.ItemResult
	outage  outage
}

// New returns a drainer; zero Config fields take their defaults.
func New(cfg Config, st Store, provider upstream.Provider, models upstream.ModelMap, estimator *metering.Estimator, logger *slog.Logger) *Drainer {
	if cfg.Owner == uuid.Nil {
		cfg.Owner = uuid.Must(uuid.NewV7())
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.Lease <= 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
	}
	return &Drainer{
		cfg: cfg, store: st, provider: provider, models: models, estimator: estimator, logger: logger,
		results: make(chan store.ItemResult, cfg.Concurrency),
	}
}

// Run drains until ctx ends, then lets running items finish for the grace
// period, hands back the rest, commits every outcome and returns.
func (d *Drainer) Run(ctx context.Context) {
	// Running items outlive ctx by the grace period.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()

	wake := make(chan struct{}, 1)
	var background sync.WaitGroup
	background.Add(2)
	go func() { defer background.Done(); d.listen(ctx, wake) }()
	go func() { defer background.Done(); d.heartbeat(work) }()
	completerDone := make(chan struct{})
	go func() { defer close(completerDone); d.complete(work) }()

	var running sync.WaitGroup
	slots := make(chan struct{}, d.cfg.Concurrency)
	for ctx.Err() == nil {
		if wait := d.outage.pause(); wait > 0 {
			sleep(ctx, wait)
			continue
		}
		free := d.cfg.Concurrency - len(slots)
		if d.outage.probing() {
			// One probe at a time: wait for the one out to tell.
			free = min(free, 1-min(len(slots), 1))
		}
		if free == 0 {
			select {
			case <-ctx.Done():
			case slots <- struct{}{}: // a slot freed: take it back and claim
				<-slots
			}
			continue
		}
		items, err := d.claim(ctx, free)
		if err != nil {
			if ctx.Err() == nil {
				d.logger.Error("error claiming batch items", "error", err)
			}
			sleep(ctx, d.cfg.PollInterval)
			continue
		}
		for _, it := range items {
			slots <- struct{}{}
			running.Add(1)
			go func() {
				defer running.Done()
				defer func() { <-slots }()
				d.run(work, it)
			}()
		}
		if len(items) == 0 {
			select {
			case <-ctx.Done():
			case <-wake:
			case <-time.After(d.cfg.PollInterval):
			}
		}
	}

	finished := make(chan struct{})
	go func() { running.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(d.cfg.Grace):
		cancelWork() // items still running are handed back by run()
		<-finished
	}
	close(d.results)
	<-completerDone
	cancelWork()
	background.Wait()
}

// claim claims up to n items, starts their batches and finishes those whose
// items the budget refused.
func (d *Drainer) claim(ctx context.Context, n int) ([]store.ClaimedItem, error) {
	start := time.Now()
	items, err := d.store.ClaimItems(ctx, store.ClaimParams{Owner: d.cfg.Owner, Max: n, PerAccount: max(1, n/2), Lease: d.cfg.Lease})
	if err != nil {
		return nil, err
	}
	d.cfg.Metrics.Claim(time.Since(start))
	var started, refused []uuid.UUID
	runnable := items[:0]
	for _, it := range items {
		if it.BatchQueued {
			started = append(started, it.BatchID)
		}
		if it.BudgetRefused {
			d.cfg.Metrics.BatchItem("refused")
			refused = append(refused, it.BatchID)
			continue
		}
		runnable = append(runnable, it)
	}
	if err := d.store.StartBatches(ctx, unique(started)); err != nil {
		d.logger.Error("error starting batches", "error", err)
	}
	if err := d.store.FinishBatches(ctx, unique(refused)); err != nil {
		d.logger.Error("error finishing batches", "error", err)
	}
	return runnable, nil
}

// run dispatches one item and hands its outcome to the completer, or the item
// back to the queue when the upstream is unavailable or the replica stops.
func (d *Drainer) run(ctx context.Context, it store.ClaimedItem) {
	req := it.Request.Request()
	start := time.Now()
	res, err := d.provider.Complete(ctx, upstream.Request{
		Model: req.Model, UpstreamModel: d.models[req.Model], System: req.CustomInstructions, Prompt: req.Prompt,
		MaxOutputTokens: req.MaxOutputRungs, Hints: req.Hints,
	})
	d.cfg.Metrics.Upstream(string(req.Model), upstream.Kind(err), time.Since(start))
	result := store.ItemResult{BatchID: it.BatchID, Index: it.Index}
	var rejected *upstream.RejectedError
	switch {
	case err == nil:
		d.outage.over()
		usage, perr := d.estimator.Actual(req, gateway.EntryBatch, res)
		if perr != nil {
			result.Status, result.ErrorCode, result.ErrorMessage = string(gateway.ItemFailed), string(gateway.EInternal), "the item's usage could not be priced"
			break
		}
		result.Status, result.Content, result.Sources, result.Verdict = string(gateway.ItemCompleted), res.Content, res.Sources, res.Verdict
		result.InputTokens, result.OutputTokens = usage.InputTokens, usage.OutputTokens
		result.InputRungs, result.OutputRungs, result.TotalRungs = usage.InputRungs, usage.OutputRungs, usage.TotalRungs
		result.EvidenceExpiresAt = time.Now().Add(d.cfg.EvidenceRetention)
	case errors.Is(err, upstream.ErrUnavailable) || ctx.Err() != nil:
		if ctx.Err() == nil {
			d.outage.begin(d.cfg.MaxBackoff)
		}
		d.cfg.Metrics.BatchItem("requeued")
		d.requeue(it)
		return
	case errors.As(err, &rejected):
		result.Status, result.ErrorCode = string(gateway.ItemFailed), string(gateway.EInferenceBusy)
		result.ErrorMessage = "the inference provider rejected the request: " + rejected.Message
	default:
		result.Status, result.ErrorCode = string(gateway.ItemFailed), string(gateway.EInferenceBusy)
		result.ErrorMessage = "the inference request failed"
		d.logger.Warn("batch item failed upstream", "batch_id", it.BatchID, "index", it.Index, "error", err)
	}
	if result.Status == string(gateway.ItemCompleted) {
		d.cfg.Metrics.Rungs(string(req.Model), string(gateway.EntryBatch), result.InputRungs, result.OutputRungs)
	}
	d.cfg.Metrics.BatchItem(result.Status)
	d.results <- result
}

func (d *Drainer) requeue(it store.ClaimedItem) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := d.store.RequeueItems(ctx, d.cfg.Owner, []store.ItemKey{{BatchID: it.BatchID, Index: it.Index}}); err != nil {
		// Its lease runs out and the rescuer reports it INTERRUPTED.
		d.logger.Error("error handing item back to the queue", "batch_id", it.BatchID, "index", it.Index, "error", err)
	}
}

// complete commits outcomes in groups (one transaction for those that arrive
// together) and finishes the batches they complete, until results is closed.
func (d *Drainer) complete(ctx context.Context) {
	for first := range d.results {
		group := []store.ItemResult{first}
		timer := time.NewTimer(completeWindow)
	gather:
		for len(group) < completeBatch {
			select {
			case r, ok := <-d.results:
				if !ok {
					break gather
				}
				group = append(group, r)
			case <-timer.C:
				break gather
			}
		}
		timer.Stop()
		d.commit(ctx, group)
	}
}

// commit retries until the outcomes are stored: they must not be lost. Should
// the database stay away past the lease, the rescuer fails the items instead.
func (d *Drainer) commit(ctx context.Context, group []store.ItemResult) {
	for backoff := minBackoff; ; backoff = min(2*backoff, d.cfg.Lease) {
		applied, err := d.store.CompleteItems(context.WithoutCancel(ctx), d.cfg.Owner, group)
		if err == nil {
			if len(applied) < len(group) {
				d.logger.Warn("outcomes refused: their leases were lost", "refused", len(group)-len(applied))
			}
			ids := make([]uuid.UUID, len(applied))
			for i, k := range applied {
				ids[i] = k.BatchID
			}
			if err := d.store.FinishBatches(context.WithoutCancel(ctx), unique(ids)); err != nil {
				d.logger.Error("error finishing batches", "error", err)
			}
			return
		}
		d.logger.Error("error committing batch item outcomes; retrying", "items", len(group), "error", err)
		if ctx.Err() != nil {
			return
		}
		sleep(ctx, backoff)
	}
}

// heartbeat renews the leases of running items every third of a lease.
func (d *Drainer) heartbeat(ctx context.Context) {
	ticker := time.NewTicker(d.cfg.Lease / 3)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			if _, err := d.store.RenewLeases(ctx, d.cfg.Owner, d.cfg.Lease); err != nil && ctx.Err() == nil {
				d.logger.Error("error renewing leases", "error", err)
			}
		}
	}
}

// listen wakes the claim loop on every batch creation, reconnecting on failure.
func (d *Drainer) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := d.store.ListenBatchCreated(ctx, func() {
			select {
			case wake <- struct{}{}:
			default:
			}
		})
		if ctx.Err() == nil {
			d.logger.Warn("batch notifications interrupted; polling until they resume", "error", err)
			sleep(ctx, d.cfg.PollInterval)
		}
	}
}

// outage tracks an upstream outage: a pause before each probe, doubling while
// probes fail, cleared by any success.
type outage struct {
	mu      sync.Mutex
	backoff time.Duration
	until   time.Time
}

func (o *outage) begin(maxBackoff time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if time.Now().Before(o.until) {
		return // already pausing
	}
	o.backoff = min(max(2*o.backoff, minBackoff), maxBackoff)
	o.until = time.Now().Add(o.backoff)
}

func (o *outage) over() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.backoff, o.until = 0, time.Time{}
}

// pause is how long to wait before the next claim.
func (o *outage) pause() time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	return time.Until(o.until)
}

// probing reports whether the upstream is suspected down: claim one item.
func (o *outage) probing() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.backoff > 0
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func unique(ids []uuid.UUID) []uuid.UUID {
	seen := make(map[uuid.UUID]bool, len(ids))
	out := ids[:0:0]
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}
