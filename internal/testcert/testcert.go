// Package testcert makes certificates for tests: authorities, and the server
// and client certificates they issue, as PEM.
package testcert

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"time"

	"github.com/stretchr/testify/require"
)

// T is what the package needs of a test: *testing.T, or a benchmark's
// stand-in.
type T interface {
	Helper()
	require.TestingT
}

// Credentials are a certificate and its key, PEM-encoded.
type Credentials struct{ Cert, Key []byte }

// Authority issues certificates; its own, self-signed, are its Credentials.
type Authority struct {
	Credentials
	template *x509.Certificate
	signer   *ecdsa.PrivateKey
}

// NewAuthority returns an authority named name, valid from an hour ago for
// a day.
func NewAuthority(t T, name string) Authority {
	t.Helper()
	template := certificateTemplate(name)
	template.IsCA, template.BasicConstraintsValid = true, true
	template.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	a := Authority{template: template}
	a.Credentials, a.signer = sign(t, template, template, nil)
	return a
}

// Issue returns a certificate for name (a client's user, or a server's host
// with its address ip) signed by a, valid from an hour ago for a day.
func (a Authority) Issue(t T, name string, ip net.IP) Credentials {
	t.Helper()
	return a.IssueUntil(t, name, ip, time.Now().Add(24*time.Hour))
}

// IssueUntil is Issue of a certificate valid until notAfter.
func (a Authority) IssueUntil(t T, name string, ip net.IP, notAfter time.Time) Credentials {
	t.Helper()
	template := certificateTemplate(name)
	template.NotAfter = notAfter
	template.KeyUsage = x509.KeyUsageDigitalSignature
	template.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	if ip != nil {
		template.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		template.DNSNames, template.IPAddresses = []string{name}, []net.IP{ip}
	}
	c, _ := sign(t, template, a.template, a.signer)
	return c
}

func certificateTemplate(name string) *x509.Certificate {
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62)) // crypto/rand does not fail
	return &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
	}
}

// sign makes a key for template and signs it with parent's signer (its own
// when signer is nil).
func sign(t T, template, parent *x509.Certificate, signer *ecdsa.PrivateKey) (Credentials, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	if signer == nil {
		signer = key
	}
	der, err := x509.CreateCertificate(rand.Reader, template, parent, &key.PublicKey, signer)
	require.NoError(t, err)
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return Credentials{
		Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		Key:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}),
	}, key
}
