package gateway_test

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
)

// TestAnErrorSaysItsCodeAndCause: an error reads as its code and message,
// then its cause when it has one (for the log; a reply sends the code and
// message alone), and is its cause to errors.Is.
func TestAnErrorSaysItsCodeAndCause(t *testing.T) {
	t.Parallel()
	e := gateway.Errorf(gateway.EInferenceBusy, "the upstream is busy")
	require.EqualError(t, e, "INFERENCE_BUSY: the upstream is busy")
	e.Cause = io.ErrUnexpectedEOF
	require.EqualError(t, e, "INFERENCE_BUSY: the upstream is busy: unexpected EOF")
	require.ErrorIs(t, e, io.ErrUnexpectedEOF)
}
