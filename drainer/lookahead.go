package drainer

import (
	"sync"
	"time"
)

// lookahead sizes how many claimed items may wait for a worker: as many as
// the workers finish while one claim runs. When items take less time than a
// claim (an upstream answering in milliseconds), up to twice as many items as
// workers are held, so each claim takes about as many items as there are
// workers instead of the few that freed up during the last one: half the
// claims, and fewer, larger completion groups. When the workers finish fewer
// than one item during a claim (items that take seconds), none waits: a
// replica then holds no item that another replica, idle, could start.
type lookahead struct {
	mu    sync.Mutex
	claim time.Duration // moving average of a claim's latency
	item  time.Duration // moving average of an item's run
}

// smoothing is the weight of the past in the moving averages: the new
// sample counts for 1/smoothing.
const smoothing = 8

func (l *lookahead) observeClaim(d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claim = average(l.claim, d)
}

func (l *lookahead) observeItem(d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.item = average(l.item, d)
}

func average(avg, sample time.Duration) time.Duration {
	if avg == 0 {
		return max(sample, 1)
	}
	return avg + (sample-avg)/smoothing
}

// items returns how many claimed items may wait for one of workers: the
// whole items they finish during one claim, none until both a claim and an
// item have been timed, at most workers.
func (l *lookahead) items(workers int) int {
	l.mu.Lock()
	claim, item := l.claim, l.item
	l.mu.Unlock()
	if claim == 0 || item == 0 {
		return 0
	}
	n := int64(workers) * int64(claim) / int64(item)
	return int(min(n, int64(workers)))
}
