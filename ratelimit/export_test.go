package ratelimit

import "github.com/google/uuid"

// Leasing reports whether key has a lease in flight or a slice of the next
// minute held: whether a Take started a lease in the background.
func (l *Limiter) Leasing(keyID uuid.UUID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[keyID]
	return b != nil && (b.leasing != nil || b.next != nil)
}
