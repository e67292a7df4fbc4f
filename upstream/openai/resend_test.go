package openai_test

import (
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"

	"github.com/rungworks/gateway/internal/testlisten"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
)

// resettingUpstream is an HTTP/2 upstream (h2c, prior knowledge) that reads
// each call whole, counts it, and resets its stream with code instead of
// answering. It keeps the stream flow-control window its client announced.
type resettingUpstream struct {
	addr   string // host:port
	code   http2.ErrCode
	calls  atomic.Int32
	window atomic.Uint32
}

func newResettingUpstream(t *testing.T, code http2.ErrCode) *resettingUpstream {
	t.Helper()
	u := &resettingUpstream{code: code}
	u.window.Store(65535) // HTTP/2's initial window, unless the client says another
	u.addr = testlisten.Serve(t, u.serve)
	return u
}

// serve speaks just enough HTTP/2 on conn: settings, pings, and a reset
// for each stream the client ends.
func (u *resettingUpstream) serve(conn net.Conn) {
	if _, err := io.ReadFull(conn, make([]byte, len(http2.ClientPreface))); err != nil {
		return
	}
	fr := http2.NewFramer(conn, conn)
	if fr.WriteSettings() != nil {
		return
	}
	for {
		frame, err := fr.ReadFrame()
		if err != nil {
			return
		}
		ended := false
		switch f := frame.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if v, ok := f.Value(http2.SettingInitialWindowSize); ok {
					u.window.Store(v)
				}
				err = fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				err = fr.WritePing(true, f.Data)
			}
		case *http2.HeadersFrame:
			ended = f.StreamEnded()
		case *http2.DataFrame:
			ended = f.StreamEnded()
		}
		if ended {
			u.calls.Add(1)
			err = fr.WriteRSTStream(frame.Header().StreamID, u.code)
		}
		if err != nil {
			return
		}
	}
}

// TestACallWrittenWholeIsNotSentAgain: net/http's HTTP/2 transport sends a
// call again, up to six times, when the upstream resets its stream with
// PROTOCOL_ERROR, which an upstream may do after it processed the call. The
// client lets it send a call again only while no attempt was written whole
// or answered, so each call reaches the upstream once and fails after
// dispatch (D12). A stream refused (REFUSED_STREAM) was not processed, but
// the transport's retry cannot be told from the other: it fails alike.
func TestACallWrittenWholeIsNotSentAgain(t *testing.T) {
	t.Parallel()
	for _, code := range []http2.ErrCode{http2.ErrCodeProtocol, http2.ErrCodeRefusedStream} {
		t.Run(code.String(), func(t *testing.T) {
			t.Parallel()
			up := newResettingUpstream(t, code)
			client := openai.New(openai.Config{BaseURL: "http://" + up.addr + "/v1", H2C: true, Timeout: 5 * time.Second})
			t.Cleanup(client.CloseIdleConnections)
			_, err := client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, upstream.ErrFailed)
			require.Equal(t, int32(1), up.calls.Load(), "calls sent")

			_, _, err = collect(t, client, context.Background())
			require.Equal(t, upstream.KindFailed, upstream.Kind(err), "stream: %v", err)
			require.Equal(t, int32(2), up.calls.Load(), "calls sent")
		})
	}
}

// TestHTTP2CallsAreBufferedLittleAhead: an HTTP/2 upstream may send a call
// no more than 256 KiB ahead of the gateway's reads (net/http's default is
// 4 MiB), so a stream whose client reads slowly holds little of a hostile
// upstream's reply.
func TestHTTP2CallsAreBufferedLittleAhead(t *testing.T) {
	t.Parallel()
	up := newResettingUpstream(t, http2.ErrCodeRefusedStream)
	client := openai.New(openai.Config{BaseURL: "http://" + up.addr + "/v1", H2C: true, Timeout: 5 * time.Second})
	t.Cleanup(client.CloseIdleConnections)
	_, err := client.Complete(context.Background(), &req)
	require.Error(t, err)
	require.Equal(t, int32(1), up.calls.Load())
	require.Equal(t, uint32(256<<10), up.window.Load())
}
