package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/gen/client"
	"github.com/rungworks/gateway/openapi"
)

// TestGeneratedGoClient drives the gateway the way its users do: through a
// client generated from the OpenAPI document it serves.
func TestGeneratedGoClient(t *testing.T) {
	t.Parallel()
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	ctx := context.Background()

	// The served document is the contract the client was generated from.
	resp, err := http.Get(g.base + "/openapi.json")
	require.NoError(t, err)
	served, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	embedded, err := openapi.JSON()
	require.NoError(t, err)
	require.JSONEq(t, string(embedded), string(served))

	c, err := client.NewClientWithResponses(g.base, client.WithRequestEditorFn(func(_ context.Context, req *http.Request) error {
		req.Header.Set("Authorization", "Bearer "+b.key)
		return nil
	}))
	require.NoError(t, err)

	model := "reasoning"
	web := true
	created, err := c.CreateResponseWithResponse(ctx, client.CreateResponseJSONRequestBody{Prompt: "from a generated client", Model: &model, WebSearch: &web})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, created.StatusCode(), string(created.Body))
	require.Equal(t, client.ResponseModel("reasoning"), created.JSON200.Model)
	require.Nil(t, created.JSON200.Usage.RegionsActivated)
	sources, err := c.GetSourcesWithResponse(ctx, created.JSON200.RequestId.String())
	require.NoError(t, err)
	require.Len(t, sources.JSON200.Sources, 1)

	key := "client-batch"
	batch, err := c.CreateBatchWithResponse(ctx, &client.CreateBatchParams{IdempotencyKey: &key}, client.CreateBatchJSONRequestBody{
		Requests: []client.ResponseRequest{{Prompt: "one"}, {Prompt: "two"}},
	})
	require.NoError(t, err)
	require.Equal(t, http.StatusAccepted, batch.StatusCode(), string(batch.Body))
	id := batch.JSON202.Id.String()
	var results *client.GetBatchResultsResponse
	require.Eventually(t, func() bool {
		results, err = c.GetBatchResultsWithResponse(ctx, id)
		require.NoError(t, err)
		return results.JSON200.Status == "completed"
	}, 30*time.Second, 50*time.Millisecond)
	require.Len(t, results.JSON200.Results, 2)
	require.Equal(t, "echo: two", *results.JSON200.Results[1].Content)

	usage, err := c.GetUsageWithResponse(ctx, &client.GetUsageParams{})
	require.NoError(t, err)
	require.Equal(t, int64(3), usage.JSON200.Totals.Requests)

	missing, err := c.GetBatchWithResponse(ctx, "nope")
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, missing.StatusCode())
	var env client.ErrorEnvelope
	require.NoError(t, json.Unmarshal(missing.Body, &env))
	require.Equal(t, client.ErrorCode("BATCH_NOT_FOUND"), env.Error.Code)
}
