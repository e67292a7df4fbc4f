package certfile

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/testcert"
)

type testBundle struct {
	certFile, keyFile string
	// errs and renewed are what the pair told of each change: why the files
	// did not read, or the name of the certificate then served.
	errs    []error
	renewed []string
	// written is the modification time the next write gets: each later
	// than the one before, as a rotation's writes are.
	written time.Time
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	dir := t.TempDir()
	return &testBundle{certFile: filepath.Join(dir, "tls.crt"), keyFile: filepath.Join(dir, "tls.key"), written: time.Now()}
}

func (b *testBundle) write(t *testing.T, path string, content []byte) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, content, 0o600))
	b.written = b.written.Add(time.Second)
	require.NoError(t, os.Chtimes(path, b.written, b.written))
}

func (b *testBundle) place(t *testing.T, c testcert.Credentials) {
	t.Helper()
	b.write(t, b.certFile, c.Cert)
	b.write(t, b.keyFile, c.Key)
}

// selfSigned is a certificate named name, with its key.
func selfSigned(t *testing.T, name string) testcert.Credentials {
	t.Helper()
	return testcert.NewAuthority(t, name).Credentials
}

// load loads the bundle's pair, its errors kept in b.errs.
func (b *testBundle) load(t *testing.T) *Pair {
	t.Helper()
	p, err := Load(b.certFile, b.keyFile, func(served *x509.Certificate, err error) {
		if err != nil {
			b.errs = append(b.errs, err)
			return
		}
		b.renewed = append(b.renewed, served.Subject.CommonName)
	})
	require.NoError(t, err)
	return p
}

// served is the name of the certificate a handshake gets.
func served(t *testing.T, p *Pair) string {
	t.Helper()
	cert, err := p.GetCertificate(&tls.ClientHelloInfo{})
	require.NoError(t, err)
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	require.NoError(t, err)
	return leaf.Subject.CommonName
}

func TestARenewedCertificateIsServed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.place(t, selfSigned(t, "one"))
	p := b.load(t)
	require.Equal(t, "one", served(t, p))
	require.Equal(t, "one", served(t, p))

	b.place(t, selfSigned(t, "two"))
	require.Equal(t, "two", served(t, p))
	require.Equal(t, "two", served(t, p))
	require.Empty(t, b.errs)
	require.Equal(t, []string{"two"}, b.renewed, "told once")
}

// TestNotAfterIsTheServedCertificates: the end of the certificate the files
// hold now, a renewal read again by the call itself (no handshake needed),
// and the one served before while the files do not read as a pair.
func TestNotAfterIsTheServedCertificates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	authority := testcert.NewAuthority(t, "certfile test authority")
	month, quarter := time.Now().Add(30*24*time.Hour), time.Now().Add(90*24*time.Hour)
	b.place(t, authority.IssueUntil(t, "localhost", net.IPv4(127, 0, 0, 1), month))
	p := b.load(t)
	require.Equal(t, month.Unix(), p.NotAfter().Unix())

	b.place(t, authority.IssueUntil(t, "localhost", net.IPv4(127, 0, 0, 1), quarter))
	require.Equal(t, quarter.Unix(), p.NotAfter().Unix())

	b.write(t, b.certFile, []byte("not a certificate"))
	require.Equal(t, quarter.Unix(), p.NotAfter().Unix())
	require.Len(t, b.errs, 1)
}

func TestFilesThatDoNotReadAsAPairLeaveThePairBefore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.place(t, selfSigned(t, "one"))
	p := b.load(t)

	// The certificate replaced before its key: the pair before is served,
	// and the mismatch told once.
	two := selfSigned(t, "two")
	b.write(t, b.certFile, two.Cert)
	require.Equal(t, "one", served(t, p))
	require.Equal(t, "one", served(t, p))
	require.Len(t, b.errs, 1)
	require.ErrorContains(t, b.errs[0], "private key does not match public key")
	b.write(t, b.keyFile, two.Key)
	require.Equal(t, "two", served(t, p))

	// A file gone, or not a certificate: likewise.
	require.NoError(t, os.Remove(b.keyFile))
	require.Equal(t, "two", served(t, p))
	require.Len(t, b.errs, 2)
	require.ErrorIs(t, b.errs[1], os.ErrNotExist)
	b.write(t, b.keyFile, two.Key)
	b.write(t, b.certFile, []byte("not a certificate"))
	require.Equal(t, "two", served(t, p))
	require.Len(t, b.errs, 3)
	three := selfSigned(t, "three")
	b.place(t, three)
	require.Equal(t, "three", served(t, p))
	require.Len(t, b.errs, 3)
	require.Equal(t, []string{"two", "three"}, b.renewed)
}

func TestLoadRefusesFilesThatDoNotReadAsAPair(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := Load(b.certFile, b.keyFile, nil)
	require.ErrorIs(t, err, os.ErrNotExist)
	one, two := selfSigned(t, "one"), selfSigned(t, "two")
	b.write(t, b.certFile, one.Cert)
	b.write(t, b.keyFile, two.Key)
	_, err = Load(b.certFile, b.keyFile, nil)
	require.ErrorContains(t, err, "private key does not match public key")
}
