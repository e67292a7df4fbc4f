package gateway

import (
	"time"

	"github.com/google/uuid"
)

// Usage is the metered cost of one request or batch item: upstream token counts
// and the rungs they price to.
type Usage struct {
	InputTokens  int64
	OutputTokens int64
	InputRungs   int64
	OutputRungs  int64
	TotalRungs   int64
}

// UsageRecord is a request whose usage is committed, with its evidence.
type UsageRecord struct {
	RequestID         uuid.UUID
	Principal         *Principal
	Model             Model
	Entry             EntryPoint
	Failed            bool
	Usage             Usage
	CreatedAt         time.Time
	CompletedAt       time.Time
	Sources           []Source
	Verdict           string
	EvidenceExpiresAt time.Time
}
