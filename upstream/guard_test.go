package upstream_test

import (
	"context"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// scripted is a provider that returns what the test gives it.
type scripted struct {
	res    upstream.Result
	deltas []upstream.Delta
	err    error
}

func (p scripted) Complete(context.Context, *upstream.Request) (upstream.Result, error) {
	return p.res, p.err
}

func (p scripted) Stream(_ context.Context, _ *upstream.Request, emit func(upstream.Delta) error) (upstream.Result, error) {
	for _, d := range p.deltas {
		if err := emit(d); err != nil {
			return p.res, err
		}
	}
	return p.res, p.err
}

func TestClean(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"plain":            "plain",
		"a\x00b":           "ab",
		"\x00\x00":         "",
		"bad \xff\xfe end": "bad \uFFFD end",
		"ok ✓":             "ok ✓",
		"\xe2\x82":         "\uFFFD",
	} {
		got := upstream.Clean(in)
		require.Equal(t, want, got, "%q", in)
		require.True(t, utf8.ValidString(got))
	}
}

func TestGuardCleansEverythingReturned(t *testing.T) {
	t.Parallel()
	hostile := upstream.Result{
		Content: "a\x00b\xff", Verdict: "v\x00",
		Sources: []gateway.Source{{Title: "t\x00", URL: "u\x00\xfe", Snippet: "s\x00"}},
	}
	p := upstream.Guard(scripted{res: hostile, deltas: []upstream.Delta{{Content: "d\x00", Sources: []gateway.Source{{Title: "x\x00"}}}}})

	res, err := p.Complete(context.Background(), &upstream.Request{})
	require.NoError(t, err)
	require.Equal(t, "ab\uFFFD", res.Content)
	require.Equal(t, "v", res.Verdict)
	require.Equal(t, []gateway.Source{{Title: "t", URL: "u\uFFFD", Snippet: "s"}}, res.Sources)

	var got []upstream.Delta
	_, err = p.Stream(context.Background(), &upstream.Request{}, func(d upstream.Delta) error {
		got = append(got, d)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []upstream.Delta{{Content: "d", Sources: []gateway.Source{{Title: "x"}}}}, got)
}

func TestKind(t *testing.T) {
	t.Parallel()
	require.Equal(t, "unavailable", upstream.Kind(upstream.ErrUnavailable))
	require.Equal(t, "failed", upstream.Kind(upstream.ErrFailed))
	require.Equal(t, "rejected", upstream.Kind(&upstream.RejectedError{}))
	require.Equal(t, "broken", upstream.Kind(upstream.ErrStreamBroken))
	require.Equal(t, "cancelled", upstream.Kind(context.Canceled))
	require.Equal(t, "other", upstream.Kind(errors.New("x")))
	require.Empty(t, upstream.Kind(nil))
}
