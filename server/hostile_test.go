package server_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/internal/metricstest"
	"github.com/rungworks/gateway/metrics"
	"github.com/rungworks/gateway/server"
)

func (r reply) message(t *testing.T) string {
	t.Helper()
	var env api.ErrorEnvelope
	require.NoError(t, json.Unmarshal(r.body, &env), string(r.body))
	return env.Error.Message
}

// TestNULIsRefusedOnEveryPath pins D11: a string field holding U+0000,
// inside it or first, is 400 INVALID_REQUEST naming the field, interactive,
// streamed or batched alike.
func TestNULIsRefusedOnEveryPath(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, field := range []string{"prompt", "custom_instructions", "studio_id", "model"} {
		for _, value := range []string{"a\x00b", "\x00 first"} {
			item := map[string]any{"prompt": "fine", field: value}
			for _, path := range []string{"/api/v1/responses", "/api/v1/chat"} {
				r := b.post(path, b.key, item)
				require.Equal(t, http.StatusBadRequest, r.status, "%s %s %q", path, field, value)
				require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
				require.Contains(t, r.message(t), field)
			}
			_, s := b.stream("/api/v1/responses", item)
			require.Len(t, s.Events, 1)
			var env api.ErrorEnvelope
			s.Events[0].Decode(t, &env)
			require.Equal(t, api.ErrorCode("INVALID_REQUEST"), env.Error.Code)

			r := b.post("/api/v1/batch", b.key, map[string]any{"requests": []any{map[string]any{"prompt": "ok"}, item}})
			require.Equal(t, http.StatusBadRequest, r.status, "batch %s %q", field, value)
			require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
			require.Equal(t, "1", r.header.Get("x-service-batch-index"))
		}
	}
	require.Zero(t, b.upstream.callCount(), "nothing reached the upstream")
}

// TestBodyMustBeUTF8: a body holding bytes that are not UTF-8 is refused,
// naming the first such byte, its field and, in a batch, its item, on every
// path (a stream's too: a body that does not decode is refused before its
// head), and nothing is stored; encoding/json would take each such byte for
// U+FFFD, so a prompt sent within the limit could be refused as over it. An
// escape of a lone surrogate is valid JSON: it is decoded as U+FFFD.
func TestBodyMustBeUTF8(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for body, message := range map[string]string{
		"{\"prompt\":\"ab\xffcd\"}":                                        `field "prompt" is not valid UTF-8 (byte 14 of the body)`,
		"{\"prompt\":\"cut short \xe2\x82\"}":                              `field "prompt" is not valid UTF-8 (byte 22 of the body)`,
		"{\"prompt\":\"fine\",\"custom_instructions\":\"\xc0\xaf\"}":       `field "custom_instructions" is not valid UTF-8 (byte 41 of the body)`,
		"{\"prompt\":\"fine\",\"stream\":true,\"model\":\"\xed\xa0\x80\"}": `field "model" is not valid UTF-8 (byte 41 of the body)`,
		"{\"prompt\":\"fine\",\"\xfe\":1}":                                 `the body is not valid UTF-8 (byte 19)`,
		"{\"prompt\":\"\xef\xbf\xbd then \xff\"}":                          `field "prompt" is not valid UTF-8 (byte 21 of the body)`,
		"{\"prompt\":\"fine\",\"tags\":[{\"a\":\"\xff\"}]}":                `field "tags" is not valid UTF-8 (byte 32 of the body)`,
		"[\"prompt\",\"\xff\"]":                                            `the body is not valid UTF-8 (byte 12)`,
	} {
		for _, path := range []string{"/api/v1/responses", "/api/v1/chat"} {
			r := b.postRaw(path, body)
			require.Equal(t, http.StatusBadRequest, r.status, "%s %q", path, body)
			require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
			require.Equal(t, message, r.message(t))
			require.Empty(t, r.header.Get("x-service-batch-index"), "no item is named outside a batch")
		}
	}

	r := b.postRaw("/api/v1/batch", "{\"requests\":[{\"prompt\":\"ok\"},{\"prompt\":\"fine\"},{\"prompt\":\"caf\xe9\"}]}")
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	require.Equal(t, `requests[2]: field "prompt" is not valid UTF-8 (byte 62 of the body)`, r.message(t))
	require.Equal(t, "2", r.header.Get("x-service-batch-index"))
	r = b.postRaw("/api/v1/batch", "{\"requests\":[{\"prompt\":\"ok\",\"\x80\":1}]}")
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, `requests[0]: the body is not valid UTF-8 (byte 30)`, r.message(t))
	require.Equal(t, "0", r.header.Get("x-service-batch-index"))
	r = b.postRaw("/api/v1/batch", "{\"requests\":{\"\xff\":1}}")
	require.Equal(t, `field "requests" is not valid UTF-8 (byte 15 of the body)`, r.message(t))
	require.Empty(t, r.header.Get("x-service-batch-index"), "an object where the items go names no item")
	require.Zero(t, b.upstream.callCount(), "nothing reached the upstream")
	var batches api.BatchList
	require.NoError(t, json.Unmarshal(b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil).body, &batches))
	require.Empty(t, batches.Data, "nothing was stored")

	r = b.postRaw("/api/v1/responses", `{"prompt":"caf\u00e9 \ud83c\udf0d, half \ud83c!","custom_instructions":"na\u00efve"}`)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	var res api.Response
	require.NoError(t, json.Unmarshal(r.body, &res))
	require.Equal(t, "answer to café 🌍, half \uFFFD!", res.Content, "a lone surrogate's escape is U+FFFD")
	r = b.postRaw("/api/v1/responses", `{"prompt":"café naïve 🌍"}`)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
}

// TestAByteOrderMarkIsIgnored: a body that begins with UTF-8's byte order
// mark (RFC 8259 lets a parser ignore it; Windows PowerShell writes one) is
// read as the JSON after it, on every path, and a refusal's offset still
// counts the mark's bytes.
func TestAByteOrderMarkIsIgnored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	post := func(path, body string) reply { return b.postRaw(path, "\xef\xbb\xbf"+body) }
	r := post("/api/v1/responses", `{"prompt":"hi"}`)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	var res api.Response
	require.NoError(t, json.Unmarshal(r.body, &res))
	require.Equal(t, "answer to hi", res.Content)
	require.Equal(t, http.StatusAccepted, post("/api/v1/batch", `{"requests":[{"prompt":"hi"}]}`).status)

	r = post("/api/v1/responses", `{"prompt":}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "malformed JSON at byte 14", r.message(t), "the mark's three bytes are counted")
	r = post("/api/v1/responses", "")
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "a JSON body is required", r.message(t))
}

func TestIdempotencyKeyMustBePrintableASCII(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	body := map[string]any{"requests": items(1)}
	for _, key := range []string{"", "\xff\xfe", "has space", "tab\there", strings.Repeat("k", 256), "é"} {
		r := b.postWith("/api/v1/batch", b.key, body, http.Header{"Idempotency-Key": {key}})
		require.Equal(t, http.StatusBadRequest, r.status, "%q", key)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
		require.Contains(t, r.message(t), "Idempotency-Key")
	}
	r := b.postWith("/api/v1/batch", b.key, body, http.Header{"Idempotency-Key": {"one", "two"}})
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "parameter Idempotency-Key must be given once", r.message(t))
	r = b.postWith("/api/v1/batch", b.key, body, http.Header{"Idempotency-Key": {"~ok-Key_1!" + strings.Repeat("k", 245)}})
	require.Equal(t, http.StatusAccepted, r.status)
}

// TestParameterErrorsSpeakPlainly: a malformed parameter is named with the
// form it takes, never with a parser's text; one given twice is refused, a
// time as a number (the generated binder took one of two times silently),
// while a name the operation does not take is ignored, repeated or not.
func TestParameterErrorsSpeakPlainly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for path, want := range map[string]string{
		"/api/v1/batches?limit=1.5":                                           "parameter limit must be a whole number from 1 to 50",
		"/api/v1/batches?limit=x":                                             "parameter limit must be a whole number from 1 to 50",
		"/api/v1/batches?limit=0":                                             "parameter limit must be a whole number from 1 to 50, not 0",
		"/api/v1/batches?limit=51":                                            "parameter limit must be a whole number from 1 to 50, not 51",
		"/api/v1/usage?start=tomorrow":                                        "parameter start must be an RFC 3339 timestamp such as 2026-01-02T15:04:05Z, or a date such as 2026-01-02 (its midnight UTC)",
		"/api/v1/usage?end=2026-13-45T00:00":                                  "parameter end must be an RFC 3339 timestamp",
		"/api/v1/batches?limit=5&limit=10":                                    "parameter limit must be given once",
		"/api/v1/usage?start=2026-11-01T00:00:00Z&start=2026-11-20T00:00:00Z": "parameter start must be given once",
		// A query the parser would drop a pair of: the period asked for is
		// not silently replaced by today.
		"/api/v1/usage?start=%zz": "the query string is malformed",
		"/api/v1/usage?start=2026-11-01T00:00:00Z;end=2026-11-02T00:00:00Z": "the query string is malformed",
		"/api/v1/batches?limit=5&x=%":                                       "the query string is malformed",
		// Empty is not left out: an empty start was read as the year 1.
		"/api/v1/usage?start=":      "parameter start must be an RFC 3339 timestamp",
		"/api/v1/usage?start=&end=": "parameter start must be an RFC 3339 timestamp",
		"/api/v1/batches?after=":    "parameter after must be a UUID",
		"/api/v1/batches?limit=":    "parameter limit must be a whole number from 1 to 50",
	} {
		r := b.do(http.MethodGet, path, b.key, "", nil)
		require.Equal(t, http.StatusBadRequest, r.status, path)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
		msg := r.message(t)
		require.Contains(t, msg, want, path)
		for _, leak := range []string{"strconv", "ParseInt", "parsing time", "2006-01-02", "error binding"} {
			require.NotContains(t, msg, leak, path)
		}
	}
	for _, path := range []string{
		"/api/v1/usage?limit=1&limit=2&x=",
		"/api/v1/batches?start=2026-11-01T00:00:00Z&start=x&batch_id=a&batch_id=b",
		"/api/v1/batch/" + uuid.NewString() + "?batch_id=a&batch_id=b",
	} {
		r := b.do(http.MethodGet, path, b.key, "", nil)
		require.NotEqual(t, http.StatusBadRequest, r.status, "%s: %s", path, r.body)
	}
	r := b.do(http.MethodGet, "/api/v1/usage?start=a&start=b", "", "", nil)
	require.Equal(t, http.StatusUnauthorized, r.status, "a key is checked before the parameters")
}

// TestFieldNamesMatchExactly pins D11: a name differing only in case is an
// unknown field, ignored, on every body.
func TestFieldNamesMatchExactly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	post := func(body string) reply {
		return b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", []byte(body))
	}
	r := post(`{"prompt":"","Prompt":"hi"}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EEmptyPrompt, r.errorCode(t))

	r = post(`{"prompt":"hi","Stream":true,"MODEL":"reasoning","\u0050rompt":"smuggled","ſtream":true}`)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, "application/json", r.header.Get("Content-Type"), "Stream is not stream")
	require.Equal(t, "instant", r.json(t)["model"], "MODEL is not model")

	huge := strings.Repeat("x", 2*gateway.MaxPromptBytes)
	r = post(fmt.Sprintf(`{"prompt":"small","Prompt":%q}`, huge))
	require.Equal(t, http.StatusOK, r.status, "an oversized Prompt is an ignored field, not the prompt")
	calls := b.upstream.calls
	require.Equal(t, "small", calls[len(calls)-1].Prompt)

	r = b.do(http.MethodPost, "/api/v1/batch", b.key, "application/json", []byte(`{"Requests":[{"prompt":"a"}],"requests":[{"PROMPT":"x","prompt":"y"}]}`))
	require.Equal(t, http.StatusAccepted, r.status)
	res := b.do(http.MethodGet, "/api/v1/batch/"+r.batch(t).Id.String(), b.key, "", nil)
	require.Equal(t, 1, res.batch(t).TotalRequests)
}

// TestFieldNamedTwiceIsRefused: an object that names a field twice (also by
// an escape) is 400 INVALID_REQUEST naming it, on every body, where a decoder
// would take the last value silently and a proxy or log in front may have
// read the first; the same name in two objects, a name that differs in case
// and an unknown key named twice are no repeat.
func TestFieldNamedTwiceIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for body, field := range map[string]string{
		`{"prompt":"checked","prompt":"smuggled"}`:                    "prompt",
		`{"prompt":"checked","pro\u006dpt":"smuggled"}`:               "prompt",
		`{"prompt":"hi","max_output_rungs":10,"max_output_rungs":20}`: "max_output_rungs",
		`{"prompt":"hi","stream":true,"stream":false}`:                "stream",
	} {
		r := b.postRaw("/api/v1/responses", body)
		require.Equal(t, http.StatusBadRequest, r.status, body)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
		require.Equal(t, fmt.Sprintf("field %q appears more than once in one object; name each field once", field), r.message(t))
	}
	r := b.postRaw("/api/v1/batch", `{"requests":[{"prompt":"a"},{"prompt":"b","model":"instant","model":"reasoning"}]}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.message(t), `field "model" appears more than once`)
	require.Zero(t, b.upstream.callCount(), "nothing reached the upstream")

	r = b.postRaw("/api/v1/batch", `{"requests":[{"prompt":"a","model":"instant"},{"prompt":"b","model":"instant"}]}`)
	require.Equal(t, http.StatusAccepted, r.status, "one name in two objects")
	r = b.postRaw("/api/v1/responses", `{"prompt":"hi","PROMPT":"x","PROMPT":"y","note":1,"note":2}`)
	require.Equal(t, http.StatusOK, r.status, "unknown keys are ignored, twice or not")
}

// TestOneAuthorizationHeader: a request with two Authorization headers is
// refused whichever holds the valid key, where net/http reads the first and
// a proxy in front may read the other.
func TestOneAuthorizationHeader(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, keys := range [][]string{{b.key, "igw_wrong"}, {"igw_wrong", b.key}, {b.key, b.key}} {
		header := http.Header{"Authorization": {"Bearer " + keys[0], "Bearer " + keys[1]}}
		r := b.doWith(http.MethodGet, "/api/v1/usage", "", "", nil, header)
		require.Equal(t, http.StatusUnauthorized, r.status, keys)
		require.Equal(t, gateway.EUnauthorized, r.errorCode(t))
		require.Equal(t, "send one Authorization header, not 2", r.message(t))
	}
	require.Equal(t, http.StatusOK, b.do(http.MethodGet, "/api/v1/usage", b.key, "", nil).status)
}

// TestContentTypeMustBeJSONInUTF8: a body is read only as application/json,
// with no charset or UTF-8's (spelt either way).
func TestContentTypeMustBeJSONInUTF8(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	body := []byte(`{"prompt":"hi"}`)
	r := b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json; charset=utf-16", body)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	require.Contains(t, r.message(t), "UTF-8")
	for _, ct := range []string{"application/vnd.api+json", "text/json", "text/plain", "application/json-seq", ""} {
		r := b.do(http.MethodPost, "/api/v1/responses", b.key, ct, body)
		require.Equal(t, http.StatusBadRequest, r.status, ct)
		require.Equal(t, "Content-Type must be application/json", r.message(t), ct)
	}
	for _, ct := range []string{"application/json; charset=UTF-8", "application/json;charset=utf8", "application/json"} {
		require.Equal(t, http.StatusOK, b.do(http.MethodPost, "/api/v1/responses", b.key, ct, body).status, ct)
	}
}

// TestCompressedBodyIsRefused: a body with a Content-Encoding is refused
// before it is read, whether it is compressed or only claims to be, on the
// interactive and the batch paths, and nothing reaches the upstream or is
// stored.
func TestCompressedBodyIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	body := []byte(`{"prompt":"hi"}`)
	var zipped bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	_, err := zw.Write(body)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	batch := []byte(`{"requests":[{"prompt":"hi"}]}`)
	for _, tc := range []struct {
		path, coding string
		body         []byte
	}{
		{"/api/v1/responses", "gzip", zipped.Bytes()},
		{"/api/v1/responses", "gzip", body},
		{"/api/v1/chat", "br", body},
		{"/api/v1/responses", "identity, gzip", body},
		{"/api/v1/batch", "deflate", batch},
	} {
		r := b.doWith(http.MethodPost, tc.path, b.key, "application/json", tc.body, http.Header{"Content-Encoding": {tc.coding}})
		require.Equal(t, http.StatusBadRequest, r.status, tc)
		require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
		require.Contains(t, r.message(t), "send the body uncompressed")
	}
	require.Zero(t, b.upstream.callCount(), "nothing reached the upstream")
	list := b.do(http.MethodGet, "/api/v1/batches", b.key, "", nil)
	require.Equal(t, http.StatusOK, list.status)
	require.JSONEq(t, `{"data":[],"has_more":false}`, string(list.body), "no batch was stored")

	for _, coding := range []string{"identity", "IDENTITY", ""} {
		r := b.doWith(http.MethodPost, "/api/v1/responses", b.key, "application/json", body, http.Header{"Content-Encoding": {coding}})
		require.Equal(t, http.StatusOK, r.status, coding)
	}
}

// TestForbiddenRepliesCarryRateHeaders: the request was counted, so the
// reply says how many remain (D5).
func TestForbiddenRepliesCarryRateHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	usageOnly := b.newKey("acme", gateway.TierDeveloper, gateway.ScopeUsage)
	r := b.post("/api/v1/responses", usageOnly, map[string]any{"prompt": "hi"})
	require.Equal(t, http.StatusForbidden, r.status)
	require.Equal(t, gateway.EInsufficientScope, r.errorCode(t))
	require.NotEmpty(t, r.header.Get("x-ratelimit-limit"))
	require.NotEmpty(t, r.header.Get("x-ratelimit-remaining"))
}

// TestSlowBodyIsRequestTimeout: a body that trickles in is cut at the body
// timeout with 408 in the envelope, and the message names no address.
func TestSlowBodyIsRequestTimeout(t *testing.T) {
	t.Parallel()
	b := setupWith(t, options{server: func(c *server.Config) { c.BodyTimeout = 200 * time.Millisecond }})
	r := b.trickle(t, "/api/v1/responses", `{"prompt":`)
	require.Equal(t, http.StatusRequestTimeout, r.status)
	require.Equal(t, gateway.ErrorCode("REQUEST_TIMEOUT"), r.errorCode(t))
	require.NotContains(t, r.message(t), "127.0.0.1")
	require.NotContains(t, r.message(t), "i/o timeout")
}

// trickle posts to path, with the bundle's key, a body that declares 100
// bytes and sends only start, and returns the reply the server sends
// without waiting for the rest.
func (b *testBundle) trickle(t *testing.T, path, start string) reply {
	t.Helper()
	return b.sendRaw(t, fmt.Sprintf("POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n%s", path, b.key, start))
}

// TestABodyThatCannotBeReadIsRefused: a body whose framing is broken (a
// chunk's size that is no number) is refused 400 INVALID_REQUEST in the
// envelope: neither a timeout nor the gateway's fault; nothing reaches the
// upstream.
func TestABodyThatCannotBeReadIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	r := b.sendRaw(t, fmt.Sprintf("POST /api/v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\nzz\r\n", b.key))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EInvalidRequest, r.errorCode(t))
	require.Equal(t, "the request body could not be read", r.message(t))
	require.Zero(t, b.upstream.callCount(), "nothing reached the upstream")
}

// sendRaw writes request as it is on a connection of its own, and returns
// the reply the server sends without waiting for more.
func (b *testBundle) sendRaw(t *testing.T, request string) reply {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(b.http.URL, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, request)
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return reply{proto: resp.Proto, status: resp.StatusCode, header: resp.Header, body: body}
}

// TestDatabaseAwayIsServiceUnavailable pins D12: with PostgreSQL out of
// reach, requests are 503 SERVICE_UNAVAILABLE with Retry-After, not 500.
func TestDatabaseAwayIsServiceUnavailable(t *testing.T) {
	t.Parallel()
	o, addr := databaseAway(t)
	b := setupWith(t, o)
	for _, path := range []string{"/api/v1/responses", "/api/v1/batch"} {
		r := b.post(path, b.key, map[string]any{"prompt": "hi", "requests": items(1)})
		require.Equal(t, http.StatusServiceUnavailable, r.status, path)
		require.Equal(t, gateway.EServiceUnavailable, r.errorCode(t))
		require.NotEmpty(t, r.header.Get("Retry-After"))
		require.NotContains(t, r.message(t), addr)
	}
}

// TestMetricsCannotBeGrownByCallers: unauthenticated requests with made-up
// methods and paths all land in one series (D11).
func TestMetricsCannotBeGrownByCallers(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	b := setupWith(t, options{server: func(c *server.Config) { c.Metrics = m }})
	for i := range 50 {
		b.outside(fmt.Sprintf("M%dETHOD", i), fmt.Sprintf("/nowhere/%d", i))
	}
	series := 0
	for _, l := range strings.Split(metricstest.Scrape(m), "\n") {
		if strings.HasPrefix(l, "gateway_http_requests_total{") {
			series++
			require.Contains(t, l, `method="other",route="other"`)
		}
	}
	require.Equal(t, 1, series)
}

// TestARequestInAnotherAPIsShapeIsNamed: a body that holds its text under
// Chat Completions' `messages` or the Responses API's `input`, with no
// prompt, is refused EMPTY_PROMPT as any empty prompt is, on every path,
// with a message that says where the text goes; nothing reaches the upstream.
func TestARequestInAnotherAPIsShapeIsNamed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	messages := []any{map[string]any{"role": "user", "content": "hi"}}
	const hint = `this API takes the text in "prompt", and does not read`

	r := b.post("/api/v1/chat", b.key, map[string]any{"model": "instant", "messages": messages})
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EEmptyPrompt, r.errorCode(t))
	require.Contains(t, r.message(t), hint+` "messages"`)

	r = b.post("/api/v1/responses", b.key, map[string]any{"input": "hi"})
	require.Equal(t, gateway.EEmptyPrompt, r.errorCode(t))
	require.Contains(t, r.message(t), hint+` "input"`)

	_, s := b.stream("/api/v1/responses", map[string]any{"messages": messages})
	require.Len(t, s.Events, 1)
	var env api.ErrorEnvelope
	s.Events[0].Decode(t, &env)
	require.Equal(t, "EMPTY_PROMPT", env.Error.Code)
	require.Contains(t, env.Error.Message, hint+` "messages"`, "a stream's refusal says so too")

	r = b.post("/api/v1/batch", b.key, map[string]any{"requests": []any{
		map[string]any{"prompt": "fine", "messages": messages},
		map[string]any{"input": []any{map[string]any{"role": "user", "content": "hi"}}},
	}})
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, gateway.EEmptyPrompt, r.errorCode(t))
	require.Equal(t, "1", r.header.Get("x-service-batch-index"), "a prompt beside messages is read; the item without one is named")
	require.Contains(t, r.message(t), `requests[1]: prompt must be a non-empty string: `+hint+` "input"`)

	// An empty prompt alone, or beside a null, is refused as before.
	for _, body := range []map[string]any{{"prompt": ""}, {"input": nil}} {
		r = b.post("/api/v1/responses", b.key, body)
		require.Equal(t, gateway.EEmptyPrompt, r.errorCode(t))
		require.Equal(t, "prompt must be a non-empty string", r.message(t))
	}
	require.Zero(t, b.upstream.callCount())
}
