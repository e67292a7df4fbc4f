package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestWelcomeNamesAnAddressToCall: the banner's curl line calls an address a
// client can reach: a wildcard listener's is the loopback's, any other is
// as it listens, over TLS with https.
func TestWelcomeNamesAnAddressToCall(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		addr    string
		overTLS bool
		base    string
	}{
		{"[::]:8080", false, "http://127.0.0.1:8080"},
		{"0.0.0.0:8080", false, "http://127.0.0.1:8080"},
		{":8080", true, "https://127.0.0.1:8080"},
		{"10.1.2.3:9000", false, "http://10.1.2.3:9000"},
		{"[::1]:8443", true, "https://[::1]:8443"},
	} {
		var out strings.Builder
		printWelcome(&out, tc.overTLS, tc.addr, "igw_key", "sim", "postgres://dev")
		require.Contains(t, out.String(), "Gateway ready on "+tc.base+" ", tc.addr)
		require.Contains(t, out.String(), "curl -s "+tc.base+"/api/v1/responses", tc.addr)
		require.Contains(t, out.String(), "OpenAPI document: "+tc.base+"/openapi.json", tc.addr)
	}
}
