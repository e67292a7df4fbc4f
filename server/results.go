package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
)

// ResultsPageBytes is how much text of a batch's items a results reply reads
// at a time (a page holds at least one item, whatever its size): what a
// replica holds of one reply, however large the batch's outputs.
const ResultsPageBytes = 1 << 20

// resultsStride is how much of a results reply is written under one write
// deadline: the deadline is renewed each time this much has been written, so
// a client has ReplyWriteTimeout to take each stride (and what the kernel
// waits for before it takes more: a third of its send buffer), not the
// whole.
const resultsStride = 64 << 10

// noResults is the results of an envelope encoded without its items: they
// are written between its brackets.
var noResults = []byte(`"results":[]`)

// batchResults is the 200 reply of GetBatchResults (interface §2.6), written
// a page of items at a time as they are read, so that the reply is never
// held whole, and to the client a stride at a time (stridedWriter). Its
// status is read before its items, which can only be further along: a reply
// may show an item finished in a batch still in_progress, never the other
// way round. A page that cannot be read once the reply has started (the
// database gone, the batch deleted by retention) ends the connection without
// the reply's end, so that no client takes the items written so far for the
// whole.
type batchResults struct {
	s       *Server
	ctx     context.Context
	account uuid.UUID
	batch   *gateway.Batch
	// page is the first page of items, read before the reply started.
	page []gateway.BatchItem
}

// VisitGetBatchResultsResponse implements api.GetBatchResultsResponseObject.
func (r batchResults) VisitGetBatchResultsResponse(w http.ResponseWriter) error {
	envelope, err := json.Marshal(api.BatchResults{BatchId: r.batch.ID, Status: api.BatchStatus(r.batch.Status), Results: []api.BatchResultItem{}})
	if err != nil {
		return fmt.Errorf("error encoding batch results: %w", err)
	}
	at := bytes.Index(envelope, noResults)
	if at < 0 {
		return fmt.Errorf("error encoding batch results: the envelope %s has no results", envelope)
	}
	open := at + len(noResults) - 1 // the items go before the closing bracket
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	out := &stridedWriter{w: w, timeout: r.s.replyWriteTimeout, set: time.Now()}
	if err := out.write(envelope[:open]); err != nil {
		return err
	}
	// Each item is encoded into one buffer, reused: an encoder ends each
	// value with a newline, left out.
	var item bytes.Buffer
	enc := json.NewEncoder(&item)
	written, after, page := 0, -1, r.page
	for {
		if len(page) == 0 {
			r.cut(fmt.Errorf("error reading batch results: %d items of %d found", written, r.batch.Total))
		}
		for _, it := range page {
			item.Reset()
			if written > 0 {
				item.WriteByte(',')
			}
			if err := enc.Encode(resultItem(it)); err != nil {
				r.cut(fmt.Errorf("error encoding batch result %d: %w", it.Index, err))
			}
			if err := out.write(item.Bytes()[:item.Len()-1]); err != nil {
				return err
			}
			written, after = written+1, it.Index
		}
		if written >= r.batch.Total {
			break
		}
		page, err = r.nextPage(after)
		if err != nil {
			r.cut(err)
		}
	}
	return out.write(append(envelope[open:], '\n')) // as json.Encoder ends a value
}

// stridedWriter writes a reply whose first bytes got their deadline from
// observe, renewing it each resultsStride, and before a write that comes
// late (a page read, a long item encoded): each write has at least three
// quarters of timeout, so a client that reads on, however slowly, takes the
// whole, and one that stops is cut off.
type stridedWriter struct {
	w       http.ResponseWriter
	timeout time.Duration
	set     time.Time // when the deadline was last set
	since   int       // bytes written since
}

// write writes p; a client that stops reading ends the reply (its error is
// logged by handleError, the reply having started).
func (s *stridedWriter) write(p []byte) error {
	for len(p) > 0 {
		if now := time.Now(); s.since >= resultsStride || now.Sub(s.set) > s.timeout/4 {
			_ = http.NewResponseController(s.w).SetWriteDeadline(now.Add(s.timeout))
			s.set, s.since = now, 0
		}
		n := min(len(p), resultsStride)
		if _, err := s.w.Write(p[:n]); err != nil {
			return fmt.Errorf("error writing batch results: %w", err)
		}
		s.since += n
		p = p[n:]
	}
	return nil
}

// nextPage reads the page of items after index after.
func (r batchResults) nextPage(after int) ([]gateway.BatchItem, error) {
	ctx, cancel := waitForDatabase(r.ctx)
	defer cancel()
	return r.s.batchData.BatchItems(ctx, r.account, r.batch.ID, after, ResultsPageBytes)
}

// cut logs why the reply cannot go on and ends its connection unfinished.
func (r batchResults) cut(err error) {
	level := r.s.logger.Error
	if errors.Is(err, context.Canceled) {
		level = r.s.logger.Warn // the client left
	}
	attrs := []any{"batch_id", r.batch.ID.String(), "error", err}
	if x := exchangeFrom(r.ctx); x != nil {
		attrs = append(attrs, "request_id", x.id)
	}
	level("batch results cut short", attrs...)
	panic(http.ErrAbortHandler)
}

// resultItem is one item of a results reply.
func resultItem(it gateway.BatchItem) api.BatchResultItem {
	r := api.BatchResultItem{Index: it.Index, Status: api.BatchItemStatus(it.Status), Usage: rungUsage(it.Usage)}
	if it.Status == gateway.ItemCompleted {
		model := api.BatchResultItemModel(it.Model)
		content := it.Content
		r.RequestId, r.Model, r.Content = it.RequestID, &model, &content
	}
	if it.Route != nil {
		r.Route = &api.UpstreamRoute{Provider: it.Route.Provider, UpstreamModel: it.Route.UpstreamModel, Attempts: it.Route.Attempts}
	}
	if it.Error != nil {
		r.Error = &api.Error{Code: api.ErrorCode(it.Error.Code), Message: it.Error.Message}
	}
	return r
}
