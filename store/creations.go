package store

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
	"github.com/rungworks/gateway/metrics"
)

// Bounds of a group of batch creations.
const (
	// maxCreationGroup bounds the creations stored in one transaction (each
	// up to 100 items).
	maxCreationGroup = 16
	// creationTimeout bounds the transaction that stores a group.
	creationTimeout = 10 * time.Second
	// creationWait bounds a creation's wait to be sent (for its turn, and
	// for a connection): while the database does not answer, the creations
	// queued behind a group in flight give up, instead of each waiting for
	// the groups before its own to time out.
	creationWait = 5 * time.Second
)

// creationGroups queues the batch creations of an account-day that arrive
// while another of the same account-day is being stored, so that they are
// stored together.
//
// Every creation charges its estimate to its account's day, a row that it
// locks from the charge to its commit, so one account's creations commit one
// after another on every replica. Sent each in a transaction of its own, a
// burst of them (a client sending its batches at once) queued on that row
// inside the database: a transaction, a lock wait and a flush each, and on two
// replicas more waits than on one. They queue in the replica instead: the
// creation that finds none of its account-day in flight stores every one
// waiting (up to maxCreationGroup, no two with one idempotency key) in one
// transaction, then hands the turn to one that arrived meanwhile, as the
// ledger does with settlements. Creations of different account-days do not
// wait for each other, only for a connection (see creationSlots).
type creationGroups struct {
	mu sync.Mutex
	// queues holds, while a creation of the account-day leads, those waiting.
	queues map[creationKey]*creationQueue
}

// creationKey is the account-day whose charge a creation takes.
type creationKey struct {
	account uuid.UUID
	day     time.Time
}

// creationQueue is the creations of one account-day waiting for their turn,
// in order of arrival; the turn goes to the first.
type creationQueue struct {
	waiting []*creation
}

// creation is one batch creation on its way to the database.
type creation struct {
	nb    NewBatch
	id    uuid.UUID
	items []db.InsertBatchItemsParams
	total int64
	// result and err are its outcome, set before done is closed.
	result CreateResult
	err    error
	done   chan struct{}
	// lead is closed when it is this creation's turn to store a group;
	// leading says so under creationGroups.mu.
	lead    chan struct{}
	leading bool
}

// create stores c with the creations of its account-day waiting with it, and
// returns its outcome. A creation whose ctx ends (or has ended), or that
// waited creationWait, before its group is sent leaves the queue, or gives up
// its turn to lead (see lead), and returns a notSent error; once its group is
// sent, it waits for the group's outcome.
func (g *creationGroups) create(ctx context.Context, s *Store, c *creation) (CreateResult, error) {
	ctx, cancel := context.WithTimeout(ctx, creationWait) // stored without it: see lead
	defer cancel()
	key := creationKey{account: c.nb.Principal.AccountID, day: gateway.UTCDay(c.nb.CreatedAt)}
	g.mu.Lock()
	if g.queues == nil {
		g.queues = map[creationKey]*creationQueue{}
	}
	q, ok := g.queues[key]
	if !ok {
		q = &creationQueue{}
		g.queues[key] = q
		c.takeTurn()
	}
	q.waiting = append(q.waiting, c)
	g.mu.Unlock()

	select {
	case <-c.done:
	case <-c.lead:
		g.lead(ctx, s, key, q, c)
	case <-ctx.Done():
		left, leading := g.leave(q, c)
		if left {
			return CreateResult{}, notSent{fmt.Errorf("error waiting for a turn to store a batch: %w", ctx.Err())}
		}
		if leading {
			g.lead(ctx, s, key, q, c)
		}
	}
	<-c.done
	return c.result, c.err
}

// leave takes c out of q (left), unless its turn came (leading: it must
// lead) or its group was sent (neither: it waits for the outcome).
func (g *creationGroups) leave(q *creationQueue, c *creation) (left, leading bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	i := slices.Index(q.waiting, c)
	if c.leading || i < 0 {
		return false, c.leading
	}
	q.waiting = slices.Delete(q.waiting, i, i+1)
	return true, false
}

// takeTurn makes c the one that stores the next group of its account-day.
// creationGroups.mu is held.
func (c *creation) takeTurn() {
	c.leading = true
	close(c.lead)
}

// passOn hands the turn to the first creation waiting, or ends the queue.
// g.mu is held.
func (g *creationGroups) passOn(key creationKey, q *creationQueue) {
	if len(q.waiting) == 0 {
		delete(g.queues, key)
		return
	}
	q.waiting[0].takeTurn()
}

// lead stores a group that begins with c, whose turn it is, once a
// connection is free, then passes the turn on. When ctx has ended, or ends
// before a connection is free, c alone gives up, with a notSent error.
func (g *creationGroups) lead(ctx context.Context, s *Store, key creationKey, q *creationQueue, c *creation) {
	if !acquire(ctx, s.creations) {
		g.mu.Lock()
		q.waiting = slices.DeleteFunc(q.waiting, func(w *creation) bool { return w == c })
		g.passOn(key, q)
		g.mu.Unlock()
		c.err = notSent{fmt.Errorf("error waiting for a connection to store a batch: %w", ctx.Err())}
		close(c.done)
		return
	}
	g.mu.Lock()
	group := q.take(maxCreationGroup)
	g.mu.Unlock()

	s.storeCreations(context.WithoutCancel(ctx), key, group)
	<-s.creations

	g.mu.Lock()
	g.passOn(key, q)
	g.mu.Unlock()
}

// acquire takes a place in places, unless ctx ends first or has ended
// (whether a place is free or not).
func acquire(ctx context.Context, places chan struct{}) bool {
	if ctx.Err() != nil {
		return false
	}
	select {
	case places <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// take removes and returns up to n of the creations waiting, in order, the
// first always, leaving any that names an id or an idempotency key of one
// taken before it for a later group: a group's creations are independent, so
// that it stores exactly what they would store one after another.
func (q *creationQueue) take(n int) []*creation {
	var group, rest []*creation
	ids := map[uuid.UUID]bool{}
	keys := map[string]bool{}
	for _, c := range q.waiting {
		k := c.nb.IdempotencyKey
		if len(group) == n || ids[c.id] || (k != "" && keys[k]) {
			rest = append(rest, c)
			continue
		}
		group = append(group, c)
		ids[c.id] = true
		if k != "" {
			keys[k] = true
		}
	}
	q.waiting = rest
	return group
}

// storeCreations stores group in one transaction and closes each member's
// done. When the database is away every member is told so. When the group
// fails for its data, its members are stored one by one, so that the one at
// fault fails alone (D11).
func (s *Store) storeCreations(ctx context.Context, key creationKey, group []*creation) {
	cctx, cancel := context.WithTimeout(ctx, creationTimeout)
	start := time.Now()
	err := s.createTogether(cctx, key, group)
	cancel()
	if err == nil {
		s.metrics.GroupCommit(metrics.WorkBatchCreations, len(group), time.Since(start))
	}
	if err != nil && len(group) > 1 && !Transient(err) {
		for _, c := range group {
			s.storeCreations(ctx, key, []*creation{c})
		}
		return
	}
	for _, c := range group {
		if err != nil {
			c.result, c.err = CreateResult{}, err
		}
		close(c.done)
	}
}

// createTogether stores the creations of one account-day in one transaction,
// and sets the outcome of each: created, refused by the daily ceiling (its
// batch removed again), or resolved to the batch that already holds its id
// or its idempotency key.
func (s *Store) createTogether(ctx context.Context, key creationKey, group []*creation) error {
	account, day := key.account, key.day
	batches := db.InsertBatchesParams{AccountID: account}
	for _, c := range group {
		batches.Ids = append(batches.Ids, c.id)
		batches.ProjectIds = append(batches.ProjectIds, c.nb.Principal.ProjectID)
		batches.TotalRequests = append(batches.TotalRequests, int32(len(c.nb.Items)))
		batches.IdempotencyKeys = append(batches.IdempotencyKeys, c.nb.IdempotencyKey)
		batches.RequestHashes = append(batches.RequestHashes, c.nb.RequestHash)
		batches.CreatedAts = append(batches.CreatedAts, c.nb.CreatedAt)
		batches.ExpiresAts = append(batches.ExpiresAts, c.nb.ExpiresAt)
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		inserted, err := s.queries.InsertBatches(ctx, tx, batches)
		if err != nil {
			return fmt.Errorf("error inserting batches: %w", err)
		}
		var fresh []*creation
		for _, c := range group {
			c.result, c.err = CreateResult{}, nil
			if !slices.Contains(inserted, c.id) {
				if err := s.resolveTaken(ctx, tx, c); err != nil {
					return err
				}
				continue
			}
			fresh = append(fresh, c)
		}
		if len(fresh) == 0 {
			return nil
		}
		outcomes, err := s.admitCreations(ctx, tx, key, fresh)
		if err != nil {
			return err
		}
		var refused []uuid.UUID
		var free, batches int64 // the day's room, read on the first refusal by the ceiling
		roomRead := false
		for i, c := range fresh {
			if outcomes[i] == gateway.AdmitDaily {
				if !roomRead {
					free, batches, err = s.dailyRoom(ctx, tx, account, c.nb.Principal.Tier.DefaultDailyCeiling(), day, uncharged(fresh, outcomes))
					if err != nil {
						return err
					}
					roomRead = true
				}
				outcomes[i] = gateway.Held(outcomes[i], c.total, free, batches)
			}
			if err := gateway.AdmissionError(outcomes[i], "batch", c.total, c.nb.Principal, day); err != nil {
				c.err = err
				refused = append(refused, c.id)
				continue
			}
			c.result = CreateResult{BatchID: c.id}
		}
		if len(refused) > 0 {
			if err := s.queries.DeleteRefusedBatches(ctx, tx, refused); err != nil {
				return fmt.Errorf("error removing refused batches: %w", err)
			}
		}
		return nil
	})
}

// admitCreations sends the items of the creations fresh, whose batches tx
// inserted, and charges their estimates to the day, as far as the ceiling
// allows; it returns each one's outcome (gateway.AdmitOK or a refusal). The
// day's charge is read first, without a lock, and a creation that it leaves
// no room for (charging the creations before it in turn, as admit_batches
// does) is refused before its items are sent: a client repeating a refused
// creation, whose items may take megabytes, writes nothing of them.
func (s *Store) admitCreations(ctx context.Context, tx pgx.Tx, key creationKey, fresh []*creation) ([]string, error) {
	room, err := s.queries.DayCharge(ctx, tx, db.DayChargeParams{AccountID: key.account, Day: key.day})
	if err != nil {
		return nil, fmt.Errorf("error reading the day's charge: %w", err)
	}
	outcomes := make([]string, len(fresh))
	var sent []int // indexes in fresh of the creations whose items are sent
	var items []db.InsertBatchItemsParams
	var charge db.AdmitBatchesParams
	var added int64 // the estimates of those sent, charged in turn as admit_batches does
	for i, c := range fresh {
		tierCeiling := c.nb.Principal.Tier.DefaultDailyCeiling()
		ceiling := tierCeiling
		if room.DailyRungCeiling != nil {
			ceiling = *room.DailyRungCeiling
		}
		switch {
		case c.total > ceiling:
			outcomes[i] = gateway.AdmitDailyNever
		case c.total > ceiling-room.ChargedRungs-added:
			outcomes[i] = gateway.AdmitDaily
		default:
			added += c.total
			sent = append(sent, i)
			items = append(items, c.items...)
			charge.DefaultCeilings = append(charge.DefaultCeilings, tierCeiling)
			charge.Estimates = append(charge.Estimates, c.total)
		}
	}
	if len(sent) == 0 {
		return outcomes, nil
	}
	if _, err := s.queries.InsertBatchItems(ctx, tx, items); err != nil {
		return nil, fmt.Errorf("error inserting batch items: %w", err)
	}
	// One notification wakes the replicas (its payload is not read);
	// should the ceiling refuse every batch, a wake finds nothing.
	if err := s.queries.NotifyBatchCreated(ctx, tx, fresh[sent[0]].id.String()); err != nil {
		return nil, fmt.Errorf("error notifying replicas: %w", err)
	}
	// The charge comes last: it locks the account-day row every batch and
	// quota grant of the account needs, and holds it until the commit.
	charge.AccountID, charge.Day = key.account, key.day
	charged, err := s.queries.AdmitBatches(ctx, tx, charge)
	if err != nil {
		return nil, fmt.Errorf("error charging batch estimates: %w", err)
	}
	if len(charged) != len(sent) {
		return nil, fmt.Errorf("error charging batch estimates: %d outcomes for %d batches", len(charged), len(sent))
	}
	for j, i := range sent {
		outcomes[i] = charged[j]
	}
	return outcomes, nil
}

// uncharged is the ids of the batches of fresh whose estimate was not
// charged (outcomes, in order).
func uncharged(fresh []*creation, outcomes []string) []uuid.UUID {
	var ids []uuid.UUID
	for i, c := range fresh {
		if outcomes[i] != gateway.AdmitOK {
			ids = append(ids, c.id)
		}
	}
	return ids
}

// resolveTaken sets the outcome of a creation whose batch was not inserted:
// its id, or the account's idempotency key it names, is taken.
func (s *Store) resolveTaken(ctx context.Context, tx pgx.Tx, c *creation) error {
	key := c.nb.IdempotencyKey
	if key == "" {
		// Only the id was taken: by this same creation, sent before.
		c.result = CreateResult{BatchID: c.id}
		return nil
	}
	existing, err := s.queries.GetBatchByIdempotencyKey(ctx, plannedPerCall{tx}, db.GetBatchByIdempotencyKeyParams{AccountID: c.nb.Principal.AccountID, IdempotencyKey: &key})
	if err != nil {
		return fmt.Errorf("error reading batch of idempotency key: %w", err)
	}
	switch {
	case existing.ID == c.id:
		c.result = CreateResult{BatchID: c.id}
	case !bytes.Equal(existing.RequestHash, c.nb.RequestHash):
		c.err = gateway.Errorf(gateway.EIdempotencyKeyReused, "the Idempotency-Key was already used for a different batch request")
	default:
		c.result = CreateResult{BatchID: existing.ID, Replayed: true}
	}
	return nil
}
