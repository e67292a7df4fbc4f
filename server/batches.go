package server

import (
	"context"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
)

// DefaultBatchListLimit is the number of batches listed when no limit is given.
const DefaultBatchListLimit = 50

// CreateBatch implements POST /api/v1/batch.
func (s *Server) CreateBatch(ctx context.Context, req api.CreateBatchRequestObject) (api.CreateBatchResponseObject, error) {
	items := make([]gateway.RequestInput, len(req.Body.Requests))
	for i := range req.Body.Requests {
		items[i] = requestInput(&req.Body.Requests[i], misplacedText(ctx, i))
	}
	prepared, err := s.batches.Prepare(gateway.PrincipalFrom(ctx), items, req.Params.IdempotencyKey, req.Body)
	endTurn(ctx)
	if err != nil {
		return nil, err
	}
	b, replayed, err := s.batches.Create(ctx, prepared) // its waits for the database are bounded within
	if err != nil {
		return nil, err
	}
	noteBatch(ctx, b.ID)
	if replayed {
		replay := "true"
		return api.CreateBatch200JSONResponse{Body: apiBatch(b), Headers: api.CreateBatch200ResponseHeaders{IdempotentReplayed: &replay}}, nil
	}
	return api.CreateBatch202JSONResponse{Body: apiBatch(b)}, nil
}

// GetBatch implements GET /api/v1/batch/{batch_id}.
func (s *Server) GetBatch(ctx context.Context, req api.GetBatchRequestObject) (api.GetBatchResponseObject, error) {
	id, err := batchID(ctx, req.BatchId)
	if err != nil {
		return nil, err
	}
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	b, err := s.batchData.Batch(ctx, gateway.PrincipalFrom(ctx).AccountID, id)
	if err != nil {
		return nil, err
	}
	return api.GetBatch200JSONResponse{BatchFoundJSONResponse: api.BatchFoundJSONResponse{Body: apiBatch(b)}}, nil
}

// GetBatchResults implements GET /api/v1/batch/{batch_id}/results. The batch
// and the first page of its items are read before the reply starts, so that
// a missing batch or an unreachable database is answered with its error;
// the rest is read as the reply is written (batchResults).
func (s *Server) GetBatchResults(ctx context.Context, req api.GetBatchResultsRequestObject) (api.GetBatchResultsResponseObject, error) {
	id, err := batchID(ctx, req.BatchId)
	if err != nil {
		return nil, err
	}
	account := gateway.PrincipalFrom(ctx).AccountID
	b, first, err := s.firstResults(ctx, account, id)
	if err != nil {
		return nil, err
	}
	return batchResults{s: s, ctx: ctx, account: account, batch: b, page: first}, nil
}

// firstResults reads the batch id of account and the first page of its items.
func (s *Server) firstResults(ctx context.Context, account, id uuid.UUID) (*gateway.Batch, []gateway.BatchItem, error) {
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	b, err := s.batchData.Batch(ctx, account, id)
	if err != nil {
		return nil, nil, err
	}
	first, err := s.batchData.BatchItems(ctx, account, id, -1, ResultsPageBytes)
	if err != nil {
		return nil, nil, err
	}
	return b, first, nil
}

// CancelBatch implements POST /api/v1/batch/{batch_id}/cancel.
func (s *Server) CancelBatch(ctx context.Context, req api.CancelBatchRequestObject) (api.CancelBatchResponseObject, error) {
	id, err := batchID(ctx, req.BatchId)
	if err != nil {
		return nil, err
	}
	account := gateway.PrincipalFrom(ctx).AccountID
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	if err := s.batchData.CancelBatch(ctx, account, id); err != nil {
		return nil, err
	}
	b, err := s.batchData.Batch(ctx, account, id)
	if err != nil {
		return nil, err
	}
	return api.CancelBatch200JSONResponse{BatchFoundJSONResponse: api.BatchFoundJSONResponse{Body: apiBatch(b)}}, nil
}

// ListBatches implements GET /api/v1/batches.
func (s *Server) ListBatches(ctx context.Context, req api.ListBatchesRequestObject) (api.ListBatchesResponseObject, error) {
	limit := DefaultBatchListLimit
	if req.Params.Limit != nil {
		limit = *req.Params.Limit
		if limit < 1 || limit > DefaultBatchListLimit {
			return nil, gateway.Errorf(gateway.EInvalidRequest, "%s, not %d", s.notInForm("limit"), limit)
		}
	}
	// One more than asked tells whether more follow.
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	batches, err := s.batchData.Batches(ctx, gateway.PrincipalFrom(ctx).AccountID, req.Params.After, limit+1)
	if err != nil {
		return nil, err
	}
	more := len(batches) > limit
	batches = batches[:min(len(batches), limit)]
	body := api.BatchList{Data: make([]api.Batch, len(batches)), HasMore: more}
	for i, b := range batches {
		body.Data[i] = apiBatch(b)
	}
	return api.ListBatches200JSONResponse{Body: body}, nil
}

// batchID parses a batch id, and names it in the log line of the request
// whose context is ctx; a malformed one is reported like a missing batch.
func batchID(ctx context.Context, raw string) (uuid.UUID, error) {
	id, err := uuid.Parse(raw)
	if err != nil {
		return uuid.Nil, gateway.Errorf(gateway.EBatchNotFound, "no batch %s", gateway.Quote(raw))
	}
	noteBatch(ctx, id)
	return id, nil
}

func apiBatch(b *gateway.Batch) api.Batch {
	out := api.Batch{
		Id: b.ID, Status: api.BatchStatus(b.Status), TotalRequests: b.Total,
		CompletedRequests: b.Completed, FailedRequests: b.Failed, CancelledRequests: b.Cancelled, Usage: rungUsage(b.Usage),
		CreatedAt: b.CreatedAt.UTC(), StartedAt: utc(b.StartedAt), CompletedAt: utc(b.CompletedAt), ExpiresAt: b.ExpiresAt.UTC(),
	}
	if b.Error != nil {
		out.Error = &api.Error{Code: api.ErrorCode(b.Error.Code), Message: b.Error.Message}
	}
	return out
}

func rungUsage(u gateway.Usage) api.RungUsage {
	return api.RungUsage{InputRungs: u.InputRungs, OutputRungs: u.OutputRungs, TotalRungs: u.TotalRungs}
}

func utc(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	v := t.UTC()
	return &v
}
