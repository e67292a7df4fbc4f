package gateway

import (
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// BatchStatus is the status of a batch (interface §3.1).
type BatchStatus string

// The batch statuses.
const (
	BatchQueued     BatchStatus = "queued"
	BatchInProgress BatchStatus = "in_progress"
	BatchCancelling BatchStatus = "cancelling"
	BatchCompleted  BatchStatus = "completed"
	BatchFailed     BatchStatus = "failed"
	BatchCancelled  BatchStatus = "cancelled"
	BatchExpired    BatchStatus = "expired"
)

// BatchStatuses lists every batch status.
var BatchStatuses = []BatchStatus{BatchQueued, BatchInProgress, BatchCancelling, BatchCompleted, BatchFailed, BatchCancelled, BatchExpired}

// Terminal reports whether a batch in status s never changes again.
func (s BatchStatus) Terminal() bool {
	return s == BatchCompleted || s == BatchFailed || s == BatchCancelled || s == BatchExpired
}

// Cancellable reports whether a batch in status s can be cancelled.
func (s BatchStatus) Cancellable() bool {
	_, err := NextBatchStatus(s, EventCancel, ItemsOutcome{})
	return err == nil
}

// ItemStatus is the status of a batch item.
type ItemStatus string

// The item statuses.
const (
	ItemQueued     ItemStatus = "queued"
	ItemInProgress ItemStatus = "in_progress"
	ItemCompleted  ItemStatus = "completed"
	ItemFailed     ItemStatus = "failed"
	ItemCancelled  ItemStatus = "cancelled"
)

// BatchEvent is something that happens to a batch.
type BatchEvent int

// The batch events.
const (
	// EventDrainStarted: a replica claimed the batch's first item.
	EventDrainStarted BatchEvent = iota
	// EventCancel: the owner asked to cancel.
	EventCancel
	// EventWindowElapsed: the completion window ended; unrun items are cancelled.
	EventWindowElapsed
	// EventItemsDone: every item reached an outcome (completed, failed or cancelled).
	EventItemsDone
)

// BatchEvents lists every event.
var BatchEvents = []BatchEvent{EventDrainStarted, EventCancel, EventWindowElapsed, EventItemsDone}

// String names the event in messages ("drain started", "cancel", …).
func (e BatchEvent) String() string {
	return [...]string{"drain started", "cancel", "window elapsed", "items done"}[e]
}

// ItemsOutcome summarises a batch's items.
type ItemsOutcome struct {
	// AnySucceeded: at least one item completed.
	AnySucceeded bool
	// WindowElapsed: the completion window ended before every item ran.
	WindowElapsed bool
	// Running: an item is claimed by a replica (it may be at the upstream).
	Running bool
}

// ErrInvalidTransition is returned for an event a batch status does not accept.
var ErrInvalidTransition = errors.New("invalid batch transition")

// NextBatchStatus is the batch state machine of interface §3.1 and decisions
// D8, the one place that decides it:
//
//	from          drain started  cancel        window elapsed  items done
//	queued        in_progress    cancelled²    expired³        (see below)
//	in_progress   in_progress    cancelling    in_progress¹    (see below)
//	cancelling    cancelling     409           cancelling      cancelled
//	terminal      invalid        409           terminal        invalid
//
// Items done: expired when the window elapsed first, else completed when any
// item succeeded, else failed; from cancelling, always cancelled.
// ¹ the unrun items are cancelled and the batch waits for the items in flight,
// which finish and are billed; items done then makes it expired.
// ² cancelling while an item is running (claimed, its batch not yet started):
// the batch waits for it like an in_progress one, so no terminal batch is
// left with an item running.
// ³ queued while an item is running: the batch stays queued, its unrun items
// cancelled, and waits for it likewise; items done then makes it expired.
func NextBatchStatus(from BatchStatus, ev BatchEvent, outcome ItemsOutcome) (BatchStatus, error) {
	if ev == EventCancel && from != BatchQueued && from != BatchInProgress {
		return from, Errorf(EBatchNotCancellable, "a batch that is %s cannot be cancelled", from)
	}
	switch from {
	case BatchQueued, BatchInProgress:
		switch ev {
		case EventDrainStarted:
			return BatchInProgress, nil
		case EventCancel:
			if from == BatchQueued && !outcome.Running {
				return BatchCancelled, nil
			}
			return BatchCancelling, nil
		case EventWindowElapsed:
			if from == BatchQueued && !outcome.Running {
				return BatchExpired, nil
			}
			return from, nil
		case EventItemsDone:
			switch {
			case outcome.WindowElapsed:
				return BatchExpired, nil
			case outcome.AnySucceeded:
				return BatchCompleted, nil
			default:
				return BatchFailed, nil
			}
		}
	case BatchCancelling:
		switch ev {
		case EventDrainStarted, EventWindowElapsed:
			return BatchCancelling, nil
		case EventItemsDone:
			return BatchCancelled, nil
		}
	default:
		if from.Terminal() && ev == EventWindowElapsed {
			return from, nil
		}
	}
	return from, fmt.Errorf("%w: %s on a %s batch", ErrInvalidTransition, ev, from)
}

// BatchError is the batch-level error of a failed or expired batch.
func BatchError(status BatchStatus, firstItemError ErrorCode) *Error {
	switch status {
	case BatchFailed:
		if firstItemError == "" {
			firstItemError = EInferenceBusy
		}
		return Errorf(firstItemError, "no item of the batch succeeded")
	case BatchExpired:
		return Errorf(EBatchExpired, "the completion window ended before every item ran")
	}
	return nil
}

// Batch is a batch as its owner sees it. Counters and usage are a live view of
// its items.
type Batch struct {
	ID          uuid.UUID
	Status      BatchStatus
	Total       int
	Completed   int
	Failed      int
	Cancelled   int
	Usage       Usage
	CreatedAt   time.Time
	StartedAt   *time.Time
	CompletedAt *time.Time
	ExpiresAt   time.Time
	Error       *Error
}

// BatchItem is one item's outcome.
type BatchItem struct {
	Index     int
	Status    ItemStatus
	RequestID *uuid.UUID // completed items
	Model     Model      // completed items
	Content   string     // completed items
	Usage     Usage
	Route     *UpstreamRoute // completed items
	Error     *Error         // failed items
}

// UpstreamRoute is the upstream target that answered a call (a request or a
// batch item), and how many targets were tried for it.
type UpstreamRoute struct {
	Provider      string
	UpstreamModel string
	Attempts      int
}

// Limits of a batch.
const (
	MaxBatchItems        = 100
	MaxIdempotencyKeyLen = 255
)

// ValidateIdempotencyKey checks an Idempotency-Key (D11): 1 to 255 printable
// ASCII characters (0x21–0x7E).
func ValidateIdempotencyKey(key string) error {
	if key == "" || len(key) > MaxIdempotencyKeyLen {
		return Errorf(EInvalidRequest, "Idempotency-Key must be 1 to %d characters; it is %d", MaxIdempotencyKeyLen, len(key))
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x21 || key[i] > 0x7e {
			return Errorf(EInvalidRequest, "Idempotency-Key may hold only printable ASCII characters (0x21 to 0x7E); byte %d is 0x%02X", i, key[i])
		}
	}
	return nil
}
