package ratelimit

import (
	"context"
	"time"

	"github.com/google/uuid"
)

// Leasing reports whether key has a lease in flight or a slice of the next
// minute held: whether a Take started a lease in the background.
func (l *Limiter) Leasing(keyID uuid.UUID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[keyID]
	return b != nil && (b.leasing != nil || b.next != nil)
}

// Window is the minute of key's current slice (zero when there is none).
func (l *Limiter) Window(keyID uuid.UUID) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	if b := l.buckets[keyID]; b != nil {
		return b.window
	}
	return time.Time{}
}

// Flush returns the slices of idle keys and of minutes past now, as Run does
// each second.
func (l *Limiter) Flush(ctx context.Context) { l.flush(ctx, false) }
