package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
)

func items(n int) []map[string]any {
	out := make([]map[string]any, n)
	for i := range out {
		out[i] = map[string]any{"prompt": "item", "stream": true}
	}
	return out
}

func (r reply) batch(t *testing.T) api.Batch {
	t.Helper()
	var b api.Batch
	require.NoError(t, json.Unmarshal(r.body, &b), string(r.body))
	return b
}

func TestCreateBatchValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	bad := items(5)
	bad[3] = map[string]any{"prompt": "p", "model": "gpt"}
	bad[4] = map[string]any{"prompt": ""}
	for name, c := range map[string]struct {
		body  any
		code  gateway.ErrorCode
		index string
	}{
		"empty":          {map[string]any{"requests": []any{}}, gateway.EEmptyBatch, ""},
		"missing":        {map[string]any{}, gateway.EEmptyBatch, ""},
		"too large":      {map[string]any{"requests": items(101)}, gateway.EBatchTooLarge, ""},
		"first invalid":  {map[string]any{"requests": bad}, gateway.EInvalidModel, "3"},
		"empty prompt":   {map[string]any{"requests": []any{map[string]any{"prompt": "ok"}, map[string]any{"prompt": ""}}}, gateway.EEmptyPrompt, "1"},
		"too long":       {map[string]any{"requests": []any{map[string]any{"prompt": strings.Repeat("x", 100001)}}}, gateway.EPromptTooLarge, "0"},
		"output ceiling": {map[string]any{"requests": []any{map[string]any{"prompt": "p", "max_output_rungs": 0}}}, gateway.EInvalidRequest, "0"},
	} {
		r := b.post("/api/v1/batch", b.key, c.body)
		require.Equal(t, http.StatusBadRequest, r.status, name)
		require.Equal(t, c.code, r.errorCode(t), name)
		require.Equal(t, c.index, r.header.Get("x-service-batch-index"), name)
	}
	r := b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil)
	require.Empty(t, r.json(t)["data"], "nothing was stored")

	r = b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(1)}, http.Header{"Idempotency-Key": {strings.Repeat("k", 256)}})
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))

	r = b.post("/api/v1/batch", b.key, map[string]any{"requests": items(100)})
	require.Equal(t, http.StatusAccepted, r.status, "exactly 100 is accepted")
	created := r.batch(t)
	require.Equal(t, 100, created.TotalRequests)
	require.Equal(t, api.BatchStatus("queued"), created.Status)
	require.Equal(t, created.CreatedAt.Add(24*60*60*1e9), created.ExpiresAt)
	require.Nil(t, created.StartedAt)
	require.Nil(t, created.CompletedAt)
	require.Nil(t, created.Error)
	require.NotContains(t, string(r.body), "started_at", "absent fields are omitted, never null")
}

func TestBatchIdempotency(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	key := http.Header{"Idempotency-Key": {"retry-1"}}
	body := map[string]any{"requests": items(2)}
	first := b.postWith("/api/v1/batch", b.key, body, key)
	require.Equal(t, http.StatusAccepted, first.status)
	again := b.postWith("/api/v1/batch", b.key, body, key)
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	require.Equal(t, first.batch(t).Id, again.batch(t).Id)

	other := b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(3)}, key)
	require.Equal(t, http.StatusUnprocessableEntity, other.status)
	require.Equal(t, gateway.EIdempotencyKeyReused, other.errorCode(t))
}

// lostReplyStore is the real store whose first batch creation loses its
// reply, after storing the batch when stored is set; the creations after it
// find the database away while away is set.
type lostReplyStore struct {
	batch.Store
	stored bool
	away   bool
	sent   atomic.Int32
}

func (s *lostReplyStore) CreateBatch(ctx context.Context, nb store.NewBatch) (store.CreateResult, error) {
	if s.sent.Add(1) == 1 {
		if s.stored {
			if _, err := s.Store.CreateBatch(ctx, nb); err != nil {
				return store.CreateResult{}, err
			}
		}
		return store.CreateResult{}, fmt.Errorf("error creating batch: %w", io.ErrUnexpectedEOF)
	}
	if s.away {
		return store.CreateResult{}, dbAway
	}
	return s.Store.CreateBatch(ctx, nb)
}

// TestBatchCreationWhoseReplyWasLost: a creation whose reply was lost is
// sent again until the database answers: stored or not the first time, the
// client gets its batch, stored once and charged once. When the database
// stays away past the window, the client is told the batch may exist, not
// that nothing changed.
func TestBatchCreationWhoseReplyWasLost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		stored, away bool
	}{
		{"stored", true, false},
		{"not stored", false, false},
		{"stored, the database away", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := &lostReplyStore{stored: tc.stored, away: tc.away}
			b := setupWith(t, options{server: func(c *server.Config) {
				svc := c.Batches.(*batch.Service)
				st.Store, svc.Store = svc.Store, st
				svc.ResendWindow = time.Second
			}})
			r := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)})
			var list api.BatchList
			require.NoError(t, json.Unmarshal(b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil).body, &list))
			require.Len(t, list.Data, 1, "stored once")
			require.GreaterOrEqual(t, st.sent.Load(), int32(2), "sent again")
			if tc.away {
				require.Equal(t, http.StatusServiceUnavailable, r.status)
				require.Equal(t, gateway.EServiceUnavailable, r.errorCode(t))
				require.Contains(t, r.message(t), "may have been")
				require.NotEmpty(t, r.header.Get("Retry-After"))
				return
			}
			require.Equal(t, http.StatusAccepted, r.status, string(r.body))
			require.Empty(t, r.header.Get("Idempotent-Replayed"))
			require.Equal(t, list.Data[0].Id, r.batch(t).Id)
			// Charged once: a second, identical batch doubles the charge.
			once := b.usage(t, b.key).Daily.ChargedRungs
			require.Positive(t, once)
			require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)}).status)
			require.Equal(t, 2*once, b.usage(t, b.key).Daily.ChargedRungs)
		})
	}
}

func TestBatchReadsAndCancel(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	stranger := b.newKey("stranger", gateway.TierDeveloper, gateway.ScopeInference)
	created := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)}).batch(t)
	path := "/api/v1/batch/" + created.Id.String()

	got := b.do(http.MethodGet, path, b.key, "", nil)
	require.Equal(t, http.StatusOK, got.status)
	require.Equal(t, created.Id, got.batch(t).Id)

	results := b.do(http.MethodGet, path+"/results", b.key, "", nil)
	require.Equal(t, http.StatusOK, results.status)
	var res api.BatchResults
	require.NoError(t, json.Unmarshal(results.body, &res))
	require.Len(t, res.Results, 2)
	for i, it := range res.Results {
		require.Equal(t, i, it.Index)
		require.Equal(t, api.BatchItemStatus("queued"), it.Status)
		require.Equal(t, api.RungUsage{}, it.Usage, "usage is always present")
		require.Nil(t, it.RequestId)
		require.Nil(t, it.Error)
	}

	for name, c := range map[string]struct{ key, path string }{
		"foreign":   {stranger, path},
		"unknown":   {b.key, "/api/v1/batch/01900000-0000-7000-8000-000000000000"},
		"malformed": {b.key, "/api/v1/batch/not-an-id"},
	} {
		for _, suffix := range []string{"", "/results"} {
			r := b.do(http.MethodGet, c.path+suffix, c.key, "", nil)
			require.Equal(t, http.StatusNotFound, r.status, name)
			require.Equal(t, gateway.EBatchNotFound, r.errorCode(t), name)
		}
		r := b.do(http.MethodPost, c.path+"/cancel", c.key, "", nil)
		require.Equal(t, gateway.EBatchNotFound, r.errorCode(t), name)
	}

	cancelled := b.do(http.MethodPost, path+"/cancel", b.key, "", nil)
	require.Equal(t, http.StatusOK, cancelled.status)
	require.Equal(t, api.BatchStatus("cancelled"), cancelled.batch(t).Status)
	require.NotNil(t, cancelled.batch(t).CompletedAt)
	require.Equal(t, cancelled.batch(t).TotalRequests, cancelled.batch(t).CancelledRequests, "every item is counted as cancelled")
	again := b.do(http.MethodPost, path+"/cancel", b.key, "", nil)
	require.Equal(t, http.StatusConflict, again.status)
	require.Equal(t, gateway.EBatchNotCancellable, again.errorCode(t))

	list := b.do(http.MethodGet, "/api/v1/batches?limit=1", b.key, "", nil)
	require.Equal(t, http.StatusOK, list.status)
	var l api.BatchList
	require.NoError(t, json.Unmarshal(list.body, &l))
	require.Len(t, l.Data, 1)
	require.False(t, l.HasMore)
	for _, bad := range []string{"0", "51", "x"} {
		r := b.do(http.MethodGet, "/api/v1/batches?limit="+bad, b.key, "", nil)
		require.Equal(t, http.StatusBadRequest, r.status, bad)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t), bad)
	}
	r := b.do(http.MethodGet, "/api/v1/batches", stranger, "", nil)
	require.Empty(t, r.json(t)["data"], "another account sees none of them")
}

func TestBatchPastDailyCeiling(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.setLimits(t, ptr(int64(10_000)), nil)
	r := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(3)})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.Equal(t, gateway.ERateLimited, r.errorCode(t))
	require.Empty(t, r.header.Get("Retry-After"), "larger than the whole ceiling: waiting cannot help (D11)")
	require.Contains(t, r.message(t), "max_output_rungs")

	b.setLimits(t, ptr(int64(40_000)), nil)
	require.Equal(t, http.StatusAccepted, b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)}).status)
	r = b.post("/api/v1/batch", b.key, map[string]any{"requests": items(1)})
	require.Equal(t, http.StatusTooManyRequests, r.status)
	require.NotEmpty(t, r.header.Get("Retry-After"), "fits tomorrow")
}

// TestListBatchesPages: has_more says when older batches follow, and after
// pages through all of them, newest first, each once.
func TestListBatchesPages(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var created []string
	for range 5 {
		r := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(1)})
		require.Equal(t, http.StatusAccepted, r.status)
		created = append([]string{r.batch(t).Id.String()}, created...) // newest first
	}
	var seen []string
	after := ""
	for page := 0; ; page++ {
		path := "/api/v1/batches?limit=2"
		if after != "" {
			path += "&after=" + after
		}
		r := b.do(http.MethodGet, path, b.key, "", nil)
		require.Equal(t, http.StatusOK, r.status)
		var l api.BatchList
		require.NoError(t, json.Unmarshal(r.body, &l))
		for _, bt := range l.Data {
			seen = append(seen, bt.Id.String())
		}
		if !l.HasMore {
			require.Equal(t, 2, page, "pages of 2, 2 and 1")
			break
		}
		after = l.Data[len(l.Data)-1].Id.String()
	}
	require.Equal(t, created, seen)
	r := b.do(http.MethodGet, "/api/v1/batches?after=not-a-uuid", b.key, "", nil)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.message(t), "parameter after must be a UUID")
}
