// Package drainer runs batch items in every gateway replica: it claims queued
// items (woken by LISTEN/NOTIFY, with a polling fallback), dispatches them to
// the upstream, and commits their outcomes in groups. Leases, renewed for the
// items the replica really holds, tell a slow item from a dead replica. An item
// reaches the upstream at most once (decisions D12): it goes back to the queue
// only when the upstream certainly did not process it. Claims take only items
// of models with a target taking calls; a model whose targets are all cooling
// down gets one item at a time, as a probe, while the other models drain. An
// account whose calls the targets hold off alone (its calls failing while
// others' do not) has none of its items claimed until the hold ends. An item
// claimed and not started is never started once its batch is cancelled or
// past its window (every replica hears of it), or its replica is stopping:
// it goes back.
package drainer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/retry"
	"github.com/rungworks/gateway/internal/retrylog"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/tracing"
	"github.com/rungworks/gateway/upstream"
)

// Store is what the drainer needs of PostgreSQL.
type Store interface {
	ClaimItems(ctx context.Context, p store.ClaimParams) ([]store.ClaimedItem, error)
	ReleaseClaim(ctx context.Context, owner, claimID uuid.UUID) (store.Requeued, error)
	CompleteItems(ctx context.Context, owner uuid.UUID, results []store.ItemResult) ([]store.ItemKey, error)
	ItemOutcomes(ctx context.Context, keys []store.ItemKey) (map[store.ItemKey]store.ItemOutcome, error)
	RequeueItems(ctx context.Context, owner uuid.UUID, keys []store.ItemKey) (store.Requeued, error)
	RenewLeases(ctx context.Context, owner uuid.UUID, keys []store.ItemKey, lease time.Duration) (int64, error)
	StartBatches(ctx context.Context, ids []uuid.UUID) error
	FinishBatches(ctx context.Context, ids []uuid.UUID) error
	ListenBatches(ctx context.Context, listening, created func(), stopped func(uuid.UUID)) error
}

// Health is what the drainer needs to know of the upstream targets (see
// routing.Router).
type Health interface {
	// Health returns the models with a target taking calls (serving) and
	// those whose targets only take a probe now (probing).
	Health() (serving, probing []gateway.Model)
	// Wait returns when that may have changed, or after maxWait.
	Wait(ctx context.Context, maxWait time.Duration)
}

// Defaults of Config.
const (
	DefaultConcurrency  = 32
	DefaultLease        = 30 * time.Second
	DefaultPollInterval = time.Second
	DefaultGrace        = 30 * time.Second
	// FinalCommitWindow is how long, past the grace, a stopping drainer still
	// tries to commit outcomes before it leaves them to the lease rescuer.
	FinalCommitWindow = 5 * time.Second
	// completeWindow and completeBatch bound how long and how many outcomes the
	// completer gathers before one commit.
	completeWindow = 2 * time.Millisecond
	completeBatch  = 64
	// claimGather is how long after a claim the drainer, with no claimed
	// item left waiting for a worker, waits for half its slots to be free
	// before it claims for fewer: when items finish fast, claims are larger
	// and fewer (each claim costs a statement and a commit whatever its
	// size); a worker stays idle at most this long.
	claimGather = 2 * time.Millisecond
	// claimTimeout bounds a claim, which stopping the drainer does not
	// cancel: a claim takes milliseconds, and one a hung database holds
	// longer must not hold up a shutdown.
	claimTimeout = 5 * time.Second
	// minAccountWait is the least an account's items wait when the targets
	// hold off its calls: a hold whose cool-down has ended still refuses
	// them while its one probe runs.
	minAccountWait = time.Second
)

// Messages of the item errors the drainer records.
const (
	msgFailedAfterDispatch = "the inference request failed after it was sent; it is not retried"
	msgInterrupted         = "the gateway shut down while this item ran; it is not retried"
	msgUnstorable          = "the item's output could not be stored; it is not retried"
)

// Config configures a Drainer.
type Config struct {
	// Owner identifies this replica's leases.
	Owner uuid.UUID
	// Concurrency is the number of items in flight at the upstream. Up to as
	// many more may be claimed ahead, waiting for a worker, when items take
	// less time than a claim (see lookahead).
	Concurrency int
	// Lease is how long a claimed item is held without a heartbeat.
	Lease time.Duration
	// PollInterval bounds the wait for work when no notification arrives.
	PollInterval time.Duration
	// Grace is how long running items may finish once Run's context ends;
	// items still running then are cancelled: failed INTERRUPTED if they were
	// dispatched, handed back otherwise.
	Grace time.Duration
	// Hurried, once closed, ends the grace at once (the process was asked
	// to stop again). Nil: the grace runs its course.
	Hurried <-chan struct{}
	// EvidenceRetention is how long a completed item's evidence is held.
	EvidenceRetention time.Duration
	// Health says which models have a target taking calls, shared with
	// interactive requests (the router). Nil: every model, always.
	Health Health
	// Metrics, when set, records claims, upstream calls, rungs, outcomes and
	// their group commits.
	Metrics *metrics.Metrics
}

// Drainer drains batch items.
type Drainer struct {
	cfg       Config
	store     Store
	provider  upstream.Provider
	estimator *metering.Estimator
	logger    *slog.Logger

	results chan outcome
	held    heldItems
	stopped stoppedBatches
	// starts: batches whose first item was dispatched; refusals: batches
	// whose items a claim refused their budget (see moveBatches).
	starts, refusals idSet
	// lostClaims: claims whose reply was lost (see releaseClaims).
	lostClaims idSet
	waiting    accountWaits
	ahead      lookahead
	// probes counts the items running as probes of a model with no target
	// taking calls: one at a time.
	probes atomic.Int32
	// claimFailures, renewals and interruptions log the runs of failures of
	// the claims, the leases' renewals and the listener.
	claimFailures, renewals, interruptions *retrylog.Failure
}

// New returns a drainer; zero Config fields take their defaults.
func New(cfg Config, st Store, provider upstream.Provider, estimator *metering.Estimator, logger *slog.Logger) *Drainer {
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
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
	}
	return &Drainer{
		cfg: cfg, store: st, provider: provider, estimator: estimator, logger: logger,
		results:       make(chan outcome, cfg.Concurrency),
		starts:        idSet{wake: make(chan struct{}, 1)},
		refusals:      idSet{wake: make(chan struct{}, 1)},
		lostClaims:    idSet{wake: make(chan struct{}, 1)},
		claimFailures: retrylog.New(logger, slog.LevelError, "error claiming batch items", "claiming batch items again"),
		renewals:      retrylog.New(logger, slog.LevelError, "error renewing leases", "leases renewed again"),
		interruptions: retrylog.New(logger, slog.LevelWarn, "batch notifications interrupted; polling until they resume", "batch notifications resumed"),
	}
}

// Run drains until ctx ends, then hands back at once the items it claimed and
// has not started, lets running items finish for the grace period (or until
// Hurried), cancels the rest, commits every outcome it can within
// FinalCommitWindow more, and returns: at most Grace + FinalCommitWindow (and
// one database timeout) after ctx ends.
func (d *Drainer) Run(ctx context.Context) {
	// Upstream calls outlive ctx by the grace period; commits by a little more.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	commits, cancelCommits := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelCommits()

	wake := make(chan struct{}, 1)
	var background sync.WaitGroup
	background.Add(5)
	go func() { defer background.Done(); d.listen(ctx, wake) }()
	go func() { defer background.Done(); d.heartbeat(commits) }()
	go func() {
		defer background.Done()
		d.moveBatches(commits, &d.starts, d.store.StartBatches, "error starting batches; each starts at its next item's dispatch, or finishes")
	}()
	go func() {
		defer background.Done()
		d.moveBatches(commits, &d.refusals, d.store.FinishBatches, "error finishing batches whose items were refused their budget; the housekeeping will")
	}()
	go func() { defer background.Done(); d.releaseClaims(commits) }()
	completerDone := make(chan struct{})
	go func() { defer close(completerDone); d.complete(commits) }()

	// A fixed set of workers runs the items, so their stacks, grown by the
	// upstream call, are kept from one item to the next instead of grown
	// again for each. A slot is an item held: running, or claimed and waiting
	// for a worker (see lookahead).
	slots := make(chan struct{}, 2*d.cfg.Concurrency)
	freed := make(chan struct{}, 1) // told when an item leaves its slot
	jobs := make(chan job, 2*d.cfg.Concurrency)
	var running sync.WaitGroup
	var handedBack atomic.Int64 // items not started when stopping began
	running.Add(d.cfg.Concurrency)
	for range d.cfg.Concurrency {
		go func() {
			defer running.Done()
			for j := range jobs {
				switch {
				case ctx.Err() != nil:
					// Stopping: an item not yet started is never started
					// (it would have less than the grace to run); it goes
					// back at once, for another replica to take.
					d.requeue(commits, j.item)
					handedBack.Add(1)
				case d.stopped.has(j.item.BatchID):
					// Its batch was cancelled, or its window ended, since
					// the item was claimed: not started, it is cancelled.
					d.requeue(commits, j.item)
				default:
					start := time.Now()
					d.run(work, commits, j.item)
					d.ahead.observeItem(time.Since(start))
				}
				if j.probe {
					d.probes.Add(-1)
				}
				<-slots
				select {
				case freed <- struct{}{}:
				default:
				}
			}
		}()
	}
	var lastClaim time.Time
	for ctx.Err() == nil {
		// While claimed items wait for a worker, the next claim waits for half
		// the slots; when none waits, for half or claimGather, whichever
		// comes first. A worker finishing an item wakes the loop.
		capacity := d.cfg.Concurrency + d.ahead.items(d.cfg.Concurrency)
		free := capacity - len(slots)
		waiting := len(jobs) > 0
		if wait := claimGather - time.Since(lastClaim); free <= 0 || free < (capacity+1)/2 && (waiting || wait > 0) {
			timeout := d.cfg.PollInterval
			if free > 0 && !waiting {
				timeout = wait
			}
			select {
			case <-ctx.Done():
			case <-freed:
			case <-time.After(timeout):
			}
			continue
		}
		serving, probing := d.health()
		probe := len(probing) > 0 && d.probes.Load() == 0
		if !probe && len(serving) == 0 {
			// No target takes calls: wait for a cool-down to end, a probe to
			// tell, or an answer to anyone.
			d.cfg.Health.Wait(ctx, d.cfg.PollInterval)
			continue
		}
		var items, probes []store.ClaimedItem
		failed := false
		if probe {
			probes, failed = d.claim(commits, 1, probing)
			free -= len(probes)
		}
		if len(serving) > 0 && free > 0 && !failed {
			items, failed = d.claim(commits, free, serving)
		}
		if failed {
			sleep(ctx, d.cfg.PollInterval)
			continue
		}
		lastClaim = time.Now()
		for i, it := range append(probes, items...) {
			isProbe := i < len(probes)
			if isProbe {
				d.probes.Add(1)
			}
			slots <- struct{}{}
			jobs <- job{item: it, probe: isProbe}
		}
		if len(items)+len(probes) == 0 {
			select {
			case <-ctx.Done():
			case <-wake:
			case <-time.After(d.cfg.PollInterval):
			}
		}
	}

	close(jobs)
	stopCommits := time.AfterFunc(d.cfg.Grace+FinalCommitWindow, cancelCommits)
	defer stopCommits.Stop()
	finished := make(chan struct{})
	go func() { running.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(d.cfg.Grace):
	case <-d.cfg.Hurried:
	}
	cancelWork() // items still running: dispatched ones become INTERRUPTED, the others go back
	<-finished
	if n := handedBack.Load(); n > 0 {
		d.logger.Info("stopping: handed back the batch items claimed and not started, for other replicas", "items", n)
	}
	close(d.results)
	<-completerDone
	cancelCommits()
	background.Wait()
}

// job is a claimed item handed to a worker; probe: it was claimed as its
// model's probe.
type job struct {
	item  store.ClaimedItem
	probe bool
}

// health returns the models to claim items of, and those to probe.
func (d *Drainer) health() (serving, probing []gateway.Model) {
	if d.cfg.Health == nil {
		return gateway.Models, nil
	}
	return d.cfg.Health.Health()
}

// claim claims up to n items of models and finishes the batches whose items
// the budget refused; failed says the claim failed (it is logged). The claim
// runs on commits (within claimTimeout), not on the context that stopping the
// drainer cancels: a shutdown that begins while it runs lets it finish and
// hands its items back, instead of cancelling it at a moment it may have
// committed.
// Should the claim's reply have been lost after it committed, its items are
// handed back (they were never dispatched) in the background (releaseClaims).
func (d *Drainer) claim(commits context.Context, n int, models []gateway.Model) (items []store.ClaimedItem, failed bool) {
	start := time.Now()
	claimID := uuid.Must(uuid.NewV7())
	cctx, cancel := context.WithTimeout(commits, claimTimeout)
	items, err := d.store.ClaimItems(cctx, store.ClaimParams{
		Owner: d.cfg.Owner, ClaimID: claimID, Max: n, PerAccount: max(1, n/2), Lease: d.cfg.Lease, Models: models,
		Skip: d.waiting.active(start),
	})
	cancel()
	if err != nil {
		if store.MayHaveCommitted(err) {
			d.lostClaims.add(claimID)
		}
		d.claimFailures.Failed(err)
		return nil, true
	}
	d.claimFailures.Succeeded()
	elapsed := time.Since(start)
	d.cfg.Metrics.Claim(elapsed)
	d.ahead.observeClaim(elapsed)
	runnable := items[:0]
	for _, it := range items {
		if it.BudgetRefused {
			d.cfg.Metrics.BatchItem(metrics.ItemRefused)
			d.refusals.add(it.BatchID)
			continue
		}
		d.held.add(it.Key())
		runnable = append(runnable, it)
	}
	return runnable, false
}

// releaseClaims hands back the items of the claims whose reply was lost, one
// claim at a time, until ctx ends.
func (d *Drainer) releaseClaims(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.lostClaims.wake:
			for _, id := range d.lostClaims.take() {
				d.releaseClaim(ctx, id)
			}
		}
	}
}

// releaseClaim hands back the items of a claim whose reply was lost, retrying
// while the database is away for up to a lease; after that the rescuer
// reports them INTERRUPTED.
func (d *Drainer) releaseClaim(ctx context.Context, claimID uuid.UUID) {
	var r store.Requeued
	err := d.retry(ctx, metrics.RetryBatchItems, func(ctx context.Context) (err error) {
		r, err = d.store.ReleaseClaim(ctx, d.cfg.Owner, claimID)
		return err
	})
	if err != nil {
		d.logger.Error("error handing back the items of a lost claim; the rescuer will take them", "claim_id", claimID, "error", err)
		return
	}
	if n := len(r.Queued) + len(r.Cancelled); n > 0 {
		d.logger.Warn("handed back the items of a claim whose reply was lost", "claim_id", claimID, "items", n)
		d.finish(ctx, r.Cancelled)
	}
}

// run dispatches one item and hands its outcome to the completer, or hands the
// item back when the upstream certainly did not process it (D12).
func (d *Drainer) run(ctx, commits context.Context, it store.ClaimedItem) {
	req := it.Request.Request()
	var dispatched atomic.Bool
	ctx, span := tracing.BatchItem(ctx, it.BatchID.String(), it.Index, string(req.Model))
	defer span.End()
	start := time.Now()
	res, err := d.provider.Complete(ctx, &upstream.Request{
		Model: req.Model, System: req.CustomInstructions, Prompt: req.Prompt,
		MaxOutputTokens: req.MaxOutputRungs, Hints: req.Hints, AtMostOnce: true, Tenant: it.AccountID,
		OnDispatch: func() {
			dispatched.Store(true)
			if it.BatchQueued {
				d.starts.add(it.BatchID)
			}
		},
	})
	kind := upstream.Kind(err)
	d.cfg.Metrics.Upstream(string(req.Model), kind, time.Since(start))
	tracing.Fail(ctx, kind)
	result := store.ItemResult{BatchID: it.BatchID, Index: it.Index, Model: req.Model}
	var rejected *upstream.RejectedError
	switch {
	case err == nil:
		usage, perr := d.estimator.Actual(req, gateway.EntryBatch, res)
		if perr != nil {
			d.logger.Error("a batch item's usage could not be priced; failing the item", "batch_id", it.BatchID, "index", it.Index, "error", perr)
			result.Status, result.ErrorCode, result.ErrorMessage = string(gateway.ItemFailed), string(gateway.EInternal), "the item's usage could not be priced"
			break
		}
		result.Status, result.Content, result.Sources, result.Verdict = string(gateway.ItemCompleted), res.Content, res.Sources, res.Verdict
		result.InputTokens, result.OutputTokens = usage.InputTokens, usage.OutputTokens
		result.InputRungs, result.OutputRungs, result.TotalRungs = usage.InputRungs, usage.OutputRungs, usage.TotalRungs
		result.EvidenceExpiresAt = time.Now().Add(d.cfg.EvidenceRetention)
		result.Provider, result.UpstreamModel, result.Attempts = res.Route.Provider, res.Route.UpstreamModel, res.Route.Attempts
		tracing.Usage(ctx, usage.InputTokens, usage.OutputTokens, usage.InputRungs, usage.OutputRungs, res.Content)
	case errors.Is(err, upstream.ErrUnavailable), ctx.Err() != nil && !dispatched.Load():
		if errors.Is(err, upstream.ErrCallerHeld) {
			// Only this account's calls are held off: its items are not
			// claimed until the hold ends; the others' are.
			d.waiting.add(it.AccountID, time.Now().Add(max(upstream.RetryAfter(err), minAccountWait)))
		}
		d.requeue(commits, it)
		return
	case ctx.Err() != nil:
		result.Status, result.ErrorCode, result.ErrorMessage = string(gateway.ItemFailed), string(gateway.EInterrupted), msgInterrupted
	case errors.As(err, &rejected):
		result.Status, result.ErrorCode = string(gateway.ItemFailed), string(gateway.EInferenceBusy)
		result.ErrorMessage = "the inference provider rejected the request: " + rejected.Message
	default:
		result.Status, result.ErrorCode, result.ErrorMessage = string(gateway.ItemFailed), string(gateway.EInferenceBusy), msgFailedAfterDispatch
		d.logger.Warn("batch item failed upstream", "batch_id", it.BatchID, "index", it.Index, "error", err)
	}
	d.results <- outcome{result, tracing.SpanRefOf(ctx)}
}

// outcome is an item's result on its way to the completer, with the item's
// span for the commit's span to link to.
type outcome struct {
	store.ItemResult
	span tracing.SpanRef
}

// requeue hands an item the upstream never processed back to the queue (or
// cancels it, when its batch is being cancelled), retrying for up to a lease
// while the database is away.
func (d *Drainer) requeue(ctx context.Context, it store.ClaimedItem) {
	key := it.Key()
	defer d.held.remove(key)
	var r store.Requeued
	var unsure bool // an attempt's reply was lost: it may have cancelled the item
	err := d.retry(ctx, metrics.RetryBatchItems, func(ctx context.Context) (err error) {
		r, err = d.store.RequeueItems(ctx, d.cfg.Owner, []store.ItemKey{key})
		unsure = unsure || store.MayHaveCommitted(err)
		return err
	})
	if err != nil {
		// Its lease runs out and the rescuer reports it INTERRUPTED.
		d.logger.Error("error handing item back to the queue", "batch_id", it.BatchID, "index", it.Index, "error", err)
		return
	}
	d.cfg.Metrics.BatchItem(metrics.ItemRequeued)
	if unsure {
		// Its batch is finished if the lost attempt cancelled its last item
		// (FinishBatches moves only batches whose items all ended).
		r.Cancelled = []store.ItemKey{key}
	}
	d.finish(ctx, r.Cancelled)
}

// complete commits outcomes in groups (one transaction for those that arrive
// together) and finishes the batches they complete, until results is closed.
func (d *Drainer) complete(ctx context.Context) {
	for first := range d.results {
		// The items' spans are gathered only for a commit span to link to.
		traced := tracing.On()
		group, spans := []store.ItemResult{first.ItemResult}, []tracing.SpanRef(nil)
		if traced {
			spans = append(spans, first.span)
		}
		timer := time.NewTimer(completeWindow)
	gather:
		for len(group) < completeBatch {
			select {
			case r, ok := <-d.results:
				if !ok {
					break gather
				}
				group = append(group, r.ItemResult)
				if traced {
					spans = append(spans, r.span)
				}
			case <-timer.C:
				break gather
			}
		}
		timer.Stop()
		span := tracing.StartOutcomesCommit(spans)
		d.commit(ctx, group)
		span.End()
	}
}

// commit stores a group of outcomes in one transaction. While the database is
// away it retries, for up to a lease (then the rescuer owns the items). When
// the group fails for its data, one member's outcome is at fault: each member
// is committed alone, and one that still fails is stored as failed, without
// its output (D11). No commit is retried forever, and a group never waits on
// a member that cannot be stored.
func (d *Drainer) commit(ctx context.Context, group []store.ItemResult) {
	var applied []store.ItemKey
	var unsure bool // an attempt's reply was lost: it may have stored outcomes
	err := d.retry(ctx, metrics.RetryBatchOutcomes, func(ctx context.Context) (err error) {
		start := time.Now()
		applied, err = d.store.CompleteItems(ctx, d.cfg.Owner, group)
		if err == nil {
			d.cfg.Metrics.GroupCommit(metrics.WorkBatchOutcomes, len(group), time.Since(start))
		}
		unsure = unsure || store.MayHaveCommitted(err)
		return err
	})
	switch {
	case err == nil:
		d.committed(ctx, group, applied, unsure)
		return
	case store.Transient(err) || ctx.Err() != nil:
		d.logger.Error("error committing batch item outcomes; the rescuer will take the items", "items", len(group), "error", err)
	case len(group) > 1:
		d.logger.Warn("a group of batch item outcomes failed; committing them one by one", "items", len(group), "error", err)
		for _, r := range group {
			d.commit(ctx, []store.ItemResult{r})
		}
		return
	case group[0].ErrorMessage != msgUnstorable:
		r := group[0]
		d.logger.Error("a batch item's outcome cannot be stored; failing the item", "batch_id", r.BatchID, "index", r.Index, "error", err)
		d.commit(ctx, []store.ItemResult{{
			BatchID: r.BatchID, Index: r.Index, Status: string(gateway.ItemFailed),
			ErrorCode: string(gateway.EInferenceBusy), ErrorMessage: msgUnstorable,
		}})
		return
	default:
		d.logger.Error("error failing a batch item whose outcome cannot be stored; the rescuer will take it", "batch_id", group[0].BatchID, "index", group[0].Index, "error", err)
	}
	for _, r := range group {
		d.held.remove(r.Key())
	}
}

// committed records a group's stored outcomes and finishes their batches:
// those of the whole group, since an outcome the last attempt did not apply
// may have been stored by an earlier one whose reply was lost (unsure), as
// its batch's last (FinishBatches moves only batches whose items all ended;
// the rescuer finishes the batch of an outcome refused for its lost lease).
// The outcomes such an attempt stored are counted as the ones applied are.
func (d *Drainer) committed(ctx context.Context, group []store.ItemResult, applied []store.ItemKey, unsure bool) {
	done := make(map[store.ItemKey]bool, len(applied))
	for _, k := range applied {
		done[k] = true
	}
	var unread error
	if unsure && len(done) < len(group) {
		unread = d.storedEarlier(ctx, group, done)
	}
	switch refused := len(group) - len(done); {
	case refused > 0 && unread != nil:
		d.logger.Warn("outcomes refused: their leases were lost, or an attempt whose reply was lost stored them (they are not counted)", "refused", refused, "error", unread)
	case refused > 0:
		d.logger.Warn("outcomes refused: their leases were lost", "refused", refused)
	}
	keys := make([]store.ItemKey, len(group))
	for i, r := range group {
		keys[i] = r.Key()
		d.held.remove(keys[i])
		if !done[keys[i]] {
			continue
		}
		if r.Status == string(gateway.ItemCompleted) {
			d.cfg.Metrics.Rungs(string(r.Model), string(gateway.EntryBatch), r.InputRungs, r.OutputRungs)
		}
		d.cfg.Metrics.BatchItem(r.Status)
	}
	d.finish(ctx, keys)
}

// storedEarlier adds to done the outcomes of group that an attempt whose
// reply was lost stored: those stored as the group has them (the rescuer's
// are failed INTERRUPTED, billed nothing). It returns why they could not be
// read, if they could not.
func (d *Drainer) storedEarlier(ctx context.Context, group []store.ItemResult, done map[store.ItemKey]bool) error {
	var pending []store.ItemResult
	var keys []store.ItemKey
	for _, r := range group {
		if !done[r.Key()] {
			pending, keys = append(pending, r), append(keys, r.Key())
		}
	}
	var stored map[store.ItemKey]store.ItemOutcome
	err := d.retry(ctx, metrics.RetryBatchOutcomes, func(ctx context.Context) (err error) {
		stored, err = d.store.ItemOutcomes(ctx, keys)
		return err
	})
	if err != nil {
		return err
	}
	for _, r := range pending {
		if o, ok := stored[r.Key()]; ok && o == (store.ItemOutcome{Status: r.Status, ErrorCode: r.ErrorCode, TotalRungs: r.TotalRungs}) {
			done[r.Key()] = true
		}
	}
	return nil
}

// finish makes terminal the batches of items that reached an outcome,
// retrying while the database is away for up to a lease (then the
// housekeeping's pass over stranded batches finishes them).
func (d *Drainer) finish(ctx context.Context, keys []store.ItemKey) {
	if len(keys) == 0 {
		return
	}
	ids := make([]uuid.UUID, len(keys))
	for i, k := range keys {
		ids[i] = k.BatchID
	}
	ids = unique(ids)
	if err := d.retry(ctx, metrics.RetryBatchStates, func(ctx context.Context) error { return d.store.FinishBatches(ctx, ids) }); err != nil {
		d.logger.Error("error finishing batches; the housekeeping will", "error", err)
	}
}

// retry runs fn until it succeeds, fails for a reason other than the database
// being away, a lease has passed, or ctx ends; it returns fn's last error.
// Each attempt ends within a quarter of a lease (a second at least): one
// sent on a connection that no longer answers leaves the next attempt to
// another connection, instead of lasting the whole lease. Each attempt after
// the first is counted under work (see metrics.DatabaseRetry).
func (d *Drainer) retry(ctx context.Context, work string, fn func(context.Context) error) error {
	attempt := max(d.cfg.Lease/4, time.Second)
	retried := func() { d.cfg.Metrics.DatabaseRetry(work) }
	return store.Retry(ctx, d.cfg.Lease, d.cfg.Lease/4, retry.Counted(retried, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, attempt)
		defer cancel()
		return fn(ctx)
	}))
}

// heartbeat renews, every third of a lease, the leases of the items this
// replica holds, and only those: an item leased to it that it does not hold
// (a claim whose reply was lost) runs out its lease. A renewal ends by the
// next beat: one sent on a connection that no longer answers leaves the
// next to another connection, before the leases run out.
func (d *Drainer) heartbeat(ctx context.Context) {
	ticker := time.NewTicker(d.cfg.Lease / 3)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			keys := d.held.keys()
			if len(keys) == 0 {
				continue
			}
			rctx, cancel := context.WithTimeout(ctx, d.cfg.Lease/3)
			_, err := d.store.RenewLeases(rctx, d.cfg.Owner, keys, d.cfg.Lease)
			cancel()
			switch {
			case err == nil:
				d.renewals.Succeeded()
			case ctx.Err() == nil:
				d.renewals.Failed(err)
			}
		}
	}
}

// moveBatches moves the batches gathered in set with move, off the paths
// that gather them (an item's dispatch, a claim), retrying while the
// database is away for up to a lease, and logs failed when it cannot: the
// starts of batches whose first item was dispatched (to in_progress), and the
// finishes of batches whose items a claim refused their budget (the claim
// failed them, and the rest of their batches, at once).
func (d *Drainer) moveBatches(ctx context.Context, set *idSet, move func(context.Context, []uuid.UUID) error, failed string) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-set.wake:
			ids := set.take()
			if err := d.retry(ctx, metrics.RetryBatchStates, func(ctx context.Context) error { return move(ctx, ids) }); err != nil && ctx.Err() == nil {
				d.logger.Error(failed, "error", err)
			}
		}
	}
}

// listen wakes the claim loop on every batch creation, and once it listens
// (for the batches created while it did not), and notes the batches stopped
// (cancelled, or past their window), reconnecting on failure.
func (d *Drainer) listen(ctx context.Context, wake chan<- struct{}) {
	awake := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	for ctx.Err() == nil {
		err := d.store.ListenBatches(ctx, func() {
			d.cfg.Metrics.Listening(metrics.ListenerBatches, true)
			d.interruptions.Succeeded()
			awake()
		}, awake, func(id uuid.UUID) {
			d.stopped.add(id, time.Now(), d.held.batches())
		})
		d.cfg.Metrics.Listening(metrics.ListenerBatches, false)
		if ctx.Err() == nil {
			d.interruptions.Failed(err)
			sleep(ctx, d.cfg.PollInterval)
		}
	}
}

// accountWaits are the accounts whose items a replica does not claim until a
// time: the upstream targets hold off their calls (routing's tenant holds).
type accountWaits struct {
	mu    sync.Mutex
	until map[uuid.UUID]time.Time
}

// add keeps account's items from claims until until (or a later time it
// already had).
func (a *accountWaits) add(account uuid.UUID, until time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.until == nil {
		a.until = map[uuid.UUID]time.Time{}
	}
	if until.After(a.until[account]) {
		a.until[account] = until
	}
}

// active returns the accounts held at now (nil when none), and forgets those
// whose hold has ended.
func (a *accountWaits) active(now time.Time) []uuid.UUID {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []uuid.UUID
	for account, until := range a.until {
		if now.Before(until) {
			out = append(out, account)
		} else {
			delete(a.until, account)
		}
	}
	return out
}

// heldItems are the items this replica claimed and has not yet settled.
type heldItems struct {
	mu    sync.Mutex
	items map[store.ItemKey]struct{}
}

func (h *heldItems) add(k store.ItemKey) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.items == nil {
		h.items = map[store.ItemKey]struct{}{}
	}
	h.items[k] = struct{}{}
}

func (h *heldItems) remove(k store.ItemKey) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.items, k)
}

// batches returns the batches of the items held.
func (h *heldItems) batches() map[uuid.UUID]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[uuid.UUID]bool, len(h.items))
	for k := range h.items {
		out[k.BatchID] = true
	}
	return out
}

func (h *heldItems) keys() []store.ItemKey {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]store.ItemKey, 0, len(h.items))
	for k := range h.items {
		out = append(out, k)
	}
	return out
}

// stoppedBatches are the batches stopped (cancelled, or past their window)
// that this replica may hold items of: it starts none of those it has not.
type stoppedBatches struct {
	mu  sync.Mutex
	ids map[uuid.UUID]time.Time // when the batch was heard of
}

// add notes batch id stopped at now and forgets the batches heard of more
// than claimTimeout before now of which no item is held: an item of a batch
// stopped while its claim ran is held once the claim returns, within
// claimTimeout.
func (s *stoppedBatches) add(id uuid.UUID, now time.Time, held map[uuid.UUID]bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ids == nil {
		s.ids = map[uuid.UUID]time.Time{}
	}
	for b, heard := range s.ids {
		if now.Sub(heard) > claimTimeout && !held[b] {
			delete(s.ids, b)
		}
	}
	s.ids[id] = now
}

func (s *stoppedBatches) has(id uuid.UUID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.ids[id]
	return ok
}

// idSet gathers ids (of batches, of claims) to act on, waking a consumer.
type idSet struct {
	mu   sync.Mutex
	ids  map[uuid.UUID]struct{}
	wake chan struct{}
}

func (b *idSet) add(id uuid.UUID) {
	b.mu.Lock()
	if b.ids == nil {
		b.ids = map[uuid.UUID]struct{}{}
	}
	b.ids[id] = struct{}{}
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

func (b *idSet) take() []uuid.UUID {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]uuid.UUID, 0, len(b.ids))
	for id := range b.ids {
		out = append(out, id)
	}
	b.ids = nil
	return out
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
