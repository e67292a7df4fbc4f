// Package certfile serves a TLS certificate from a certificate file and a
// key file that a rotation replaces (cert-manager, a mounted secret, an ACME
// client's renewal): each handshake looks at the files, and when they have
// changed since they were read, reads them again, so a renewed certificate
// is served from the next connection on, without a restart.
package certfile

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync"
	"time"

	"github.com/rungworks/gateway/internal/filestamp"
)

// Pair is a certificate and its key, read from their files.
type Pair struct {
	certFile, keyFile string
	// onChange is told of each change of the files: the certificate served
	// from then on and, when they could not be read as a pair, why (the
	// certificate read before stays).
	onChange func(*x509.Certificate, error)

	mu      sync.Mutex
	tried   filestamp.Stamp // the files' when last read or tried
	current *tls.Certificate
}

// Load reads the pair from certFile (PEM, the certificate followed by its
// chain) and keyFile (its PEM private key). onChange, when set, is told of
// each later change of the files, once each, with the certificate served
// from then on and, when they do not read as a pair (one file replaced
// before the other, or a mistake), why: the certificate read before stays.
func Load(certFile, keyFile string, onChange func(*x509.Certificate, error)) (*Pair, error) {
	p := &Pair{certFile: certFile, keyFile: keyFile, onChange: onChange, tried: filestamp.Of(certFile, keyFile)}
	if err := p.load(); err != nil {
		return nil, err
	}
	return p, nil
}

// GetCertificate is tls.Config's: the pair as the files hold it now, or,
// when they cannot be read as one, as they were last read.
func (p *Pair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	s := filestamp.Of(p.certFile, p.keyFile)
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.Equal(p.tried) {
		return p.current, nil
	}
	p.tried = s
	err := p.load()
	if p.onChange != nil {
		p.onChange(p.current.Leaf, err)
	}
	return p.current, nil
}

// Leaf is the certificate served: the one the files hold now, read again as
// a handshake would when they changed, or the one read before when they do
// not read as a pair.
func (p *Pair) Leaf() *x509.Certificate {
	cert, _ := p.GetCertificate(nil) // never fails: a pair was read at Load
	return cert.Leaf
}

// NotAfter is when the certificate served (Leaf) stops being valid.
func (p *Pair) NotAfter() time.Time { return p.Leaf().NotAfter }

// load reads the pair and serves it; on failure the pair served stays.
func (p *Pair) load() error {
	cert, err := tls.LoadX509KeyPair(p.certFile, p.keyFile)
	if err != nil {
		return fmt.Errorf("error reading the certificate and its key: %w", err)
	}
	p.current = &cert
	return nil
}
