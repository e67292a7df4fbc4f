package fakeupstream_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/fakeupstream"
)

func TestAnUnrecordedServerKeepsNoCalls(t *testing.T) {
	t.Parallel()

	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	call := func(prompt string) {
		t.Helper()
		body := `{"model":"instant","messages":[{"role":"user","content":"` + prompt + `"}]}`
		resp, err := http.Post(fake.BaseURL()+"/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}

	call("kept")
	fake.SetUnrecorded(true)
	call("answered, not kept")
	fake.SetUnrecorded(false)
	call("kept again")

	calls := fake.Calls()
	require.Len(t, calls, 2)
	require.Equal(t, "kept", calls[0].Prompt)
	require.Equal(t, "kept again", calls[1].Prompt)
}
