package gateway

import (
	"context"
	"fmt"
	"slices"
	"time"

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
	// KeyExpiresAt is when the key stops being accepted; nil: never.
	KeyExpiresAt *time.Time
	// Rate is this request's count against the key's rate limit.
	Rate RateStatus
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

// RateStatus is the outcome of counting a request against its key's rate limit.
type RateStatus struct {
	Limit     int
	Remaining int
	// Admitted is false when the request is past the limit (it was not counted).
	Admitted bool
	// RetryAfter is, for a request past the limit, how long until the key's
	// window admits one more, when nothing else is counted meanwhile.
	RetryAfter time.Duration
}

// RateLimits are the requests per minute per key, by tier.
type RateLimits struct {
	Free      int
	Developer int
}

// DefaultRateLimits apply where GATEWAY_RATE_LIMIT is not set.
var DefaultRateLimits = RateLimits{Free: 60, Developer: 600}

// DefaultDailyCeiling is the daily rung ceiling of an account of tier t that has
// none of its own.
func (t Tier) DefaultDailyCeiling() int64 {
	if t == TierFree {
		return 1_000_000
	}
	return 10_000_000
}

// UnauthorizedError is UNAUTHORIZED: a missing, malformed, unknown, revoked or
// expired key.
func UnauthorizedError() *Error {
	return Errorf(EUnauthorized, "a valid API key is required: send Authorization: Bearer igw_…")
}

// RateLimitedError is RATE_LIMITED for a request past its key's rate limit.
// Its message says the wait too, for a stream, whose refusal has no header.
func RateLimitedError(r RateStatus) *Error {
	e := &Error{Code: ERateLimited, RetryAfter: r.RetryAfter}
	e.Message = fmt.Sprintf("rate limit of %d requests per minute reached for this key; retry in %d s", r.Limit, e.RetryAfterSeconds())
	return e
}
