// Package stagger spreads over a window the work that many tenants would
// otherwise start at the same instant, each at an instant of its own.
package stagger

import (
	"encoding/binary"
	"time"

	"github.com/google/uuid"
)

// Lead is how long before an instant the work of id due at it starts, given
// up to lead: an instant of lead's first half, (lead/2, lead], set by the
// id's random bits (those of a version 4 or 7 UUID), the same on every
// replica. Tenants that all started as a window opened would each wait for
// their own work behind all the others'.
func Lead(id uuid.UUID, lead time.Duration) time.Duration {
	half := max(uint64(lead/2), 1)
	return lead - time.Duration(binary.BigEndian.Uint64(id[8:])%half)
}
