package gateway

import (
	"context"
	"slices"

	"github.com/google/uuid"
)

// Tier is an account's tier.
type Tier string

// The tiers.
const (
	TierFree      Tier = "free"
	TierDeveloper Tier = "developer"
)

// Scope is a permission carried by an API key.
type Scope string

// The scopes.
const (
	ScopeInference Scope = "inference"
	ScopeUsage     Scope = "usage"
)

// Principal is the authenticated caller: a key, its project and its account.
type Principal struct {
	KeyID       uuid.UUID
	ProjectID   uuid.UUID
	ProjectName string
	AccountID   uuid.UUID
	AccountName string
	Tier        Tier
	Scopes      []Scope
}

// HasAnyScope reports whether the principal holds at least one of scopes.
func (p *Principal) HasAnyScope(scopes []Scope) bool {
	for _, s := range scopes {
		if slices.Contains(p.Scopes, s) {
			return true
		}
	}
	return false
}

type principalKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// PrincipalFrom returns the principal in ctx, or nil.
func PrincipalFrom(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// Source is one evidence entry.
type Source struct {
	Title   string `json:"title"`
	URL     string `json:"url"`
	Snippet string `json:"snippet,omitempty"`
}

// Evidence is what the gateway holds behind a request.
type Evidence struct {
	RequestID uuid.UUID
	Sources   []Source
	Verdict   string
}
