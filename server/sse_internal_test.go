package server

import (
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// deadlineSink is a sink that takes every write and records the write
// deadlines set on it.
type deadlineSink struct {
	mu        sync.Mutex
	deadlines []time.Time
}

func (*deadlineSink) Write(p []byte) (int, error) { return len(p), nil }
func (*deadlineSink) Flush() error                { return nil }

func (d *deadlineSink) SetWriteDeadline(t time.Time) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deadlines = append(d.deadlines, t)
	return nil
}

func (d *deadlineSink) set() []time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]time.Time(nil), d.deadlines...)
}

// TestAWriteIsGivenUpOnceItWaitedItsTimeout: the beat that finds a write
// waiting for less than the write timeout comes back when the write will
// have waited it, not a whole timeout later; one that finds it waiting for
// the timeout fails it (a deadline of now).
func TestAWriteIsGivenUpOnceItWaitedItsTimeout(t *testing.T) {
	t.Parallel()
	const timeout = time.Minute
	beat := make(chan struct{}, 1)
	s := &sseWriter{keepalive: time.Hour, writeTimeout: timeout}
	s.timer = time.AfterFunc(time.Hour, func() { beat <- struct{}{} })
	t.Cleanup(func() { s.timer.Stop() })
	sink := &deadlineSink{}
	w := &watchedSink{sink: sink}

	w.since.Store(time.Now().Add(-timeout + 50*time.Millisecond).UnixNano())
	s.watch(w)
	require.Empty(t, sink.set(), "a write within its timeout")
	select {
	case <-beat:
	case <-time.After(timeout / 2):
		require.Fail(t, "the beat did not come back when the write had waited its timeout")
	}

	w.since.Store(time.Now().Add(-timeout).UnixNano())
	before := time.Now()
	s.watch(w)
	set := sink.set()
	require.Len(t, set, 1, "a write that waited its timeout")
	require.WithinRange(t, set[0], before, time.Now())
}

// TestABeatAfterCloseWritesNothing: a keep-alive beat that fires as the
// stream closes (its timer stopped too late) writes nothing after the
// response's end.
func TestABeatAfterCloseWritesNothing(t *testing.T) {
	t.Parallel()
	rec := httptest.NewRecorder()
	s := startSSE(rec, nil, time.Hour, time.Minute)
	require.NoError(t, s.Event(eventDelta, map[string]string{"delta": "Hi"}))
	written := rec.Body.String()
	s.Close()
	s.ping()
	require.Equal(t, written, rec.Body.String())
}

// failingSink is a deadlineSink whose first write fails, and which counts
// its writes.
type failingSink struct {
	deadlineSink
	writes int
}

func (f *failingSink) Write(p []byte) (int, error) {
	f.writes++
	if f.writes == 1 {
		return 0, errors.New("the client left")
	}
	return len(p), nil
}

// TestAfterAFailedWriteEveryWriteFails: once a write failed, every event
// fails with its error, unwritten: no event follows one that was lost. The
// close sets no deadline of its own then.
func TestAfterAFailedWriteEveryWriteFails(t *testing.T) {
	t.Parallel()
	sink := &failingSink{}
	s := &sseWriter{writeTimeout: time.Minute}
	s.setOutLocked(sink)
	err := s.Event(eventDelta, map[string]string{"delta": "Hi"})
	require.EqualError(t, err, "the client left")
	require.True(t, s.failed())
	require.Equal(t, err, s.Event(eventDelta, map[string]string{"delta": " there"}))
	require.Equal(t, 1, sink.writes)
	s.Close()
	require.Empty(t, sink.set())
}

// TestCloseBoundsTheResponsesEnd: the close stops the keep-alive beat and
// bounds what is written after it (a detached stream's last chunk) by a
// write's timeout; without a timeout, by nothing.
func TestCloseBoundsTheResponsesEnd(t *testing.T) {
	t.Parallel()
	for _, timeout := range []time.Duration{time.Minute, 0} {
		sink := &deadlineSink{}
		s := &sseWriter{keepalive: time.Hour, writeTimeout: timeout}
		s.timer = time.AfterFunc(time.Hour, s.ping)
		s.setOutLocked(sink)
		before := time.Now()
		s.Close()
		require.False(t, s.timer.Stop(), "the beat is stopped by the close")
		if timeout == 0 {
			require.Empty(t, sink.set())
			continue
		}
		set := sink.set()
		require.Len(t, set, 1)
		require.WithinRange(t, set[0], before.Add(timeout), time.Now().Add(timeout))
	}
}

// blockingSink is a deadlineSink whose writes wait until released, saying
// when one begins.
type blockingSink struct {
	deadlineSink
	began   chan struct{}
	release chan struct{}
}

func (b *blockingSink) Write(p []byte) (int, error) {
	b.began <- struct{}{}
	<-b.release
	return len(p), nil
}

// TestAWriteWaitingWithinItsTimeoutGoesOn: a beat that finds a write
// waiting for less than the write timeout leaves it waiting, and it ends
// well.
func TestAWriteWaitingWithinItsTimeoutGoesOn(t *testing.T) {
	t.Parallel()
	sink := &blockingSink{began: make(chan struct{}), release: make(chan struct{})}
	s := &sseWriter{keepalive: time.Hour, writeTimeout: time.Minute}
	s.timer = time.AfterFunc(time.Hour, s.ping)
	t.Cleanup(func() { s.timer.Stop() })
	s.setOutLocked(sink)
	written := make(chan error, 1)
	go func() { written <- s.Event(eventDelta, map[string]string{"delta": "Hi"}) }()
	<-sink.began
	s.ping()
	require.Empty(t, sink.set())
	close(sink.release)
	require.NoError(t, <-written)
}
