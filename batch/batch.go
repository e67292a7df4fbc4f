// Package batch creates batches: it validates every item before anything is
// stored, prices each item's estimate at the batch rate, and hands the batch to
// the store, which charges the whole estimate to the day and queues the items.
package batch

import (
	"context"
	"errors"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/store"
)

// Store is what creating and reading batches needs.
type Store interface {
	CreateBatch(ctx context.Context, nb store.NewBatch) (store.CreateResult, error)
	Batch(ctx context.Context, accountID, id uuid.UUID) (*gateway.Batch, error)
}

// DefaultWindow is the completion window of a batch.
const DefaultWindow = 24 * time.Hour

// readTimeout bounds the read of a batch just stored, for its reply.
const readTimeout = 5 * time.Second

// DefaultResendWindow is how long a creation whose reply was lost is sent
// again while the database is away, to learn whether it was stored.
const DefaultResendWindow = 10 * time.Second

// resendRetryAfter is the Retry-After of a creation whose outcome stayed
// unknown.
const resendRetryAfter = 5 * time.Second

// Service creates batches.
type Service struct {
	Store     Store
	Models    gateway.Catalog
	Estimator *metering.Estimator
	// Window is the completion window; zero means DefaultWindow.
	Window time.Duration
	// ResendWindow bounds the resending of a creation whose reply was lost;
	// zero means DefaultResendWindow.
	ResendWindow time.Duration
	// Metrics, when set, counts the creations sent again.
	Metrics *metrics.Metrics
}

// Prepared is a batch validated and priced, for Create to store.
type Prepared struct{ nb store.NewBatch }

// Prepare validates every item of a batch and prices it, before anything is
// stored: the part of a creation that takes CPU, as long as a second for 100
// long prompts. idempotencyKey is the request's Idempotency-Key, nil when it
// has none: one sent empty is refused as any other outside its form. body
// identifies the request for idempotency.
func (s *Service) Prepare(p *gateway.Principal, items []gateway.RequestInput, idempotencyKey *string, body any) (Prepared, error) {
	var key string
	if idempotencyKey != nil {
		key = *idempotencyKey
		if err := gateway.ValidateIdempotencyKey(key); err != nil {
			return Prepared{}, err
		}
	}
	switch {
	case len(items) == 0:
		return Prepared{}, gateway.Errorf(gateway.EEmptyBatch, "requests must hold at least one item")
	case len(items) > gateway.MaxBatchItems:
		return Prepared{}, gateway.Errorf(gateway.EBatchTooLarge, "requests holds %d items; the limit is %d", len(items), gateway.MaxBatchItems)
	}
	nb := store.NewBatch{Principal: p, IdempotencyKey: key, Items: make([]store.NewItem, len(items))}
	for i, in := range items {
		req, err := gateway.Validate(in, s.Models)
		if err == nil {
			var est metering.Estimate
			est, err = s.Estimator.Estimate(req, gateway.EntryBatch)
			nb.Items[i] = store.NewItem{Request: store.NewItemRequest(req), Estimate: est.Total()}
		}
		if err != nil {
			var e *gateway.Error
			if !errors.As(err, &e) {
				e = gateway.Errorf(gateway.EInvalidRequest, "the request cannot be priced: %v", err)
			}
			return Prepared{}, e.InItem(i)
		}
	}
	hash, err := store.HashRequest(body)
	if err != nil {
		return Prepared{}, err
	}
	nb.RequestHash = hash
	return Prepared{nb}, nil
}

// Create stores a batch Prepare returned. Its completion window starts now.
// It returns the batch and whether it was an idempotent replay.
func (s *Service) Create(ctx context.Context, prepared Prepared) (*gateway.Batch, bool, error) {
	nb := prepared.nb
	window := s.Window
	if window <= 0 {
		window = DefaultWindow
	}
	nb.ID = uuid.Must(uuid.NewV7())
	nb.CreatedAt = time.Now().UTC().Truncate(time.Microsecond)
	nb.ExpiresAt = nb.CreatedAt.Add(window)
	res, err := s.create(ctx, nb)
	if err != nil {
		return nil, false, err
	}
	readCtx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	b, err := s.Store.Batch(readCtx, nb.Principal.AccountID, res.BatchID)
	if err != nil {
		return nil, false, err
	}
	return b, res.Replayed, nil
}

// create stores nb. A creation whose reply was lost (the connection broke
// after it was sent) may have been stored: it is sent again, with the same
// batch id, until the database answers or ResendWindow passes. Sent again, it
// is stored at most once: the id's index makes the second wait for the first
// to end, then find it stored, or store it. Only when the window passes is
// the outcome unknown, and the caller is told so instead of "nothing was
// changed": a client that retried without an Idempotency-Key would otherwise
// create, and pay for, the batch twice. A caller gone is not resolved for.
func (s *Service) create(ctx context.Context, nb store.NewBatch) (store.CreateResult, error) {
	res, err := s.Store.CreateBatch(ctx, nb)
	if err == nil || !store.MayHaveCommitted(err) {
		return res, err
	}
	window := s.ResendWindow
	if window <= 0 {
		window = DefaultResendWindow
	}
	err = store.Retry(ctx, window, 2*time.Second, func(ctx context.Context) (err error) {
		s.Metrics.DatabaseRetry(metrics.RetryBatchCreation) // each call here sends it again
		res, err = s.Store.CreateBatch(ctx, nb)
		return err
	})
	if err == nil || !store.Transient(err) || ctx.Err() != nil {
		return res, err
	}
	return store.CreateResult{}, &gateway.Error{Code: gateway.EServiceUnavailable, RetryAfter: resendRetryAfter, Cause: err,
		Message: "the gateway's database went away while the batch was being stored, and it may have been: list your batches before creating it again, or send it again with the same Idempotency-Key, which creates it at most once"}
}
