package server

import (
	"net/netip"
	"strings"
)

// clientAddress is the address of the client a request came from, for the
// access log and the request's span: the connection's peer, or, when the peer
// is a trusted proxy (a load balancer in front of the gateway), the address
// X-Forwarded-For names nearest the gateway that is not itself a trusted
// proxy. The header is read from its right end: each proxy appends the peer
// it saw, so only what the trusted proxies wrote is believed, and whatever a
// client put there itself is not. An entry that is not an address ends the
// reading at the last address believed.
func clientAddress(remoteAddr string, forwarded []string, trusted []netip.Prefix) string {
	peer, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return "" // not an IP connection
	}
	addr := peer.Addr().Unmap()
	for i := len(forwarded) - 1; i >= 0 && isTrusted(addr, trusted); i-- {
		for list := forwarded[i]; list != "" && isTrusted(addr, trusted); {
			entry := list
			if comma := strings.LastIndexByte(list, ','); comma >= 0 {
				entry, list = list[comma+1:], list[:comma]
			} else {
				list = ""
			}
			next, ok := forwardedAddr(strings.TrimSpace(entry))
			if !ok {
				return addr.String()
			}
			addr = next
		}
	}
	return addr.String()
}

// forwardedAddr reads an entry of X-Forwarded-For: an address, with a port
// (`192.0.2.1:443`, `[2001:db8::1]:443`) or without.
func forwardedAddr(entry string) (netip.Addr, bool) {
	if addr, err := netip.ParseAddr(entry); err == nil {
		return addr.Unmap(), true
	}
	if ap, err := netip.ParseAddrPort(entry); err == nil {
		return ap.Addr().Unmap(), true
	}
	return netip.Addr{}, false
}

func isTrusted(addr netip.Addr, trusted []netip.Prefix) bool {
	for _, p := range trusted {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}
