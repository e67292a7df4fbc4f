package benchenv

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/rungworks/gateway/internal/testcert"
)

// TLS writes a certificate for 127.0.0.1 and its key into dir and returns
// the variables that serve the API over TLS with them.
func TLS(dir string) (vars []string, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("error making a certificate: %v", r)
		}
	}()
	c := testcert.NewAuthority(failing{}, "bench authority").Issue(failing{}, "localhost", net.IPv4(127, 0, 0, 1))
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, c.Cert, 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(keyFile, c.Key, 0o600); err != nil {
		return nil, err
	}
	return []string{"GATEWAY_TLS_CERT=" + certFile, "GATEWAY_TLS_KEY=" + keyFile}, nil
}

// failing stands in for a test to testcert: a failure panics, for TLS to
// return.
type failing struct{}

func (failing) Helper()                           {}
func (failing) Errorf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (failing) FailNow()                          { panic("failed") }

// servedOverTLS says whether env serves the API over TLS, and a client that
// reaches it so, without checking the certificate (the benchmark's own).
func servedOverTLS(env []string) (bool, *http.Client) {
	if !slices.ContainsFunc(env, func(v string) bool { return strings.HasPrefix(v, "GATEWAY_TLS_CERT=") }) {
		return false, http.DefaultClient
	}
	return true, &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
}
