package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway/openapi"
)

// codeSample is one of an operation's x-codeSamples in the document.
type codeSample struct {
	operation, label, source string
}

// codeSamples are the document's shell samples.
func codeSamples(t *testing.T) []codeSample {
	t.Helper()
	var doc struct {
		Paths map[string]map[string]struct {
			OperationID string `json:"operationId"`
			Samples     []struct {
				Lang   string `json:"lang"`
				Label  string `json:"label"`
				Source string `json:"source"`
			} `json:"x-codeSamples"`
		} `json:"paths"`
	}
	raw, err := yaml.YAMLToJSON(openapi.YAML())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &doc))
	var out []codeSample
	for _, ops := range doc.Paths {
		for _, op := range ops {
			for _, s := range op.Samples {
				require.Equal(t, "Shell", s.Lang, op.OperationID)
				out = append(out, codeSample{operation: op.OperationID, label: s.Label, source: s.Source})
			}
		}
	}
	return out
}

// TestTheDocumentsSamplesRun runs each shell sample of the document as a
// reader would paste it, with GATEWAY, GATEWAY_KEY and the ids it names set,
// against the real binary: each answers as its operation does.
func TestTheDocumentsSamplesRun(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("the samples call curl, which this machine lacks")
	}
	b := setup(t)
	g := serve(t, b.db, b.fake.BaseURL(), nil)
	run := func(source string, env ...string) string {
		t.Helper()
		cmd := exec.Command("sh", "-c", source)
		cmd.Env = append(os.Environ(), append([]string{"GATEWAY=" + g.base, "GATEWAY_KEY=" + b.key}, env...)...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s\n%s", source, out)
		return string(out)
	}
	samples := codeSamples(t)
	byOperation := map[string][]codeSample{}
	for _, s := range samples {
		byOperation[s.operation] = append(byOperation[s.operation], s)
	}
	// A response and a batch first, for the samples that name theirs.
	var response struct {
		RequestID string `json:"request_id"`
	}
	var batch struct {
		ID string `json:"id"`
	}
	for _, s := range byOperation["createResponse"] {
		out := run(s.source)
		if s.label == "Stream" {
			require.Contains(t, out, "event: response.completed", out)
			continue
		}
		require.NoError(t, json.Unmarshal([]byte(out), &response), out)
		require.NotEmpty(t, response.RequestID, out)
	}
	require.Len(t, byOperation["createBatch"], 1)
	out := run(byOperation["createBatch"][0].source)
	require.NoError(t, json.Unmarshal([]byte(out), &batch), out)
	require.NotEmpty(t, batch.ID, out)

	for _, s := range samples {
		if s.operation == "createResponse" || s.operation == "createBatch" {
			continue
		}
		out := run(s.source, "REQUEST_ID="+response.RequestID, "BATCH_ID="+batch.ID)
		var reply map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &reply), "%s: %s", s.operation, out)
		if s.operation == "cancelBatch" && strings.Contains(out, "BATCH_NOT_CANCELLABLE") {
			continue // the batch finished first: the operation's own answer
		}
		require.NotContains(t, reply, "error", "%s: %s", s.operation, out)
	}
	for _, op := range []string{"createResponse", "getSources", "getUsage", "createBatch", "getBatch", "getBatchResults", "cancelBatch", "listBatches"} {
		require.NotEmpty(t, byOperation[op], "every operation of the forward contract that a key calls has a sample: %s", op)
	}
	require.Len(t, byOperation["createResponse"], 2, "a JSON reply and a stream")
}
