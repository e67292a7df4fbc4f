// Package ledger admits and settles interactive requests against the daily
// ceiling and the project budget without a database round trip on admission.
//
// A replica leases a slice of an account-day's ceiling (and of a capped
// project's budget) in one statement and admits requests from it in memory;
// the slice was charged to the day and reserved on the budget when granted,
// so the sum of all replicas' slices never passes either cap, and an admitted
// estimate is always covered. Slices are sized to a share of what the caps
// leave, so they shrink as the remainder does; a request that the slice and
// the remainder together cannot cover is refused exactly as before. A slice
// running low is refilled in the background, so that the requests of an
// account in steady use do not wait for a grant; so is the next day's slice
// granted in the last minutes of a day, each account at its own instant, so
// that the turn of the day neither makes every account's first request wait
// for a grant nor sends all the grants at once.
//
// Finished requests are settled in groups: those that finish together are
// committed in one statement and one transaction (usage, evidence, and their
// actual cost on their lease), and each caller waits for its group's commit,
// so usage is durable before it is sent. A group that fails for its data is
// split so that one bad member stops no one else.
//
// A replica renews its leases while it holds them and folds a lease back
// (the day charged what was used under it, the budget moved from reserved to
// spent) when it goes idle, at shutdown, or when limits change; a fold that
// fails (the database away) is tried again at each beat until its lease runs
// out. A replica that dies forfeits its slices until their lease runs out;
// then any replica folds them, and requests settled under them stay billed
// exactly once.
package ledger

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/inflight"
	"github.com/rungworks/gateway/internal/retrylog"
	"github.com/rungworks/gateway/internal/stagger"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/tracing"
)

// Store grants, renews and folds quota leases and settles requests.
type Store interface {
	GrantQuota(ctx context.Context, r store.QuotaRequest) (store.QuotaGrant, error)
	RenewQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID, lease time.Duration) ([]uuid.UUID, error)
	FoldQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID) (int64, error)
	SettleRequests(ctx context.Context, group []store.Settlement) error
}

// Defaults of a Config.
const (
	// DefaultLease is how long a slice outlives a replica that stopped renewing it.
	DefaultLease = 30 * time.Second
	// DefaultShare sizes a slice as 1/16 of what the ceiling and cap leave.
	DefaultShare = 16
	// DefaultIdle is how long an unused slice is kept before it is folded
	// back: a renewal period of the default lease, so that a tenant sending a
	// request every few seconds keeps its slice (a slice folded between its
	// requests cost each a grant, a durable commit before dispatch).
	DefaultIdle = 10 * time.Second
	// DefaultMaxGroup bounds the requests settled in one transaction.
	DefaultMaxGroup = 256
	// statementTimeout bounds one grant, renewal, fold or group commit.
	statementTimeout = 5 * time.Second
	// renewChunk bounds the leases one renewal statement extends. A
	// statement locks its leases in key order and holds them until it
	// commits, while each settlement holds the lease it charges: over
	// thousands of leases a single statement waited on settlement after
	// settlement, and the settlements of every lease it had locked waited on
	// it, for seconds (bench/load -tenants 5000).
	renewChunk = 100
	// refusalMemory is how long a refused grant answers for its lease: a
	// burst of requests past a cap is refused from memory, not with a
	// statement each. A refill that failed waits as long before the next.
	refusalMemory = 250 * time.Millisecond
	// lowWater refills a slice once less than 1/lowWater of its last grant
	// is available.
	lowWater = 4
	// DefaultDayAhead is how long before a day ends the next day's slice of
	// an account in use may be granted.
	DefaultDayAhead = 5 * time.Minute
)

// Config configures a Ledger; zero fields take the defaults.
type Config struct {
	// Owner identifies this replica's leases.
	Owner    uuid.UUID
	Lease    time.Duration
	Share    int
	Idle     time.Duration
	MaxGroup int
	// DayAhead is how long before a day ends the next day's slice of an
	// account in use may be granted: each account's grant starts at an
	// instant of its first half that the account's id sets (stagger.Lead).
	// Negative: none is granted ahead.
	DayAhead time.Duration
	// Unavailable reports whether an error means the database is away for
	// the moment; a group failing so is not split. Nil means never.
	Unavailable func(error) bool
	Logger      *slog.Logger
	// Metrics, when set, records each group's commit.
	Metrics *metrics.Metrics
}

// Ledger is one replica's view of its leases and the requests admitted under them.
type Ledger struct {
	cfg   Config
	store Store

	// group is the settlements waiting for a commit, and whether one is in
	// flight: the request that finds none in flight commits the group (its
	// own and every one waiting), then hands the next group to one of those
	// that arrived meanwhile.
	groupMu  sync.Mutex
	pending  []*settling
	inFlight bool

	// stale wakes Run to fold back the slices Invalidate made unusable.
	stale chan struct{}

	mu sync.Mutex
	// folding holds, per slice key, a channel closed when the fold in
	// flight of a lease of that key ends (see fold).
	folding map[sliceKey]chan struct{}
	// unfolded holds the leases whose fold failed, each with when it has
	// run out in the database for certain (then any replica folds it).
	unfolded map[uuid.UUID]time.Time
	current  map[sliceKey]*lease
	leases   map[uuid.UUID]*lease
	admitted map[uuid.UUID]ticket

	// renewals logs the renewals' runs of failures.
	renewals *retrylog.Failure
}

// sliceKey is what a lease is a slice of: an account-day and a project.
type sliceKey struct {
	account, project uuid.UUID
	day              time.Time
}

// lease is a slice held by this replica.
type lease struct {
	id  uuid.UUID
	key sliceKey
	// avail is what admissions may still take: granted, minus the estimates
	// of requests running, minus the actual cost of those settled.
	avail int64
	// lastGrant is the last grant's size, which tells when to refill.
	lastGrant int64
	// stored is set once a grant statement created the lease's row.
	stored   bool
	inflight int
	// validUntil is when the lease may have run out in the database unless
	// renewed; nothing is admitted from it after.
	validUntil time.Time
	touched    time.Time
	// changed is set when its account's limits may have changed after it
	// was granted (Invalidate): nothing more is admitted from it.
	changed  bool
	granting *inflight.Call // the grant in flight, if any
	// refused is the last refusal, answering until refusedUntil for what
	// needs more than it said was left.
	refused      store.QuotaGrant
	refusedUntil time.Time
	// refillAfter is when a refill may follow one that failed.
	refillAfter time.Time
}

// ticket is what an admitted request took from which lease.
type ticket struct {
	lease    *lease
	estimate int64
}

// settling is a request waiting for its group's commit.
type settling struct {
	settlement store.Settlement
	span       tracing.SpanRef // the request's settlement span, for its commit's to link to
	done       chan error
	lead       chan struct{} // closed when it is this one's turn to commit
}

// New returns a ledger over st; Run renews and folds back its leases.
func New(cfg Config, st Store) *Ledger {
	if cfg.Lease <= 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.Share <= 0 {
		cfg.Share = DefaultShare
	}
	if cfg.Idle <= 0 {
		cfg.Idle = DefaultIdle
	}
	if cfg.MaxGroup <= 0 {
		cfg.MaxGroup = DefaultMaxGroup
	}
	if cfg.DayAhead == 0 {
		cfg.DayAhead = DefaultDayAhead
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Ledger{
		cfg: cfg, store: st, stale: make(chan struct{}, 1),
		folding: map[sliceKey]chan struct{}{}, unfolded: map[uuid.UUID]time.Time{},
		current: map[sliceKey]*lease{}, leases: map[uuid.UUID]*lease{}, admitted: map[uuid.UUID]ticket{},
		renewals: retrylog.New(cfg.Logger, slog.LevelWarn,
			"error renewing quota leases; admissions will lease anew once they run out", "quota leases renewed again"),
	}
}

// Admit takes the request's estimate from the slice of its account-day and
// project, leasing a new slice when this one cannot cover it, and refills the
// slice in the background once it runs low. A refusal is RATE_LIMITED (daily
// ceiling) or BUDGET_EXCEEDED, worded as D5 and D11 say.
func (l *Ledger) Admit(ctx context.Context, a gateway.Admission) error {
	key := sliceKey{account: a.Principal.AccountID, project: a.Principal.ProjectID, day: gateway.UTCDay(a.Day)}
	for {
		l.mu.Lock()
		if wait := l.folding[key]; wait != nil {
			l.mu.Unlock()
			if err := await(ctx, wait); err != nil {
				return err
			}
			continue
		}
		ls, replaced := l.slice(key, time.Now())
		if replaced != nil {
			_ = l.fold(ctx, []*lease{replaced}) // tried again at a beat on failure
			continue
		}
		if ls.stored && ls.avail >= a.Estimate {
			ls.avail -= a.Estimate
			ls.inflight++
			ls.touched = time.Now()
			l.admitted[a.RequestID] = ticket{lease: ls, estimate: a.Estimate}
			l.refill(ls, a, ls.touched)
			l.grantAhead(key, a, ls.touched)
			l.mu.Unlock()
			return nil
		}
		if call := ls.granting; call != nil {
			// Its failure is this request's too: the store did not answer.
			l.mu.Unlock()
			if err := call.Wait(ctx); err != nil {
				return err
			}
			continue
		}
		if time.Now().Before(ls.refusedUntil) && a.Estimate-ls.avail > ls.refused.Left {
			refused := ls.refused
			l.mu.Unlock()
			return gateway.AdmissionError(refusal(refused, a.Estimate), "request", a.Estimate, a.Principal, key.day)
		}
		call := inflight.Start()
		ls.granting = call
		need := a.Estimate - ls.avail // more than the estimate when settlements cost more than theirs
		l.mu.Unlock()

		start := time.Now()
		grant, err := l.grant(ctx, ls, a.Principal, need)

		l.mu.Lock()
		l.granted(ls, call, start, grant, err)
		l.mu.Unlock()
		if err != nil {
			return err
		}
		if grant.Outcome != gateway.AdmitOK {
			return gateway.AdmissionError(refusal(grant, a.Estimate), "request", a.Estimate, a.Principal, key.day)
		}
	}
}

// refill starts, in the background, a grant of at least a's estimate to ls
// once less than a quarter of its last grant is available, so that the next
// requests find it covered. Nothing is started while a grant is in flight, on
// a slice no longer used, while a refusal answers for it, or for a while after
// a refill failed. Called with l.mu held.
func (l *Ledger) refill(ls *lease, a gateway.Admission, now time.Time) {
	if ls.granting != nil || ls.avail >= ls.lastGrant/lowWater || l.retired(ls, now) ||
		now.Before(ls.refusedUntil) || now.Before(ls.refillAfter) {
		return
	}
	l.grantInBackground(ls, a)
}

// grantAhead starts, at now, in the background, the grant of the next day's
// slice of key's account and project once a's day ends within the account's
// lead (stagger.Lead), unless there is one. Called with l.mu held.
func (l *Ledger) grantAhead(key sliceKey, a gateway.Admission, now time.Time) {
	if l.cfg.DayAhead < 0 {
		return
	}
	// Every admission asks: the day's end (a UTC day is 24 hours) before
	// any map is read.
	end := key.day.Add(24 * time.Hour)
	if end.Sub(a.Day) > stagger.Lead(key.account, l.cfg.DayAhead) {
		return
	}
	next := sliceKey{account: key.account, project: key.project, day: end}
	if l.current[next] != nil || l.folding[next] != nil {
		return
	}
	l.grantInBackground(l.newLease(next, now), a)
}

// grantInBackground grants ls a slice of at least a's estimate, in the
// background. Called with l.mu held.
func (l *Ledger) grantInBackground(ls *lease, a gateway.Admission) {
	call := inflight.Start()
	ls.granting = call
	go func() {
		start := time.Now()
		grant, err := l.grant(context.Background(), ls, a.Principal, a.Estimate)
		l.mu.Lock()
		defer l.mu.Unlock()
		if err != nil {
			ls.refillAfter = time.Now().Add(refusalMemory)
			l.cfg.Logger.Debug("error granting a quota slice ahead of need", "error", err)
		}
		l.granted(ls, call, start, grant, err)
	}()
}

// granted ends the grant call to ls, started at start, with its outcome.
// Called with l.mu held.
func (l *Ledger) granted(ls *lease, call *inflight.Call, start time.Time, grant store.QuotaGrant, err error) {
	ls.granting = nil
	call.End(err)
	if err != nil {
		return
	}
	ls.stored = true
	ls.validUntil = start.Add(l.cfg.Lease * 2 / 3)
	if grant.Outcome == gateway.AdmitOK {
		ls.avail += grant.Granted
		ls.lastGrant = grant.Granted
	} else {
		ls.refused, ls.refusedUntil = grant, start.Add(refusalMemory)
	}
}

// await waits until ch is closed or ctx ends.
func await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// refusal tells a refusal of estimate that waiting cannot cure, one that
// the end of the requests running may cure soon, one that the end of the
// account's batch items may cure, and one that the day's end will cure.
func refusal(g store.QuotaGrant, estimate int64) string {
	switch {
	case g.Outcome == gateway.AdmitDaily && estimate > g.Ceiling:
		return gateway.AdmitDailyNever
	case g.Outcome == gateway.AdmitBudget && estimate > g.Cap:
		return gateway.AdmitBudgetNever
	}
	return gateway.Held(g.Outcome, estimate, g.Free, g.Batches)
}

// grant asks for a slice of at least need on ls, a lease that lasts a lease
// from the statement's start by the database's clock.
func (l *Ledger) grant(ctx context.Context, ls *lease, p *gateway.Principal, need int64) (store.QuotaGrant, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
	defer cancel()
	g, err := l.store.GrantQuota(ctx, store.QuotaRequest{
		LeaseID: ls.id, Owner: l.cfg.Owner, AccountID: ls.key.account, ProjectID: ls.key.project, Day: ls.key.day,
		DefaultCeiling: p.Tier.DefaultDailyCeiling(), Need: need, Share: l.cfg.Share, Lease: l.cfg.Lease,
	})
	if err != nil {
		return g, fmt.Errorf("error admitting request: %w", err)
	}
	return g, nil
}

// slice returns the lease admissions of key draw on, starting a new one when
// there is none or the current one may no longer be used (its lease may have
// run out, or limits changed since it was granted). A replaced lease nothing
// runs under is returned too, for the caller to fold back before it asks for
// a new slice (so the new grant sees what the old one held). Called with l.mu
// held.
func (l *Ledger) slice(key sliceKey, now time.Time) (ls, replaced *lease) {
	ls = l.current[key]
	if ls != nil && ls.granting == nil && (ls.changed || (ls.stored && !now.Before(ls.validUntil))) {
		if ls.inflight == 0 {
			delete(l.leases, ls.id)
			if ls.stored {
				replaced = ls
			}
		}
		ls = nil
	}
	if ls == nil {
		ls = l.newLease(key, now)
	}
	return ls, replaced
}

// newLease starts the lease of key that admissions draw on, not yet granted.
// Called with l.mu held.
func (l *Ledger) newLease(key sliceKey, now time.Time) *lease {
	ls := &lease{id: uuid.Must(uuid.NewV7()), key: key, touched: now}
	l.current[key] = ls
	l.leases[ls.id] = ls
	return ls
}

// Settle commits a finished request with its group and gives what its
// estimate did not use back to its slice. It waits for the commit, whatever
// ctx says: a request's usage is stored before its reply is sent.
func (l *Ledger) Settle(ctx context.Context, r gateway.UsageRecord) error {
	l.mu.Lock()
	t, ok := l.admitted[r.RequestID]
	l.mu.Unlock()
	s := &settling{settlement: store.Settlement{Record: r}, span: tracing.SpanRefOf(ctx), done: make(chan error, 1), lead: make(chan struct{})}
	if ok {
		s.settlement.LeaseID = &t.lease.id
	}
	l.groupMu.Lock()
	l.pending = append(l.pending, s)
	if !l.inFlight {
		l.inFlight = true
		close(s.lead)
	}
	l.groupMu.Unlock()
	select {
	case err := <-s.done:
		if err != nil {
			return err
		}
	case <-s.lead:
		l.commitPending()
		if err := <-s.done; err != nil {
			return err
		}
	}
	l.end(r.RequestID, r.Usage.TotalRungs)
	return nil
}

// commitPending commits the settlements waiting (up to MaxGroup) in one
// transaction, then hands the turn to one that is still waiting, if any.
func (l *Ledger) commitPending() {
	l.groupMu.Lock()
	n := min(len(l.pending), l.cfg.MaxGroup)
	group := l.pending[:n:n]
	l.pending = l.pending[n:]
	l.groupMu.Unlock()

	l.commit(context.Background(), group)

	l.groupMu.Lock()
	defer l.groupMu.Unlock()
	if len(l.pending) == 0 {
		l.inFlight = false
		return
	}
	close(l.pending[0].lead)
}

// Release ends an admitted request that cost nothing: its estimate goes back
// to its slice, in memory.
func (l *Ledger) Release(requestID uuid.UUID) {
	l.end(requestID, 0)
}

// Unconfirmed ends an admitted request whose settlement may or may not be
// stored (its reply was lost, and the database stayed away while it was sent
// again): its cost stays counted against its slice, as a settled request's
// does, so the slice admits no more than it would have either way. The
// database's count of the lease, used when it is folded, holds the cost only
// if that settlement was stored; sent again later, it is charged to the
// account-day and the project directly, as a request whose lease is gone.
func (l *Ledger) Unconfirmed(requestID uuid.UUID, cost int64) {
	l.end(requestID, cost)
}

// end closes a request's ticket, its actual cost taken instead of its estimate.
func (l *Ledger) end(requestID uuid.UUID, cost int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, ok := l.admitted[requestID]
	if !ok {
		return
	}
	delete(l.admitted, requestID)
	t.lease.avail += t.estimate - cost
	t.lease.inflight--
	t.lease.touched = time.Now()
	if t.lease.inflight == 0 && l.retired(t.lease, t.lease.touched) {
		select { // its last request ended: fold it back now, not once idle
		case l.stale <- struct{}{}:
		default:
		}
	}
}

// retired reports whether nothing more is admitted from ls: it was replaced,
// limits changed since it was granted, or it could not be renewed in time.
// l.mu is held.
func (l *Ledger) retired(ls *lease, now time.Time) bool {
	return l.current[ls.key] != ls || ls.changed || !now.Before(ls.validUntil)
}

// Invalidate stops admissions from the slices held of account (of every
// account when it is uuid.Nil): its limits may have changed. Requests running
// under them settle as usual; the slices nothing runs under are folded back at
// once (the others when their last request ends), and new ones are granted
// under the new limits. Other accounts' slices are left as they are.
func (l *Ledger) Invalidate(account uuid.UUID) {
	l.mu.Lock()
	// Every lease is in l.leases, from its creation (its grant too) until it
	// is folded or replaced with nothing running under it.
	for _, ls := range l.leases {
		if account == uuid.Nil || ls.key.account == account {
			ls.changed = true
		}
	}
	l.mu.Unlock()
	select {
	case l.stale <- struct{}{}:
	default:
	}
}

// Run folds back idle slices and tries again the folds that failed at each
// beat, and renews the slices held every third of a lease, until ctx ends;
// then it folds back every slice nothing runs under. Renewals keep their own
// beat: a slice is used for two thirds of a lease from its last renewal's
// start, so a renewal skipped for a beat that a fold made late would let it
// lapse here while the database still holds it, and its next request would
// be granted a new one.
func (l *Ledger) Run(ctx context.Context) {
	tick := time.NewTicker(min(l.cfg.Idle, l.cfg.Lease/3))
	defer tick.Stop()
	renewal := time.NewTicker(l.cfg.Lease / 3)
	defer renewal.Stop()
	for {
		select {
		case <-ctx.Done():
			// The grants in flight, those in the background included, land
			// first, so that the slices they add to are folded back.
			inflight.Await(context.WithoutCancel(ctx), &l.mu, maps.Values(l.leases), func(ls *lease) *inflight.Call { return ls.granting })
			// Past a failed fold, the database is likely away: the slices
			// not folded are left to run out rather than the shutdown
			// waiting for another statement timeout.
			if l.foldIdle(context.WithoutCancel(ctx), true) == nil {
				l.refold(context.WithoutCancel(ctx))
			}
			return
		case <-l.stale:
			_ = l.foldIdle(ctx, false) // a failure is tried again at a beat
		case <-tick.C:
			_ = l.foldIdle(ctx, false)
			l.refold(ctx)
		case <-renewal.C:
			l.renew(ctx)
		}
	}
}

// commit stores a group in one transaction and tells each member the outcome.
// When the database is away every member is told so (and retries). When the
// group fails for its data, its members are committed one by one, so that the
// one at fault fails alone (D11).
func (l *Ledger) commit(ctx context.Context, group []*settling) {
	settlements := make([]store.Settlement, len(group))
	for i, s := range group {
		settlements[i] = s.settlement
	}
	var spans []tracing.SpanRef
	if tracing.On() {
		spans = make([]tracing.SpanRef, len(group))
		for i, s := range group {
			spans[i] = s.span
		}
	}
	span := tracing.StartSettlementsCommit(spans)
	cctx, cancel := context.WithTimeout(ctx, statementTimeout)
	start := time.Now()
	err := l.store.SettleRequests(cctx, settlements)
	cancel()
	tracing.EndCommit(span, err != nil)
	if err == nil {
		l.cfg.Metrics.GroupCommit(metrics.WorkSettlement, len(group), time.Since(start))
	}
	if err != nil && len(group) > 1 && !l.unavailable(err) {
		l.cfg.Logger.Warn("a group of settlements failed; committing them one by one", "requests", len(group), "error", err)
		for _, s := range group {
			l.commit(ctx, []*settling{s})
		}
		return
	}
	for _, s := range group {
		s.done <- err
	}
}

func (l *Ledger) unavailable(err error) bool {
	return l.cfg.Unavailable != nil && l.cfg.Unavailable(err)
}

// renew extends the leases held, a hundred at a time in the order of their
// ids (oldest first); one the database no longer holds (it ran out, and
// another replica folded it) is used no more. A statement that fails for its
// data is split so that one lease the database refuses keeps no other from
// its renewal (D11); when the database is away, the leases renewed before it
// went are kept and the others wait for the next round.
func (l *Ledger) renew(ctx context.Context) {
	l.mu.Lock()
	ids := make([]uuid.UUID, 0, len(l.leases))
	for id, ls := range l.leases {
		if ls.stored {
			ids = append(ids, id)
		}
	}
	l.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	start := time.Now()
	var tried, held []uuid.UUID
	var failure error
	queue := slices.Collect(slices.Chunk(ids, renewChunk))
	for len(queue) > 0 {
		chunk := queue[0]
		queue = queue[1:]
		renewed, err := l.renewChunk(ctx, chunk)
		switch {
		case err == nil:
			tried = append(tried, chunk...)
			held = append(held, renewed...)
		case l.unavailable(err) || ctx.Err() != nil:
			failure = err
			queue = nil // the rest wait for the next round
		case len(chunk) > 1:
			l.cfg.Logger.Warn("a renewal of quota leases failed; renewing them one by one", "leases", len(chunk), "error", err)
			singles := make([][]uuid.UUID, len(chunk))
			for i := range chunk {
				singles[i] = chunk[i : i+1]
			}
			queue = append(singles, queue...)
		default:
			failure = err // this lease alone: tried again at the next round
		}
	}
	switch {
	case failure == nil:
		l.renewals.Succeeded()
	case ctx.Err() == nil:
		l.renewals.Failed(failure)
	}
	l.renewed(start, tried, held)
}

// renewChunk renews ids in one statement and returns those still held.
func (l *Ledger) renewChunk(ctx context.Context, ids []uuid.UUID) ([]uuid.UUID, error) {
	rctx, cancel := context.WithTimeout(ctx, statementTimeout)
	defer cancel()
	return l.store.RenewQuotaLeases(rctx, l.cfg.Owner, ids, l.cfg.Lease)
}

// renewed records a renewal that started at start: of the leases tried,
// those held are used for two thirds of a lease from start, the others no
// more. Leases not tried are left as they were.
func (l *Ledger) renewed(start time.Time, tried, held []uuid.UUID) {
	still := make(map[uuid.UUID]bool, len(held))
	for _, id := range held {
		still[id] = true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range tried {
		ls := l.leases[id]
		if ls == nil {
			continue
		}
		if still[id] {
			ls.validUntil = start.Add(l.cfg.Lease * 2 / 3)
			continue
		}
		// Folded elsewhere: what settles under it is charged directly.
		ls.validUntil = time.Time{}
		if l.current[ls.key] == ls {
			delete(l.current, ls.key)
		}
		if ls.inflight == 0 {
			delete(l.leases, id)
		}
	}
}

// foldIdle folds back the slices nothing runs under that are idle or may no
// longer be used (all of them when all is set), and returns the fold's error.
func (l *Ledger) foldIdle(ctx context.Context, all bool) error {
	now := time.Now()
	l.mu.Lock()
	var idle []*lease
	for id, ls := range l.leases {
		if ls.inflight > 0 || ls.granting != nil {
			continue
		}
		// A slice granted ahead of its day is idle only from its start.
		if !all && !l.retired(ls, now) && now.Sub(later(ls.touched, ls.key.day)) < l.cfg.Idle {
			continue
		}
		delete(l.leases, id)
		if l.current[ls.key] == ls {
			delete(l.current, ls.key)
		}
		if ls.stored {
			idle = append(idle, ls)
		}
	}
	if len(idle) == 0 {
		l.mu.Unlock()
		return nil
	}
	return l.fold(ctx, idle)
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// fold folds back leases this replica no longer uses, with l.mu held on
// entry and released on return. Admissions of their keys wait until it ends,
// so that a new grant sees what the old slices held given back. A lease that
// fails to fold is kept for refold, which tries again at each beat of Run.
func (l *Ledger) fold(ctx context.Context, leases []*lease) error {
	done := make(chan struct{})
	defer close(done)
	ids := make([]uuid.UUID, len(leases))
	var keys []sliceKey
	for i, ls := range leases {
		ids[i] = ls.id
		if l.folding[ls.key] == nil {
			l.folding[ls.key] = done
			keys = append(keys, ls.key)
		}
	}
	l.mu.Unlock()
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
	defer cancel()
	_, err := l.store.FoldQuotaLeases(fctx, l.cfg.Owner, ids)
	if err != nil {
		l.cfg.Logger.Warn("error folding back quota leases; trying again at the next beat", "leases", len(ids), "error", err)
	}
	l.mu.Lock()
	for _, k := range keys {
		delete(l.folding, k)
	}
	if err != nil {
		// Renewed last before it was taken out of l.leases, each lease runs
		// out in the database within a lease from now.
		until := time.Now().Add(l.cfg.Lease)
		for _, id := range ids {
			l.unfolded[id] = until
		}
	}
	l.mu.Unlock()
	return err
}

// refold tries again to fold back the leases whose fold failed; when they
// fail together for their data (not because the database is away), each is
// tried alone, so that one the database refuses keeps no other away (D11). A
// lease that has run out in the database is left to the replicas' fold of
// expired leases (store.FoldExpiredQuotaLeases).
func (l *Ledger) refold(ctx context.Context) {
	now := time.Now()
	l.mu.Lock()
	ids := make([]uuid.UUID, 0, len(l.unfolded))
	for id, until := range l.unfolded {
		if !now.Before(until) {
			delete(l.unfolded, id)
			continue
		}
		ids = append(ids, id)
	}
	l.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	err := l.foldAgain(ctx, ids)
	if err != nil && len(ids) > 1 && !l.unavailable(err) {
		for _, id := range ids {
			_ = l.foldAgain(ctx, []uuid.UUID{id})
		}
	}
}

// foldAgain folds back ids, which refold tries again, and forgets them once
// folded.
func (l *Ledger) foldAgain(ctx context.Context, ids []uuid.UUID) error {
	fctx, cancel := context.WithTimeout(ctx, statementTimeout)
	defer cancel()
	if _, err := l.store.FoldQuotaLeases(fctx, l.cfg.Owner, ids); err != nil {
		if len(ids) == 1 {
			l.cfg.Logger.Warn("error folding back a quota lease again; trying again at the next beat", "lease", ids[0], "error", err)
		} else {
			l.cfg.Logger.Warn("error folding back quota leases again; trying again at the next beat", "leases", len(ids), "error", err)
		}
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		delete(l.unfolded, id)
	}
	return nil
}
