// Package apikey makes and checks API keys: igw_ followed by 52 base32
// characters (32 random bytes). The first 12 characters are the public prefix the
// key is looked up by; only the SHA-256 of the whole key is stored.
package apikey

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"strings"
)

// Marker starts every key.
const Marker = "igw_"

const (
	secretBytes = 32
	prefixLen   = len(Marker) + 8
)

var encoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// keyLen is the length of a whole key.
var keyLen = len(Marker) + encoding.EncodedLen(secretBytes)

// ErrMalformed is returned for a string that cannot be a key.
var ErrMalformed = errors.New("malformed API key")

// Key is a freshly made key. Token is shown once and never stored.
type Key struct {
	Token  string
	Prefix string
	Hash   []byte
}

// Generate makes a new random key.
func Generate() (Key, error) {
	b := make([]byte, secretBytes)
	if _, err := rand.Read(b); err != nil {
		return Key{}, err
	}
	token := Marker + encoding.EncodeToString(b)
	return Key{Token: token, Prefix: token[:prefixLen], Hash: Hash(token)}, nil
}

// Parse checks token's form and returns its lookup prefix.
func Parse(token string) (prefix string, err error) {
	if len(token) != keyLen || !strings.HasPrefix(token, Marker) {
		return "", ErrMalformed
	}
	if _, err := encoding.DecodeString(token[len(Marker):]); err != nil {
		return "", ErrMalformed
	}
	return token[:prefixLen], nil
}

// Hash is the stored form of a key.
func Hash(token string) []byte {
	sum := sha256.Sum256([]byte(token))
	return sum[:]
}
