package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/db"
)

// ItemRequest is a batch item's validated request, as stored with the item.
type ItemRequest struct {
	Prompt             string        `json:"prompt"`
	Model              gateway.Model `json:"model"`
	MaxOutputRungs     uint64        `json:"max_output_rungs"`
	IncludeRegions     bool          `json:"include_regions,omitempty"`
	CustomInstructions string        `json:"custom_instructions,omitempty"`
	WebSearch          bool          `json:"web_search,omitempty"`
	CodeMode           bool          `json:"code_mode,omitempty"`
	ImageMode          bool          `json:"image_mode,omitempty"`
}

// NewItemRequest stores req.
func NewItemRequest(req gateway.Request) ItemRequest {
	return ItemRequest{
		Prompt: req.Prompt, Model: req.Model, MaxOutputRungs: req.MaxOutputRungs, IncludeRegions: req.IncludeRegions,
		CustomInstructions: req.CustomInstructions, WebSearch: req.Hints.WebSearch, CodeMode: req.Hints.CodeMode, ImageMode: req.Hints.ImageMode,
	}
}

// Request is the stored request as the domain's.
func (r ItemRequest) Request() gateway.Request {
	return gateway.Request{
		Prompt: r.Prompt, Model: r.Model, ModelExplicit: true, MaxOutputRungs: r.MaxOutputRungs, IncludeRegions: r.IncludeRegions,
		CustomInstructions: r.CustomInstructions, Hints: gateway.Hints{WebSearch: r.WebSearch, CodeMode: r.CodeMode, ImageMode: r.ImageMode},
	}
}

// NewBatch is a validated batch to store.
type NewBatch struct {
	// ID is the batch's id; uuid.Nil: a new one. A creation sent again with
	// the id of one already stored (its reply was lost) stores nothing more
	// and returns that batch as created.
	ID             uuid.UUID
	Principal      *gateway.Principal
	IdempotencyKey string // empty: none
	// RequestHash identifies the request body, to tell a replay from a reuse.
	RequestHash []byte
	Items       []NewItem
	CreatedAt   time.Time
	ExpiresAt   time.Time
}

// NewItem is one validated item and its batch-priced estimate.
type NewItem struct {
	Request  ItemRequest
	Estimate int64
}

// CreateResult says what CreateBatch did.
type CreateResult struct {
	BatchID uuid.UUID
	// Replayed: the idempotency key named an existing batch with the same body.
	Replayed bool
}

// CreateBatch stores a batch durably in one transaction: the batch, its items
// and the charge of its whole estimate to the account's day (each item settles
// its part when it finishes). The daily ceiling refusing it is RATE_LIMITED and
// stores nothing; an idempotency key already used returns that batch (Replayed)
// when the body is the same and IDEMPOTENCY_KEY_REUSED otherwise. Concurrent
// creates with one key create one batch. A creation sent again with nb.ID
// already stored returns it, created. Replicas are woken by a notification on
// commit. Creations of one account-day that arrive together share their
// transaction (see creationGroups); a caller whose ctx ends before its
// creation was sent gets an error that says nothing was.
func (s *Store) CreateBatch(ctx context.Context, nb NewBatch) (CreateResult, error) {
	c := &creation{nb: nb, id: nb.ID, done: make(chan struct{}), lead: make(chan struct{})}
	if c.id == uuid.Nil {
		c.id = newID()
	}
	p := nb.Principal
	c.items = make([]db.InsertBatchItemsParams, len(nb.Items))
	for i, it := range nb.Items {
		c.total += it.Estimate
		raw, err := json.Marshal(it.Request)
		if err != nil {
			return CreateResult{}, fmt.Errorf("error encoding item request: %w", err)
		}
		c.items[i] = db.InsertBatchItemsParams{
			BatchID: c.id, Idx: int32(i), AccountID: p.AccountID, ProjectID: p.ProjectID, ApiKeyID: p.KeyID,
			RequestID: newID(), Status: string(gateway.ItemQueued), Request: raw, Model: string(it.Request.Model),
			EstimateRungs: it.Estimate, QueuedAt: nb.CreatedAt, ExpiresAt: nb.ExpiresAt,
		}
	}
	return s.groups.create(ctx, s, c)
}

// HashRequest is the identity of a batch request body for idempotency: the
// SHA-256 of its canonical JSON.
func HashRequest(v any) ([]byte, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("error encoding batch request: %w", err)
	}
	sum := sha256.Sum256(raw)
	return sum[:], nil
}

func errBatchNotFound(id uuid.UUID) error {
	return gateway.Errorf(gateway.EBatchNotFound, "no batch %s", id)
}

// Batch returns one of the account's batches.
func (s *Store) Batch(ctx context.Context, accountID, id uuid.UUID) (*gateway.Batch, error) {
	row, err := s.queries.GetBatch(ctx, s.pool, db.GetBatchParams{ID: id, AccountID: accountID})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errBatchNotFound(id)
	}
	if err != nil {
		return nil, fmt.Errorf("error reading batch: %w", err)
	}
	return batchOf(db.ListBatchesRow(row)), nil
}

// Batches returns up to limit of the account's batches, newest first, older
// than the batch after when it is set.
func (s *Store) Batches(ctx context.Context, accountID uuid.UUID, after *uuid.UUID, limit int) ([]*gateway.Batch, error) {
	rows, err := s.queries.ListBatches(ctx, plannedPerCall{s.pool}, db.ListBatchesParams{AccountID: accountID, After: after, MaxRows: int32(limit)})
	if err != nil {
		return nil, fmt.Errorf("error listing batches: %w", err)
	}
	out := make([]*gateway.Batch, len(rows))
	for i, r := range rows {
		out[i] = batchOf(r)
	}
	return out, nil
}

// OperatorBatch is a batch as operators list it: with its account and
// project, its items counted by outcome.
type OperatorBatch = db.ListBatchesForOperatorRow

// BatchesForOperator returns up to limit batches of every account, or of the
// account named (ErrAccountNotFound when there is none), newest first; only
// those in one of statuses unless statuses is nil, and only those listed
// after the batch before (older by id) unless before is nil: the next page.
func (s *Store) BatchesForOperator(ctx context.Context, account string, statuses []gateway.BatchStatus, before *uuid.UUID, limit int) ([]OperatorBatch, error) {
	rows, err := s.queries.ListBatchesForOperator(ctx, s.pool, db.ListBatchesForOperatorParams{Account: nameFilter(account), Statuses: texts(statuses), Before: before, MaxRows: int32(limit)})
	if err != nil {
		return nil, fmt.Errorf("error listing batches: %w", err)
	}
	if len(rows) == 0 {
		return nil, s.accountKnown(ctx, account)
	}
	return rows, nil
}

func batchOf(r db.ListBatchesRow) *gateway.Batch {
	b := &gateway.Batch{
		ID: r.ID, Status: gateway.BatchStatus(r.Status), Total: int(r.TotalRequests),
		Completed: int(r.CompletedRequests), Failed: int(r.FailedRequests), Cancelled: int(r.CancelledRequests),
		Usage:     gateway.Usage{InputRungs: r.InputRungs, OutputRungs: r.OutputRungs, TotalRungs: r.TotalRungs},
		CreatedAt: r.CreatedAt, StartedAt: r.StartedAt, CompletedAt: r.CompletedAt, ExpiresAt: r.ExpiresAt,
	}
	if r.ErrorCode != nil {
		b.Error = &gateway.Error{Code: gateway.ErrorCode(*r.ErrorCode), Message: deref(r.ErrorMessage)}
	}
	return b
}

// BatchItems returns the items of one of the account's batches after index
// after (-1: from the first), ordered by index, outcomes included: as many as
// fit in maxBytes of content, and at least one. A batch the account does not
// own has no items here: callers read the batch first (Batch) for its 404.
func (s *Store) BatchItems(ctx context.Context, accountID, id uuid.UUID, after int, maxBytes int64) ([]gateway.BatchItem, error) {
	rows, err := s.queries.GetBatchItems(ctx, s.pool, db.GetBatchItemsParams{BatchID: id, AccountID: accountID, After: int32(after), MaxBytes: maxBytes})
	if err != nil {
		return nil, fmt.Errorf("error reading batch items: %w", err)
	}
	items := make([]gateway.BatchItem, len(rows))
	for i, r := range rows {
		it := gateway.BatchItem{
			Index: int(r.Idx), Status: gateway.ItemStatus(r.Status),
			Usage: gateway.Usage{InputRungs: r.InputRungs, OutputRungs: r.OutputRungs, TotalRungs: r.TotalRungs},
		}
		switch it.Status {
		case gateway.ItemCompleted:
			requestID := r.RequestID
			it.RequestID, it.Model, it.Content = &requestID, gateway.Model(r.Model), deref(r.Content)
			if r.Provider != nil && r.UpstreamModel != nil && r.Attempts != nil {
				it.Route = &gateway.UpstreamRoute{Provider: *r.Provider, UpstreamModel: *r.UpstreamModel, Attempts: int(*r.Attempts)}
			}
		case gateway.ItemFailed:
			it.Error = &gateway.Error{Code: gateway.ErrorCode(deref(r.ErrorCode)), Message: deref(r.ErrorMessage)}
		}
		items[i] = it
	}
	return items, nil
}

// CancelBatch asks to cancel one of the account's batches: a queued batch is
// cancelled with every item; an in-progress batch becomes cancelling, its unrun
// items cancelled at once, and cancelled when its running items finish. Any
// other status is BATCH_NOT_CANCELLABLE.
//
// The batch row is locked first; then its queued items are cancelled
// (waiting for a claim holding some of them, whose items then count as
// running; a batch that cannot be cancelled has none queued); then the
// transition, which refuses a batch that cannot be cancelled, reads the
// items afresh, so a queued batch with items already claimed becomes
// cancelling, not cancelled, and no terminal batch is left with items
// running.
func (s *Store) CancelBatch(ctx context.Context, accountID, id uuid.UUID) error {
	_, err := s.cancelBatch(ctx, &accountID, id)
	return err
}

// CancelBatchForOperator cancels a batch of any account, as its owner would
// (CancelBatch), and returns its status after: cancelled, or cancelling while
// its running items finish.
func (s *Store) CancelBatchForOperator(ctx context.Context, id uuid.UUID) (gateway.BatchStatus, error) {
	return s.cancelBatch(ctx, nil, id)
}

// CancelOutcome is what cancelling one batch of many came to: its status
// after, or why it was not cancelled.
type CancelOutcome struct {
	ID     uuid.UUID
	Status gateway.BatchStatus
	Err    error
}

// cancelPage is how many batches CancelAccountBatches lists at a time.
const cancelPage = 1000

// CancelAccountBatches cancels every batch of the named account that can be
// cancelled (queued or in progress), each as CancelBatchForOperator would, in
// a transaction of its own, and returns what came of each: one that fails is
// reported and the others go on. It lists them a page at a time, newest
// first, so that batches that fail, however many, do not hide the others,
// and lists them again from the newest until a pass finds none that it has
// not tried, so batches created meanwhile are cancelled too. It stops when
// ctx ends, with what it has done. An account that does not exist is
// ErrAccountNotFound.
func (s *Store) CancelAccountBatches(ctx context.Context, account string) ([]CancelOutcome, error) {
	return s.cancelAccountBatches(ctx, account, cancelPage)
}

// cancelAccountBatches is CancelAccountBatches listing page batches at a
// time.
func (s *Store) cancelAccountBatches(ctx context.Context, account string, page int) ([]CancelOutcome, error) {
	cancellable := slices.DeleteFunc(slices.Clone(gateway.BatchStatuses), func(st gateway.BatchStatus) bool { return !st.Cancellable() })
	var out []CancelOutcome
	tried := map[uuid.UUID]bool{}
	var before *uuid.UUID // the pass's next page starts after it; nil: at the newest
	triedInPass := false
	for {
		found, err := s.BatchesForOperator(ctx, account, cancellable, before, page)
		if err != nil {
			return out, err
		}
		for _, b := range found {
			if tried[b.ID] {
				continue
			}
			if err := ctx.Err(); err != nil {
				return out, fmt.Errorf("error cancelling batches: %w", err)
			}
			tried[b.ID], triedInPass = true, true
			status, err := s.CancelBatchForOperator(ctx, b.ID)
			out = append(out, CancelOutcome{ID: b.ID, Status: status, Err: err})
		}
		switch {
		case len(found) == page:
			before = &found[len(found)-1].ID
		case !triedInPass:
			return out, nil
		default:
			before, triedInPass = nil, false
		}
	}
}

// cancelBatch cancels a batch of the account, or of any account when
// accountID is nil, and returns its status after.
func (s *Store) cancelBatch(ctx context.Context, accountID *uuid.UUID, id uuid.UUID) (status gateway.BatchStatus, err error) {
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		_, err := s.queries.LockBatch(ctx, tx, db.LockBatchParams{ID: id, AccountID: accountID})
		if errors.Is(err, pgx.ErrNoRows) {
			return errBatchNotFound(id)
		}
		if err != nil {
			return fmt.Errorf("error locking batch: %w", err)
		}
		reason := "owner"
		if _, err := s.queries.CancelQueuedItems(ctx, plannedPerCall{tx}, db.CancelQueuedItemsParams{BatchID: id, Reason: &reason}); err != nil {
			return fmt.Errorf("error cancelling items: %w", err)
		}
		if status, _, err = s.transition(ctx, tx, id, accountID, gateway.EventCancel); err != nil {
			return err
		}
		finished, err := s.finishIfDone(ctx, tx, id)
		if err != nil {
			return err
		}
		if finished {
			status = gateway.BatchCancelled
		}
		if status != gateway.BatchCancelling {
			return nil
		}
		return s.notifyBatchStopped(ctx, tx, id) // items of it are claimed
	})
	return status, err
}

// notifyBatchStopped tells every replica, once tx commits, that batch id's
// items it claimed and has not started must not start (ListenBatches).
func (s *Store) notifyBatchStopped(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
	if err := s.queries.NotifyBatchStopped(ctx, tx, id.String()); err != nil {
		return fmt.Errorf("error notifying a stopped batch: %w", err)
	}
	return nil
}

// transition applies ev to a batch under its row lock, through the state
// machine in gateway.NextBatchStatus: to is its status after, moved says
// whether it changed.
func (s *Store) transition(ctx context.Context, tx pgx.Tx, id uuid.UUID, accountID *uuid.UUID, ev gateway.BatchEvent) (to gateway.BatchStatus, moved bool, err error) {
	row, err := s.queries.LockBatch(ctx, tx, db.LockBatchParams{ID: id, AccountID: accountID})
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, errBatchNotFound(id)
	}
	if err != nil {
		return "", false, fmt.Errorf("error locking batch: %w", err)
	}
	from := gateway.BatchStatus(row.Status)
	outcome := gateway.ItemsOutcome{AnySucceeded: row.Succeeded > 0, WindowElapsed: row.ExpiredItems > 0, Running: row.Running > 0}
	if ev == gateway.EventItemsDone && row.Unfinished > 0 {
		return from, false, nil
	}
	to, err = gateway.NextBatchStatus(from, ev, outcome)
	if err != nil {
		return from, false, err
	}
	if to == from {
		return to, false, nil
	}
	params := db.SetBatchStatusParams{ID: id, Status: string(to)}
	if e := gateway.BatchError(to, gateway.ErrorCode(row.FirstError)); e != nil {
		code := string(e.Code)
		params.ErrorCode, params.ErrorMessage = &code, &e.Message
	}
	if err := s.queries.SetBatchStatus(ctx, tx, params); err != nil {
		return from, false, fmt.Errorf("error setting batch status: %w", err)
	}
	return to, true, nil
}

// finishIfDone makes a batch terminal when none of its items is unfinished;
// moved says whether it did.
func (s *Store) finishIfDone(ctx context.Context, tx pgx.Tx, id uuid.UUID) (moved bool, err error) {
	_, moved, err = s.transition(ctx, tx, id, nil, gateway.EventItemsDone)
	if errors.Is(err, gateway.ErrInvalidTransition) {
		return false, nil // already terminal
	}
	return moved, err
}

// FinishBatches makes each batch terminal whose items all reached an outcome.
func (s *Store) FinishBatches(ctx context.Context, ids []uuid.UUID) error {
	return s.moveBatches(ctx, ids, s.queries.DoneBatches, func(tx pgx.Tx, id uuid.UUID) (bool, error) {
		return s.finishIfDone(ctx, tx, id)
	})
}

// StartBatches moves queued batches to in_progress (an item was dispatched).
func (s *Store) StartBatches(ctx context.Context, ids []uuid.UUID) error {
	return s.moveBatches(ctx, ids, s.queries.QueuedBatches, func(tx pgx.Tx, id uuid.UUID) (bool, error) {
		_, moved, err := s.transition(ctx, tx, id, nil, gateway.EventDrainStarted)
		if errors.Is(err, gateway.ErrInvalidTransition) {
			return false, nil
		}
		return moved, err
	})
}

// errNotMoved ends a transaction that moved no batch.
var errNotMoved = errors.New("batch not moved")

// moveBatches moves the batches of ids that one read without locks (pick)
// finds able to move, together in one transaction: each commit is a disk
// sync, and a drain of small batches starts and finishes dozens at once.
// They are locked in key order, so that replicas moving overlapping sets of
// batches wait for one another instead of deadlocking. When the group fails,
// each batch is moved again in a transaction of its own, so that one that
// fails is reported while the others still move (D11).
func (s *Store) moveBatches(ctx context.Context, ids []uuid.UUID, pick func(context.Context, db.DBTX, []uuid.UUID) ([]uuid.UUID, error),
	move func(pgx.Tx, uuid.UUID) (bool, error)) error {
	if len(ids) == 0 {
		return nil
	}
	movable, err := pick(ctx, s.pool, ids)
	if err != nil {
		return fmt.Errorf("error finding the batches to move: %w", err)
	}
	slices.SortFunc(movable, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	if len(movable) > 1 && s.moveTogether(ctx, movable, move) == nil {
		return nil
	}
	return eachBatch(movable, func(id uuid.UUID) error {
		return s.moveTogether(ctx, []uuid.UUID{id}, move)
	})
}

// moveTogether moves batches in one transaction. Replicas often ask to move
// the same batch: a transaction that moved none (another replica moved them
// meanwhile; move reports them unmoved) is rolled back instead of committed,
// since it wrote nothing and a commit would wait for a disk sync.
func (s *Store) moveTogether(ctx context.Context, ids []uuid.UUID, move func(pgx.Tx, uuid.UUID) (bool, error)) error {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		movedAny := false
		for _, id := range ids {
			moved, err := move(tx, id)
			if err != nil {
				return err
			}
			movedAny = movedAny || moved
		}
		if !movedAny {
			return errNotMoved
		}
		return nil
	})
	if errors.Is(err, errNotMoved) {
		return nil
	}
	return err
}

// eachBatch runs fn for every batch, going on past failures (D11), and returns
// them joined, each naming its batch.
func eachBatch(ids []uuid.UUID, fn func(uuid.UUID) error) error {
	var failures []error
	for _, id := range ids {
		if err := fn(id); err != nil {
			failures = append(failures, fmt.Errorf("batch %s: %w", id, err))
		}
	}
	return errors.Join(failures...)
}

// ExpireBatches applies the end of the completion window to up to maxRows
// open batches past it: unrun items are cancelled, and a batch with nothing
// running becomes expired. A batch whose items all ended before (its finish
// missed; see FinishStrandedBatches) is finished by them instead: expired
// says the window ended before every item ran. It returns how many batches
// it looked at.
func (s *Store) ExpireBatches(ctx context.Context, maxRows int32) (int64, error) {
	ids, err := s.queries.BatchesPastWindow(ctx, plannedPerCall{s.pool}, maxRows)
	if err != nil {
		return 0, fmt.Errorf("error finding expired batches: %w", err)
	}
	err = eachBatch(ids, func(id uuid.UUID) error {
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if finished, err := s.finishIfDone(ctx, tx, id); err != nil || finished {
				return err
			}
			reason := "expiry"
			if _, err := s.queries.CancelQueuedItems(ctx, plannedPerCall{tx}, db.CancelQueuedItemsParams{BatchID: id, Reason: &reason}); err != nil {
				return fmt.Errorf("error cancelling expired items: %w", err)
			}
			to, _, err := s.transition(ctx, tx, id, nil, gateway.EventWindowElapsed) // valid from any status
			if err != nil {
				return err
			}
			finished, err := s.finishIfDone(ctx, tx, id)
			if err != nil || finished || to.Terminal() {
				return err
			}
			return s.notifyBatchStopped(ctx, tx, id) // open: items of it are claimed
		})
	})
	return int64(len(ids)), err
}

// FinishStrandedBatches finalizes open batches whose items all reached an
// outcome but whose finalization was missed (a replica died in between).
func (s *Store) FinishStrandedBatches(ctx context.Context, maxRows int32) (int64, error) {
	ids, err := s.queries.UnfinishedBatches(ctx, plannedPerCall{s.pool}, maxRows)
	if err != nil {
		return 0, fmt.Errorf("error finding stranded batches: %w", err)
	}
	return int64(len(ids)), s.FinishBatches(ctx, ids)
}

// RescueExpiredLeases fails items whose replica died (lease ran out) with
// INTERRUPTED and finalizes their batches.
func (s *Store) RescueExpiredLeases(ctx context.Context, maxRows int32) (int64, error) {
	ids, err := s.queries.RescueExpiredLeases(ctx, s.pool, maxRows)
	if err != nil {
		return 0, fmt.Errorf("error rescuing expired leases: %w", err)
	}
	return int64(len(ids)), s.FinishBatches(ctx, ids)
}

// DeleteOldBatches removes up to maxRows terminal batches completed before
// before, the earliest first, reading from where its last run stopped (see
// resumeMark).
func (s *Store) DeleteOldBatches(ctx context.Context, before time.Time, maxRows int32) (int64, error) {
	return s.batchesMark.run(func(from time.Time) (int64, time.Time, error) {
		row, err := s.queries.DeleteOldBatches(ctx, plannedPerCall{s.pool}, db.DeleteOldBatchesParams{Before: before, CompletedFrom: from, MaxRows: maxRows})
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("error deleting old batches: %w", err)
		}
		return row.Removed, row.ReadFrom, nil
	})
}

// ExpireIdempotencyKeys forgets up to maxRows idempotency keys of batches
// created before before, the earliest first, reading from where its last
// run stopped (see resumeMark).
func (s *Store) ExpireIdempotencyKeys(ctx context.Context, before time.Time, maxRows int32) (int64, error) {
	return s.keysMark.run(func(from time.Time) (int64, time.Time, error) {
		row, err := s.queries.ExpireIdempotencyKeys(ctx, plannedPerCall{s.pool}, db.ExpireIdempotencyKeysParams{Before: before, CreatedFrom: from, MaxRows: maxRows})
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("error expiring idempotency keys: %w", err)
		}
		return row.Expired, row.ReadFrom, nil
	})
}

// ClaimedItem is a batch item leased to a replica.
type ClaimedItem struct {
	BatchID   uuid.UUID
	Index     int
	AccountID uuid.UUID
	Request   ItemRequest
	// BatchQueued: the batch had not started; its drain starts now.
	BatchQueued bool
	// BudgetRefused: the item (and its batch's unrun items) failed with
	// BUDGET_EXCEEDED instead of being claimed.
	BudgetRefused bool
}

// ClaimParams shape a claim.
type ClaimParams struct {
	Owner uuid.UUID
	// ClaimID marks the claimed items, for ReleaseClaim should the reply be lost.
	ClaimID    uuid.UUID
	Max        int
	PerAccount int
	Lease      time.Duration
	// Models limits the claim to items of these models; nil means every model.
	Models []gateway.Model
	// Skip names accounts whose items are not claimed now (held off).
	Skip []uuid.UUID
}

// ClaimItems claims up to p.Max queued items in one statement (see
// claim_batch_items): fair across accounts, leased to p.Owner.
func (s *Store) ClaimItems(ctx context.Context, p ClaimParams) ([]ClaimedItem, error) {
	rows, err := s.queries.ClaimBatchItems(ctx, s.pool, db.ClaimBatchItemsParams{
		Owner: p.Owner, MaxItems: int32(p.Max), PerAccount: int32(p.PerAccount),
		Lease: interval(p.Lease), Pivot: uuid.Must(uuid.NewRandom()), ClaimID: p.ClaimID, Models: texts(p.Models), Skip: p.Skip,
	})
	if err != nil {
		return nil, fmt.Errorf("error claiming batch items: %w", err)
	}
	out := make([]ClaimedItem, len(rows))
	for i, r := range rows {
		var req ItemRequest
		if err := json.Unmarshal(r.Request, &req); err != nil {
			return nil, fmt.Errorf("error decoding item request: %w", err)
		}
		out[i] = ClaimedItem{
			BatchID: r.BatchID, Index: int(r.Idx), AccountID: r.AccountID,
			Request:     req,
			BatchQueued: r.BatchStatus == string(gateway.BatchQueued),
			// A refused item is returned failed, not claimed.
			BudgetRefused: !r.Claimed,
		}
	}
	return out, nil
}

// texts is values (models, statuses) as text for a query's array; nil stays
// nil (NULL: no filter).
func texts[T ~string](values []T) []string {
	if values == nil {
		return nil
	}
	out := make([]string, len(values))
	for i, v := range values {
		out[i] = string(v)
	}
	return out
}

// ItemResult is a leased item's outcome.
type ItemResult struct {
	BatchID           uuid.UUID
	Index             int
	Status            string
	Content           string
	InputTokens       int64
	OutputTokens      int64
	InputRungs        int64
	OutputRungs       int64
	TotalRungs        int64
	ErrorCode         string
	ErrorMessage      string
	Sources           []gateway.Source
	Verdict           string
	EvidenceExpiresAt time.Time
	// Provider, UpstreamModel and Attempts are the route of a completed item.
	Provider      string
	UpstreamModel string
	Attempts      int
	// Model is the item's model, for the caller's metrics; not stored.
	Model gateway.Model
}

// ItemKey names a batch item.
type ItemKey struct {
	BatchID uuid.UUID
	Index   int
}

// Key names the item of r.
func (r ItemResult) Key() ItemKey { return ItemKey{BatchID: r.BatchID, Index: r.Index} }

// Key names the item claimed.
func (it ClaimedItem) Key() ItemKey { return ItemKey{BatchID: it.BatchID, Index: it.Index} }

// CompleteItems commits the outcomes of items leased to owner in one
// transaction, returning the items applied; an item whose lease was lost is
// not. See complete_batch_items.
func (s *Store) CompleteItems(ctx context.Context, owner uuid.UUID, results []ItemResult) ([]ItemKey, error) {
	n := len(results)
	p := db.CompleteBatchItemsParams{
		Owner: owner, BatchIds: make([]uuid.UUID, n), Idxs: make([]int32, n), Statuses: make([]string, n),
		Contents: make([]string, n), InputTokens: make([]int64, n), OutputTokens: make([]int64, n),
		InputRungs: make([]int64, n), OutputRungs: make([]int64, n), TotalRungs: make([]int64, n),
		ErrorCodes: make([]string, n), ErrorMessages: make([]string, n), Sources: make([][]byte, n),
		Verdicts: make([]string, n), EvidenceExpiresAts: make([]time.Time, n), Providers: make([]string, n),
		UpstreamModels: make([]string, n), Attempts: make([]int16, n),
	}
	for i, r := range results {
		p.BatchIds[i], p.Idxs[i], p.Statuses[i], p.Contents[i] = r.BatchID, int32(r.Index), r.Status, r.Content
		p.InputTokens[i], p.OutputTokens[i] = r.InputTokens, r.OutputTokens
		p.InputRungs[i], p.OutputRungs[i], p.TotalRungs[i] = r.InputRungs, r.OutputRungs, r.TotalRungs
		p.ErrorCodes[i], p.ErrorMessages[i], p.Verdicts[i] = r.ErrorCode, r.ErrorMessage, r.Verdict
		p.EvidenceExpiresAts[i], p.Providers[i], p.UpstreamModels[i] = r.EvidenceExpiresAt, r.Provider, r.UpstreamModel
		p.Attempts[i] = int16(min(r.Attempts, math.MaxInt16))
		sources, err := sourcesJSON(r.Sources)
		if err != nil {
			return nil, err
		}
		p.Sources[i] = sources
	}
	rows, err := s.queries.CompleteBatchItems(ctx, s.pool, p)
	if err != nil {
		return nil, fmt.Errorf("error completing batch items: %w", err)
	}
	out := make([]ItemKey, len(rows))
	for i, r := range rows {
		out[i] = ItemKey{BatchID: r.BatchID, Index: int(r.Idx)}
	}
	return out, nil
}

// Requeued says where items handed back went: to the queue, or cancelled
// because their batch is cancelling or terminal.
type Requeued struct {
	Queued    []ItemKey
	Cancelled []ItemKey
}

// RequeueItems hands items leased to owner back unbilled: the upstream
// certainly never processed them (D12). See requeue_batch_items.
func (s *Store) RequeueItems(ctx context.Context, owner uuid.UUID, keys []ItemKey) (Requeued, error) {
	batchIDs, idxs := splitKeys(keys)
	return s.requeue(ctx, db.RequeueBatchItemsParams{Owner: owner, BatchIds: batchIDs, Idxs: idxs})
}

// ReleaseClaim hands back every item of a claim whose reply owner never
// received: it never dispatched them.
func (s *Store) ReleaseClaim(ctx context.Context, owner, claimID uuid.UUID) (Requeued, error) {
	return s.requeue(ctx, db.RequeueBatchItemsParams{Owner: owner, BatchIds: []uuid.UUID{}, Idxs: []int32{}, ClaimID: &claimID})
}

func (s *Store) requeue(ctx context.Context, p db.RequeueBatchItemsParams) (Requeued, error) {
	rows, err := s.queries.RequeueBatchItems(ctx, s.pool, p)
	if err != nil {
		return Requeued{}, fmt.Errorf("error requeueing batch items: %w", err)
	}
	var out Requeued
	for _, r := range rows {
		k := ItemKey{BatchID: r.BatchID, Index: int(r.Idx)}
		if r.Status == string(gateway.ItemQueued) {
			out.Queued = append(out.Queued, k)
		} else {
			out.Cancelled = append(out.Cancelled, k)
		}
	}
	return out, nil
}

// ItemOutcome is what is stored of an item's outcome.
type ItemOutcome struct {
	Status, ErrorCode string
	TotalRungs        int64
}

// ItemOutcomes returns the stored outcome of each of the items of keys that
// exists.
func (s *Store) ItemOutcomes(ctx context.Context, keys []ItemKey) (map[ItemKey]ItemOutcome, error) {
	batchIDs, idxs := splitKeys(keys)
	rows, err := s.queries.ItemOutcomes(ctx, plannedPerCall{s.pool}, db.ItemOutcomesParams{BatchIds: batchIDs, Idxs: idxs})
	if err != nil {
		return nil, fmt.Errorf("error reading item outcomes: %w", err)
	}
	out := make(map[ItemKey]ItemOutcome, len(rows))
	for _, r := range rows {
		out[ItemKey{BatchID: r.BatchID, Index: int(r.Idx)}] = ItemOutcome{Status: r.Status, ErrorCode: r.ErrorCode, TotalRungs: r.TotalRungs}
	}
	return out, nil
}

// RenewLeases extends the leases of the given items while owner holds them.
func (s *Store) RenewLeases(ctx context.Context, owner uuid.UUID, keys []ItemKey, lease time.Duration) (int64, error) {
	batchIDs, idxs := splitKeys(keys)
	n, err := s.queries.RenewLeases(ctx, plannedPerCall{s.pool}, db.RenewLeasesParams{Owner: owner, BatchIds: batchIDs, Idxs: idxs, Lease: interval(lease)})
	if err != nil {
		return 0, fmt.Errorf("error renewing leases: %w", err)
	}
	return n, nil
}

func splitKeys(keys []ItemKey) ([]uuid.UUID, []int32) {
	batchIDs := make([]uuid.UUID, len(keys))
	idxs := make([]int32, len(keys))
	for i, k := range keys {
		batchIDs[i], idxs[i] = k.BatchID, int32(k.Index)
	}
	return batchIDs, idxs
}

// ListenBatches calls listening once it listens, then, until ctx ends,
// created whenever a batch is created, and stopped with the id of a batch
// cancelled or past its window while items of it are claimed (their replicas
// must not start those they have not), on a connection of its own. It
// returns when the connection fails or stops answering, for the caller to
// retry; what happened while it was not listening is not reported.
func (s *Store) ListenBatches(ctx context.Context, listening, created func(), stopped func(uuid.UUID)) error {
	return s.listen(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
		if err := s.queries.ListenBatchCreated(ctx, conn); err != nil {
			return err
		}
		return s.queries.ListenBatchStopped(ctx, conn)
	}, listening, func(n *pgconn.Notification) {
		if n.Channel != "batch_stopped" {
			created()
		} else if id, err := uuid.Parse(n.Payload); err == nil {
			stopped(id)
		}
	})
}

func interval(d time.Duration) pgtype.Interval {
	return pgtype.Interval{Microseconds: d.Microseconds(), Valid: true}
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// QueueDepth is the number of queued batch items across all replicas.
func (s *Store) QueueDepth(ctx context.Context) (int64, error) {
	n, err := s.queries.QueueDepth(ctx, plannedPerCall{s.pool})
	if err != nil {
		return 0, fmt.Errorf("error counting queued items: %w", err)
	}
	return n, nil
}

// jobLockReleaseTimeout bounds the release of a job's lock (the end of its
// transaction); past it, the lock's connection is closed, which releases it
// too.
const jobLockReleaseTimeout = 5 * time.Second

// defaultJobLockHold is how long a lock whose client was lost outlives its
// last statement, for a run whose context has no deadline.
const defaultJobLockHold = 10 * time.Minute

// WithJobLock runs fn unless another replica runs the job named job or the
// job rests: it holds a transaction advisory lock on a connection of its own
// while fn runs. Should that connection be lost while the lock is held (the
// network to the database failing without closing it), the server releases
// the lock once ctx's deadline (ten minutes away without one) and the
// release's bound have passed, not hours later when its kernel gives the
// connection up: another replica runs the job then. When fn returns a
// positive rest, the job rests, on every replica, for rest times as long as
// the lock was held, measured by the database's clock and written before the
// lock is released. ran says whether fn ran.
func (s *Store) WithJobLock(ctx context.Context, job string, fn func() (rest int, err error)) (ran bool, err error) {
	hold := defaultJobLockHold
	if deadline, ok := ctx.Deadline(); ok {
		hold = time.Until(deadline)
	}
	hold += jobLockReleaseTimeout
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("error beginning job lock transaction: %w", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), jobLockReleaseTimeout)
		defer cancel()
		_ = tx.Rollback(rctx) // one that fails closes the connection, which ends the lock too
	}()
	row, err := s.queries.TryJobLock(ctx, tx, db.TryJobLockParams{Hold: milliseconds(hold), Job: job})
	if err != nil {
		return false, fmt.Errorf("error taking job lock: %w", err)
	}
	if !row.Locked {
		return false, nil
	}
	rest, err := fn()
	if err != nil || rest <= 0 {
		return true, err
	}
	if err := s.queries.RestJob(ctx, tx, db.RestJobParams{Job: job, Rest: int32(rest)}); err != nil {
		return true, fmt.Errorf("error resting job: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return true, fmt.Errorf("error committing job rest: %w", err)
	}
	return true, nil
}
