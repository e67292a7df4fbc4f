package server

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestClientAddress(t *testing.T) {
	t.Parallel()
	lb := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	for _, c := range []struct {
		name      string
		remote    string
		forwarded []string
		trusted   []netip.Prefix
		want      string
	}{
		{"no proxy trusted: the peer", "203.0.113.7:5000", []string{"198.51.100.1"}, nil, "203.0.113.7"},
		{"an untrusted peer's header is not believed", "203.0.113.7:5000", []string{"198.51.100.1"}, lb, "203.0.113.7"},
		{"a trusted peer without the header", "10.1.2.3:5000", nil, lb, "10.1.2.3"},
		{"the address the load balancer saw", "10.1.2.3:5000", []string{"198.51.100.1"}, lb, "198.51.100.1"},
		{"what the client wrote itself is not believed", "10.1.2.3:5000", []string{"192.0.2.66, 198.51.100.1"}, lb, "198.51.100.1"},
		{"through two trusted proxies", "10.1.2.3:5000", []string{"192.0.2.66, 198.51.100.1, 10.9.9.9"}, lb, "198.51.100.1"},
		{"over several header lines", "10.1.2.3:5000", []string{"192.0.2.66", "198.51.100.1", "10.9.9.9"}, lb, "198.51.100.1"},
		{"every entry trusted: the farthest", "10.1.2.3:5000", []string{"10.7.7.7,10.8.8.8"}, lb, "10.7.7.7"},
		{"entries with ports", "10.1.2.3:5000", []string{"[2001:db8::1]:443"}, lb, "2001:db8::1"},
		{"an entry with a port, v4", "10.1.2.3:5000", []string{"198.51.100.1:8443"}, lb, "198.51.100.1"},
		{"IPv6 peer", "[fd00::5]:5000", []string{"2001:db8::2"}, lb, "2001:db8::2"},
		{"IPv4 in IPv6 is IPv4", "[::ffff:10.1.2.3]:5000", []string{"::ffff:198.51.100.1"}, lb, "198.51.100.1"},
		{"an entry that is not an address stops the reading", "10.1.2.3:5000", []string{"198.51.100.1, unknown"}, lb, "10.1.2.3"},
		{"a forged line break is not an address", "10.1.2.3:5000", []string{"198.51.100.1\n\"admin\""}, lb, "10.1.2.3"},
		{"an empty entry stops the reading", "10.9.9.9:5000", []string{"198.51.100.1,,10.8.8.8"}, lb, "10.8.8.8"},
		{"not an IP connection", "@", nil, lb, ""},
	} {
		require.Equal(t, c.want, clientAddress(c.remote, c.forwarded, c.trusted), c.name)
	}
}
