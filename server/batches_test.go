package server_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/batch"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/internal/syncbuf"
	"github.com/rungworks/gateway/metrics"
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
		body    any
		code    gateway.ErrorCode
		index   string
		message string
	}{
		"empty":          {map[string]any{"requests": []any{}}, gateway.EEmptyBatch, "", ""},
		"missing":        {map[string]any{}, gateway.EEmptyBatch, "", ""},
		"too large":      {map[string]any{"requests": items(101)}, gateway.EBatchTooLarge, "", ""},
		"first invalid":  {map[string]any{"requests": bad}, gateway.EInvalidModel, "3", ""},
		"empty prompt":   {map[string]any{"requests": []any{map[string]any{"prompt": "ok"}, map[string]any{"prompt": ""}}}, gateway.EEmptyPrompt, "1", ""},
		"too long":       {map[string]any{"requests": []any{map[string]any{"prompt": strings.Repeat("x", 100001)}}}, gateway.EPromptTooLarge, "0", ""},
		"output ceiling": {map[string]any{"requests": []any{map[string]any{"prompt": "p", "max_output_rungs": 0}}}, gateway.EInvalidRequest, "0", ""},
		// What the decoder refuses names the item as validation does.
		"negative output ceiling": {json.RawMessage(`{"requests":[{"prompt":"a"},{"prompt":"b","max_output_rungs":-1}]}`), gateway.EInvalidRequest, "1",
			`requests[1]: field "max_output_rungs": number -1 is not a valid non-negative integer`},
		"output ceiling past any integer": {json.RawMessage(`{"requests":[{"prompt":"a"},{"prompt":"b","max_output_rungs":99999999999999999999}]}`), gateway.EInvalidRequest, "1",
			`requests[1]: field "max_output_rungs": number 99999999999999999999 is out of range (at most 18446744073709551615)`},
		"wrong type": {json.RawMessage(`{"requests":[{"prompt":"a"},{"prompt":"b"},{"prompt":"c","web_search":"yes"}]}`), gateway.EInvalidRequest, "2",
			`requests[2]: field "web_search": string is not a valid boolean`},
		"item not an object": {json.RawMessage(`{"requests":[{"prompt":"a"},7]}`), gateway.EInvalidRequest, "1",
			`requests[1]: number is not a valid object`},
		"field named twice": {json.RawMessage(`{"requests":[{"prompt":"a"},{"prompt":"b","model":"instant","model":"reasoning"}]}`), gateway.EInvalidRequest, "1",
			`requests[1]: field "model" appears more than once in one object; name each field once`},
		"wrong type past the items a batch holds": {json.RawMessage(`{"requests":[` + strings.Repeat(`{"prompt":"a"},`, 100) + `{"prompt":"b","web_search":"yes"}]}`), gateway.EInvalidRequest, "",
			`field "requests.web_search": string is not a valid boolean`},
		"requests not an array": {json.RawMessage(`{"requests":{"prompt":"a"}}`), gateway.EInvalidRequest, "",
			`field "requests": object is not a valid array`},
		"requests named twice": {json.RawMessage(`{"requests":[{"prompt":"a"}],"requests":[{"prompt":"b"}]}`), gateway.EInvalidRequest, "",
			`field "requests" appears more than once in one object; name each field once`},
	} {
		r := b.post("/api/v1/batch", b.key, c.body)
		require.Equal(t, http.StatusBadRequest, r.status, name)
		require.Equal(t, c.code, r.errorCode(t), name)
		require.Equal(t, c.index, r.header.Get("x-service-batch-index"), name)
		if c.index != "" {
			require.True(t, strings.HasPrefix(r.message(t), "requests["+c.index+"]: "), "the message names the item too: %s", r.message(t))
		}
		if c.message != "" {
			require.Equal(t, c.message, r.message(t), name)
		}
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
// reply, after storing the batch when stored is set; the next away creations
// find the database away.
type lostReplyStore struct {
	batch.Store
	stored bool
	away   int32
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
	if resends := s.sent.Load() - 1; resends <= s.away {
		return store.CreateResult{}, dbAway
	}
	return s.Store.CreateBatch(ctx, nb)
}

// TestBatchCreationWhoseReplyWasLost: a creation whose reply was lost is
// sent again until the database answers: stored or not the first time, the
// client gets its batch, stored once and charged once. When the database
// stays away past the window, the client is told the batch may exist, not
// that nothing changed. Within the default window, a database away for a
// few resends is waited for; a refusal it answers is the client's answer.
func TestBatchCreationWhoseReplyWasLost(t *testing.T) {
	t.Parallel()
	const staysAway = math.MaxInt32
	for _, tc := range []struct {
		name   string
		stored bool
		away   int32         // resends that find the database away
		window time.Duration // the resend window; 0, the default
	}{
		{"stored", true, 0, time.Second},
		{"not stored", false, 0, time.Second},
		{"stored, the database away", true, staysAway, time.Second},
		{"stored, the database away a while", true, 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := &lostReplyStore{stored: tc.stored, away: tc.away}
			m := metrics.New()
			b := setupWith(t, options{server: func(c *server.Config) {
				svc := c.Batches.(*batch.Service)
				st.Store, svc.Store = svc.Store, st
				svc.ResendWindow, svc.Metrics = tc.window, m
			}})
			r := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(2)})
			require.Contains(t, metricstest.Scrape(m), fmt.Sprintf("gateway_database_retries_total{work=%q} %d\n", "batch_creation", st.sent.Load()-1),
				"each send after the first is counted")
			var list api.BatchList
			require.NoError(t, json.Unmarshal(b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil).body, &list))
			require.Len(t, list.Data, 1, "stored once")
			sends := int32(2) // the first, and one resend at least
			if tc.away != staysAway {
				sends += tc.away
			}
			require.GreaterOrEqual(t, st.sent.Load(), sends, "sent again")
			if tc.away == staysAway {
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
	t.Run("not stored, and refused when sent again", func(t *testing.T) {
		t.Parallel()
		st := &lostReplyStore{}
		b := setupWith(t, options{server: func(c *server.Config) {
			svc := c.Batches.(*batch.Service)
			st.Store, svc.Store = svc.Store, st
		}})
		b.setLimits(t, ptr(int64(10_000)), nil)
		r := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(3)})
		require.Equal(t, int32(2), st.sent.Load())
		require.Equal(t, http.StatusTooManyRequests, r.status, "the refusal the database answered, not an outcome unknown")
		require.Equal(t, gateway.ERateLimited, r.errorCode(t))
		var list api.BatchList
		require.NoError(t, json.Unmarshal(b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil).body, &list))
		require.Empty(t, list.Data)
	})
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
	largest := b.do(http.MethodGet, "/api/v1/batches?limit=50", b.key, "", nil)
	require.Equal(t, http.StatusOK, largest.status, "the largest limit the document allows")
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

// completedBatch creates a batch of n items and marks every item completed
// with content, as the drainer would have (without billing them), returning
// its id.
func (b *testBundle) completedBatch(t testing.TB, n int, content string) string {
	t.Helper()
	created := b.post("/api/v1/batch", b.key, map[string]any{"requests": items(n)})
	require.Equal(t, http.StatusAccepted, created.status, string(created.body))
	var batch api.Batch
	require.NoError(t, json.Unmarshal(created.body, &batch))
	_, err := b.store.Pool().Exec(context.Background(),
		`UPDATE batch_items SET status = 'completed', content = $2, input_rungs = idx, output_rungs = 1, total_rungs = idx + 1 WHERE batch_id = $1`,
		batch.Id, content)
	require.NoError(t, err)
	return batch.Id.String()
}

// countedPages is the real store, counting its reads of batch items; from
// the read numbered failFrom (1: the first) on, they fail with err, or find
// nothing when err is nil (the batch was deleted meanwhile).
type countedPages struct {
	server.BatchStore
	failFrom int // 0: never
	err      error
	hold     bool // the read that fails waits for its context to end, and fails with its error
	reads    atomic.Int32
}

func (s *countedPages) BatchItems(ctx context.Context, accountID, id uuid.UUID, after int, maxBytes int64) ([]gateway.BatchItem, error) {
	if n := int(s.reads.Add(1)); s.failFrom > 0 && n >= s.failFrom {
		if s.hold {
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return nil, s.err
	}
	return s.BatchStore.BatchItems(ctx, accountID, id, after, maxBytes)
}

// TestBatchResultsAreWrittenPageByPage: results of batches that fill their
// last page or not, of items smaller than a page or larger, come whole and
// in order, each item as stored, byte for byte as the whole object encodes,
// read a page at a time.
func TestBatchResultsAreWrittenPageByPage(t *testing.T) {
	t.Parallel()
	pages := &countedPages{}
	b := setupWith(t, options{server: func(c *server.Config) {
		pages.BatchStore = c.BatchData
		c.BatchData = pages
	}})
	unit, size := `<b>"x"</b>&é`+"\u2028", server.ResultsPageBytes/4 // text the encoder escapes
	quarter := strings.Repeat(unit, size/len(unit)) + strings.Repeat("y", size%len(unit))
	require.Len(t, quarter, server.ResultsPageBytes/4)
	for _, tc := range []struct {
		items   int
		content string
		reads   int
		mixed   bool // every third item failed, every fifth still queued
	}{
		{items: 1, content: "short", reads: 1},
		{items: 100, content: "short", reads: 1, mixed: true},
		{items: 3, content: quarter, reads: 1},
		{items: 4, content: quarter, reads: 1},
		{items: 5, content: quarter, reads: 2},
		{items: 9, content: quarter, reads: 3},
		{items: 3, content: quarter + quarter + quarter + quarter + "z", reads: 3},
	} {
		name := fmt.Sprintf("%d items of %d bytes", tc.items, len(tc.content))
		id := b.completedBatch(t, tc.items, tc.content)
		_, err := b.store.Pool().Exec(context.Background(), `UPDATE batch_items SET status = 'failed', content = NULL,
			error_code = 'INTERRUPTED', error_message = 'item ' || idx WHERE batch_id = $1 AND idx % 3 = 1 AND $2`, id, tc.mixed)
		require.NoError(t, err)
		_, err = b.store.Pool().Exec(context.Background(), `UPDATE batch_items SET status = 'queued', content = NULL,
			input_rungs = 0, output_rungs = 0, total_rungs = 0 WHERE batch_id = $1 AND idx % 5 = 4 AND $2`, id, tc.mixed)
		require.NoError(t, err)

		pages.reads.Store(0)
		r := b.do(http.MethodGet, "/api/v1/batch/"+id+"/results", b.key, "", nil)
		require.Equal(t, http.StatusOK, r.status, name)
		require.Equal(t, tc.reads, int(pages.reads.Load()), "pages read, %s", name)
		var res api.BatchResults
		require.NoError(t, json.Unmarshal(r.body, &res), name)
		require.Equal(t, id, res.BatchId.String())
		require.Len(t, res.Results, tc.items)
		for i, it := range res.Results {
			require.Equal(t, i, it.Index, name)
			switch {
			case i%5 == 4 && tc.mixed:
				require.Equal(t, api.BatchItemStatus("queued"), it.Status, i)
				require.Nil(t, it.Content, i)
			case i%3 == 1 && tc.mixed:
				require.Equal(t, api.BatchItemStatus("failed"), it.Status, i)
				require.Equal(t, &api.Error{Code: "INTERRUPTED", Message: fmt.Sprintf("item %d", i)}, it.Error, i)
			default:
				require.Equal(t, api.BatchItemStatus("completed"), it.Status, i)
				require.Equal(t, tc.content, *it.Content, i)
				require.Equal(t, api.RungUsage{InputRungs: int64(i), OutputRungs: 1, TotalRungs: int64(i) + 1}, it.Usage, i)
			}
		}
		var whole bytes.Buffer
		require.NoError(t, json.NewEncoder(&whole).Encode(res))
		require.Equal(t, whole.String(), string(r.body), "written as the whole object encodes, %s", name)
	}
}

// TestBatchResultsCutShortEndTheirConnection: a page of items that cannot be
// read before the reply started is answered with its error; once it has
// started, the connection ends without the reply's end (a client never takes
// the items written so far for all of them), over HTTP/1.1 and HTTP/2,
// compressed or not (no gzip trailer makes a compressed one look whole), and
// both are logged.
func TestBatchResultsCutShortEndTheirConnection(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		failFrom int // the read that fails (pages of four items here)
		err      error
		h2c      bool
		gzip     bool // the server compresses (the client accepts gzip)
	}{
		{name: "first page, database away", failFrom: 1, err: dbAway},
		{name: "second page, database away", failFrom: 2, err: dbAway},
		{name: "second page, database away, HTTP/2", failFrom: 2, err: dbAway, h2c: true},
		{name: "second page, batch deleted", failFrom: 2},
		{name: "last page, batch deleted, HTTP/2", failFrom: 3, h2c: true},
		{name: "second page, database away, compressed", failFrom: 2, err: dbAway, gzip: true},
		{name: "last page, batch deleted, HTTP/2, compressed", failFrom: 3, h2c: true, gzip: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logs := &syncbuf.Buffer{}
			pages := &countedPages{failFrom: tc.failFrom, err: tc.err}
			b := setupWith(t, options{h2c: tc.h2c, logs: logs, server: func(c *server.Config) {
				pages.BatchStore = c.BatchData
				c.BatchData = pages
				c.Unavailable = store.Transient
				c.Compress = tc.gzip
			}})
			// Text that shrinks little, so that a compressed reply's first
			// page is on its way when the next one fails.
			raw := make([]byte, server.ResultsPageBytes/8)
			_, _ = rand.Read(raw)
			content := hex.EncodeToString(raw)
			id := b.completedBatch(t, 9, content)
			req, err := http.NewRequest(http.MethodGet, b.http.URL+"/api/v1/batch/"+id+"/results", nil)
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+b.key)
			resp, err := b.client.Do(req)
			if tc.failFrom == 1 {
				require.NoError(t, err)
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
				require.Contains(t, string(body), `"code":"SERVICE_UNAVAILABLE"`)
				return
			}
			// What the server had not sent when it cut the reply is lost:
			// the head too, over HTTP/2, if it was still in its buffer.
			var body []byte
			if err == nil {
				defer resp.Body.Close()
				require.Equal(t, http.StatusOK, resp.StatusCode)
				require.Equal(t, tc.gzip, resp.Uncompressed, "compressed when asked")
				body, err = io.ReadAll(resp.Body)
			}
			require.Error(t, err, "the reply does not end as if whole")
			require.NotContains(t, string(body), `"index":`+strconv.Itoa(4*(tc.failFrom-1))+`,`, "no item of the page that failed")
			var res api.BatchResults
			require.Error(t, json.Unmarshal(body, &res), "what came is not a whole object")
			// The log names why: the database's error, or the items missing.
			cause := fmt.Sprintf("%d items of 9 found", 4*(tc.failFrom-1))
			if tc.err != nil {
				cause = tc.err.Error()
			}
			require.Eventually(t, func() bool {
				return strings.Contains(logs.String(), "batch results cut short") && strings.Contains(logs.String(), cause) &&
					strings.Contains(logs.String(), `"route":"/api/v1/batch/:batch_id/results","status":200`)
			}, 5*time.Second, 10*time.Millisecond, "cut and logged: %s", logs.String())
			require.NotEmpty(t, loggedLine(t, logs, "batch results cut short")["request_id"], "the cut names its request")
			require.Equal(t, tc.failFrom, int(pages.reads.Load()), "pages read")
		})
	}
}

// TestBatchResultsToAClientThatLeftAreAWarning: a client that leaves while
// its results reply waits for a page is logged as a warning, naming the
// cancel, not as an error: nothing failed on the gateway's side.
func TestBatchResultsToAClientThatLeftAreAWarning(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	pages := &countedPages{failFrom: 2, hold: true}
	b := setupWith(t, options{logs: logs, server: func(c *server.Config) {
		pages.BatchStore = c.BatchData
		c.BatchData = pages
	}})
	id := b.completedBatch(t, 9, strings.Repeat("x", server.ResultsPageBytes/4))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.http.URL+"/api/v1/batch/"+id+"/results", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.key)
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	read := make(chan error, 1)
	go func() { _, err := io.Copy(io.Discard, resp.Body); read <- err }()
	require.Eventually(t, func() bool { return pages.reads.Load() == 2 }, 10*time.Second, time.Millisecond, "the first page written, the reply waits for the next")
	cancel()
	require.Error(t, <-read)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "batch results cut short") }, 10*time.Second, 10*time.Millisecond)
	line := loggedLine(t, logs, "batch results cut short")
	require.Equal(t, "WARN", line["level"])
	require.Contains(t, line["error"], context.Canceled.Error())
}

// TestBatchResultsToAClientThatReadsNothing: the write deadline a results
// reply renews as it goes (TestStridedWriterRenewsItsDeadline) still cuts off
// a client that reads nothing, its connection alive: the handler returns.
func TestBatchResultsToAClientThatReadsNothing(t *testing.T) {
	t.Parallel()
	logs := &syncbuf.Buffer{}
	b := setupWith(t, options{logs: logs, server: func(c *server.Config) { c.ReplyWriteTimeout = 250 * time.Millisecond }})
	// 24 MiB: more than the sockets' buffers hold.
	id := b.completedBatch(t, 24, strings.Repeat("x", server.ResultsPageBytes))
	conn := b.narrowConn(t)
	_, err := fmt.Fprintf(conn, "GET /api/v1/batch/%s/results HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer %s\r\n\r\n", id, b.key)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `"route":"/api/v1/batch/:batch_id/results","status":200`)
	}, 20*time.Second, 20*time.Millisecond, "the handler still writes to a client that reads nothing")
	require.Contains(t, logs.String(), "i/o timeout", "cut off by its deadline")
}
