package apitest

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// Preflight sends the CORS preflight a browser at origin sends before a POST
// to url, and returns the reply's headers.
func Preflight(t testing.TB, url, origin string) http.Header {
	t.Helper()
	req, err := http.NewRequest(http.MethodOptions, url, nil)
	require.NoError(t, err)
	req.Header.Set("Origin", origin)
	req.Header.Set("Access-Control-Request-Method", http.MethodPost)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.Header
}
