package server

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/openapi"
)

// TestNearRoutes: a path is near an operation of its method (HEAD is GET's)
// that it is but for trailing slashes or the letter case of fixed segments;
// an empty parameter segment, another method or another path is near none.
func TestNearRoutes(t *testing.T) {
	t.Parallel()
	policies, err := openapi.Policies()
	require.NoError(t, err)
	routes := newRouteTemplates(policies)
	for _, tt := range []struct{ method, path, want string }{
		{"POST", "/api/v1/responses/", "/api/v1/responses"},
		{"POST", "/Api/V1/RESPONSES///", "/api/v1/responses"},
		{"HEAD", "/ReadyZ", "/readyz"},
		{"GET", "/api/v1/batch/0190/RESULTS/", "/api/v1/batch/{batch_id}/results"},
		{"GET", "/api/v1/batch/", ""},
		{"GET", "/api/v1/batch//results", ""},
		{"DELETE", "/api/v1/responses/", ""},
		{"POST", "/api/v1/respond", ""},
		{"GET", "/", ""},
	} {
		require.Equal(t, tt.want, routes.near(tt.method, tt.path), "%s %s", tt.method, tt.path)
	}
}
