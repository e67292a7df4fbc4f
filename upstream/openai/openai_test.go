package openai_test

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/fakeupstream"
	"github.com/rungworks/gateway/internal/lostpeer"
	"github.com/rungworks/gateway/internal/tcpproxy"
	"github.com/rungworks/gateway/upstream"
	"github.com/rungworks/gateway/upstream/openai"
)

type testBundle struct {
	fake   *fakeupstream.Server
	client *openai.Client
	h2c    bool
}

// eachTransport runs test against both ways calls are made: package http1
// for a plain HTTP/1.1 upstream, net/http's Transport for the others (here
// HTTP/2 without TLS).
func eachTransport(t *testing.T, test func(t *testing.T, b *testBundle)) {
	t.Helper()
	for _, h2c := range []bool{false, true} {
		t.Run(map[bool]string{false: "HTTP1", true: "H2C"}[h2c], func(t *testing.T) {
			t.Parallel()
			fake := fakeupstream.New()
			t.Cleanup(fake.Close)
			b := &testBundle{fake: fake, h2c: h2c}
			b.client = b.newClient(openai.Config{APIKey: "up-key", Timeout: 2 * time.Second})
			test(t, b)
		})
	}
}

// newClient returns a client over the bundle's transport, by default to its
// fake upstream.
func (b *testBundle) newClient(cfg openai.Config) *openai.Client {
	if cfg.BaseURL == "" {
		cfg.BaseURL = b.fake.BaseURL()
	}
	cfg.H2C = b.h2c
	return openai.New(cfg)
}

var req = upstream.Request{
	Model: gateway.ModelReasoning, UpstreamModel: "o3-mini", System: "Be brief.", Prompt: "why is the sky blue",
	MaxOutputTokens: 123, Hints: gateway.Hints{WebSearch: true, CodeMode: true},
}

func TestComplete(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		res, err := b.client.Complete(context.Background(), &req)
		require.NoError(t, err)
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		pt, ct := fakeupstream.Usage(req.Prompt)
		require.Equal(t, pt, res.InputTokens)
		require.Equal(t, ct, res.OutputTokens)
		require.Equal(t, []gateway.Source{{Title: "Example doc", URL: "https://example.org/doc", Snippet: "echo"}}, res.Sources)

		calls := b.fake.Calls()
		require.Len(t, calls, 1)
		require.Equal(t, "web_search,code_mode", calls[0].Header.Get("X-Gateway-Hints"))
		require.Equal(t, "Bearer up-key", calls[0].Header.Get("Authorization"))
		calls[0].At, calls[0].Header = time.Time{}, nil
		require.Equal(t, fakeupstream.Call{Model: "o3-mini", System: "Be brief.", Prompt: req.Prompt, MaxCompletionTokens: 123}, calls[0])
	})
}

// TestTheOutputLimitsField: a call carries its output limit in
// max_completion_tokens alone (OpenAI's reasoning models refuse max_tokens),
// or, to a server configured as knowing only the older name, in max_tokens
// alone.
func TestTheOutputLimitsField(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		_, err := b.client.Complete(context.Background(), &req)
		require.NoError(t, err)
		older := b.newClient(openai.Config{Timeout: 2 * time.Second, MaxTokensField: openai.MaxTokens})
		_, err = older.Complete(context.Background(), &req)
		require.NoError(t, err)
		_, err = older.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)

		calls := b.fake.Calls()
		require.Len(t, calls, 3)
		require.Equal(t, [2]uint64{123, 0}, [2]uint64{calls[0].MaxCompletionTokens, calls[0].MaxTokens})
		for _, c := range calls[1:] {
			require.Equal(t, [2]uint64{0, 123}, [2]uint64{c.MaxCompletionTokens, c.MaxTokens})
		}
	})
}

// TestABaseURLsQueryIsKept: calls go to the base URL's path with
// /chat/completions appended, its query kept, as Azure OpenAI's deployments
// take their api-version; a trailing slash changes nothing.
func TestABaseURLsQueryIsKept(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for _, base := range []string{b.fake.BaseURL() + "?api-version=2024-10-21", b.fake.BaseURL() + "/?api-version=2024-10-21"} {
			c := b.newClient(openai.Config{BaseURL: base, Timeout: 2 * time.Second})
			_, err := c.Complete(context.Background(), &req)
			require.NoError(t, err, base)
			_, err = c.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, base)
		}
		calls := b.fake.Calls()
		require.Len(t, calls, 4)
		for _, c := range calls {
			require.Equal(t, "api-version=2024-10-21", c.Query)
		}
	})
}

// TestStreamOptionsMayBeLeftOut: a stream's call asks for its usage in
// stream_options, unless its provider is set to leave it out (for servers
// that refuse it); its usage is then not reported, for the caller to count.
func TestStreamOptionsMayBeLeftOut(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		res, err := b.client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)
		require.True(t, res.UsageReported)
		without := b.newClient(openai.Config{Timeout: 2 * time.Second, NoStreamOptions: true})
		res, err = without.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)
		require.False(t, res.UsageReported)
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)

		calls := b.fake.Calls()
		require.Len(t, calls, 2)
		require.True(t, calls[0].StreamOptions)
		require.False(t, calls[1].StreamOptions)
	})
}

// TestTheKeysHeader: the key goes in Authorization as a bearer token, or
// as it is in the header its provider names (Azure OpenAI's api-key).
func TestTheKeysHeader(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		_, err := b.client.Complete(context.Background(), &req)
		require.NoError(t, err)
		named := b.newClient(openai.Config{APIKey: "up-key", APIKeyHeader: "api-key", Timeout: 2 * time.Second,
			Headers: map[string]string{"OpenAI-Project": "proj_1"}})
		_, err = named.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)

		calls := b.fake.Calls()
		require.Len(t, calls, 2)
		require.Equal(t, "Bearer up-key", calls[0].Header.Get("Authorization"))
		require.Empty(t, calls[0].Header.Get("api-key"))
		require.Empty(t, calls[1].Header.Get("Authorization"))
		require.Equal(t, "up-key", calls[1].Header.Get("api-key"))
		require.Equal(t, "proj_1", calls[1].Header.Get("OpenAI-Project"), "the configured headers")
	})
}

// TestACallSaysWhatItSendsAndAccepts: a call sends JSON and accepts, without
// a coding, JSON when asked for whole and events when streamed.
func TestACallSaysWhatItSendsAndAccepts(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		_, err := b.client.Complete(context.Background(), &req)
		require.NoError(t, err)
		_, err = b.client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)

		calls := b.fake.Calls()
		require.Len(t, calls, 2)
		for i, accept := range []string{"application/json", "text/event-stream"} {
			require.Equal(t, accept, calls[i].Header.Get("Accept"))
			require.Equal(t, "application/json", calls[i].Header.Get("Content-Type"))
			require.Equal(t, "identity", calls[i].Header.Get("Accept-Encoding"))
		}
	})
}

// TestCitationsCountCharacters: a citation's start and end index count
// characters, as OpenAI's API gives them, not bytes: its snippet is the
// text between them in content that is not ASCII too, up to the content's
// last character included. An index past the content's end, or before its
// start, gives no snippet, in content of either kind, and leaves the other
// citations' snippets as they are.
func TestCitationsCountCharacters(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		const content = "Voilà : le ciel est bleu. 東京 is Tokyo."
		chars := []rune(content)
		cite := func(snippet string) map[string]any {
			start := strings.Index(content, snippet)
			from := len([]rune(content[:start]))
			return map[string]any{"type": "url_citation", "url_citation": map[string]any{
				"url": "https://example.org/" + snippet, "title": snippet, "start_index": from, "end_index": from + len([]rune(snippet)),
			}}
		}
		span := func(title string, start, end int) map[string]any {
			return map[string]any{"type": "url_citation", "url_citation": map[string]any{
				"url": "https://example.org/" + title, "title": title, "start_index": start, "end_index": end,
			}}
		}
		complete := func(content string, annotations ...any) []gateway.Source {
			reply, err := json.Marshal(map[string]any{
				"choices": []any{map[string]any{"message": map[string]any{"content": content, "annotations": annotations}}},
				"usage":   map[string]any{"prompt_tokens": 1, "completion_tokens": 1},
			})
			require.NoError(t, err)
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = w.Write(reply) })
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err)
			return res.Sources
		}
		// A span that is not one of the content's characters is no snippet,
		// and changes none of the others.
		require.Equal(t, []gateway.Source{
			{Title: "le ciel est bleu", URL: "https://example.org/le ciel est bleu", Snippet: "le ciel est bleu"},
			{Title: "東京", URL: "https://example.org/東京", Snippet: "東京"},
			{Title: "Tokyo.", URL: "https://example.org/Tokyo.", Snippet: "Tokyo."},
			{Title: "past", URL: "https://example.org/past"},
			{Title: "before", URL: "https://example.org/before"},
		}, complete(content, cite("le ciel est bleu"), cite("東京"), cite("Tokyo."), span("past", len(chars)-2, len(chars)+1), span("before", -1, 3)))
		require.Equal(t, []gateway.Source{
			{Title: "sky", URL: "https://example.org/sky", Snippet: "sky"},
			{Title: "blue.", URL: "https://example.org/blue.", Snippet: "blue."},
			{Title: "past", URL: "https://example.org/past"},
			{Title: "before", URL: "https://example.org/before"},
		}, complete("The sky is blue.", span("sky", 4, 7), span("blue.", 11, 16), span("past", 12, 17), span("before", -1, 3)))
	})
}

// TestSearchResultsAreSources: the search results that Perplexity's API
// gives beside the choices are sources (a result without a title takes its
// URL), or, without them, its citations (URLs alone); in a stream, where
// they come in one event or repeated and grown in every event, each is
// taken once, as it first arrives, after that event's text.
func TestSearchResultsAreSources(t *testing.T) {
	t.Parallel()
	a := gateway.Source{Title: "A", URL: "https://a.example/", Snippet: "about a"}
	b2 := gateway.Source{Title: "https://b.example/", URL: "https://b.example/"}
	const results = `"citations":["https://a.example/","https://b.example/"],"search_results":[{"title":"A","url":"https://a.example/","snippet":"about a","date":"2025-01-01"},{"url":"https://b.example/"},{"title":"no url"}]`
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for reply, want := range map[string][]gateway.Source{
			`{"choices":[{"message":{"content":"Hi [1][2]"}}],` + results + `,"usage":{"prompt_tokens":1,"completion_tokens":3}}`: {a, b2},
			`{"choices":[{"message":{"content":"Hi [1]"}}],"citations":["https://b.example/",""]}`:                                {b2},
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = io.WriteString(w, reply) })
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err, reply)
			require.Equal(t, want, res.Sources, reply)
		}

		const first = `"citations":["https://a.example/"],"search_results":[{"title":"A","url":"https://a.example/","snippet":"about a"}]`
		for name, events := range map[string][]string{
			"repeated and grown": {
				`{"choices":[{"delta":{"content":"Hi "}}],` + first + `}`,
				`{"choices":[{"delta":{"content":"there"}}],` + first + `}`,
				`{"choices":[{"delta":{"content":"."},"finish_reason":"stop"}],` + results + `}`,
				`{"choices":[],` + results + `,"usage":{"prompt_tokens":1,"completion_tokens":3}}`,
			},
			"in the last event": {
				`{"choices":[{"delta":{"content":"Hi "}}]}`,
				`{"choices":[{"delta":{"content":"there."},"finish_reason":"stop"}],` + results + `}`,
			},
		} {
			client := b.eventsClient(t, events)
			var emitted []upstream.Delta
			res, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error { emitted = append(emitted, d); return nil })
			require.NoError(t, err, name)
			require.Equal(t, "Hi there.", res.Content, name)
			require.Equal(t, []gateway.Source{a, b2}, res.Sources, name)
			var sources []gateway.Source
			for _, d := range emitted {
				sources = append(sources, d.Sources...)
			}
			require.Equal(t, res.Sources, sources, name)
			if name == "repeated and grown" {
				require.Equal(t, []upstream.Delta{{Content: "Hi "}, {Sources: []gateway.Source{a}}, {Content: "there"}, {Content: "."}, {Sources: []gateway.Source{b2}}}, emitted)
			}
		}
		client := b.eventsClient(t, []string{
			`{"choices":[{"delta":{"content":"Hi "}}],"citations":["https://a.example/"]}`,
			`{"choices":[{"delta":{"content":"there."},"finish_reason":"stop"}],"citations":["https://a.example/","https://b.example/"]}`,
		})
		res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err)
		require.Equal(t, []gateway.Source{{Title: "https://a.example/", URL: "https://a.example/"}, b2}, res.Sources, "citations alone, repeated and grown")
	})
}

// TestEvidenceOfOtherShapesFailsNothing: citations given as objects with a
// url and a source's name (as tale's agents give them, a RAG citation
// beside a web one) are sources; evidence of a shape the gateway does not
// read (a list that is no list, an element of other types, an annotation
// whose indices are not numbers) is left out, and the reply, whole or
// streamed, is taken with the sources it names well.
func TestEvidenceOfOtherShapesFailsNothing(t *testing.T) {
	t.Parallel()
	web := gateway.Source{Title: "Example Page", URL: "https://example.com"}
	ok := gateway.Source{Title: "ok", URL: "https://ok.example/"}
	const tale = `"citations":[{"index":1,"type":"rag","source":"report.pdf","fileId":"doc-123","page":42,"relevance":0.87},` +
		`{"index":2,"type":"web","source":"Example Page","url":"https://example.com","relevance":0.72}]`
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for name, c := range map[string]struct {
			fields string // beside the choices
			notes  string // the message's or delta's annotations
			want   []gateway.Source
		}{
			"citations as objects":            {fields: tale, want: []gateway.Source{web}},
			"citations of other types":        {fields: `"citations":[1,null,{"url":7},["x"],"https://ok.example/"]`, want: []gateway.Source{{Title: "https://ok.example/", URL: "https://ok.example/"}}},
			"citations that are no list":      {fields: `"citations":"https://ok.example/"`},
			"search results that are no list": {fields: `"search_results":{"url":"https://ok.example/"}`},
			"search results of other types":   {fields: `"search_results":[{"title":1,"url":"https://bad.example/"},{"title":"ok","url":"https://ok.example/"}]`, want: []gateway.Source{ok}},
			"annotations that are no list":    {notes: `{"type":"url_citation"}`},
			"annotations of other types": {
				notes: `[{"type":"url_citation","url_citation":{"url":"https://bad.example/","title":"bad","start_index":"0","end_index":2}},` +
					`{"type":"url_citation","url_citation":{"url":"https://ok.example/","title":"ok"}},7,` +
					`{"type":"file_citation","url_citation":{"url":"https://typed.example/","title":"another type"}},` +
					`{"type":"url_citation","url_citation":{"url":"","title":"no address"}}]`,
				want: []gateway.Source{ok},
			},
		} {
			fields, notes := c.fields, ""
			if fields != "" {
				fields = "," + fields
			}
			if c.notes != "" {
				notes = `,"annotations":` + c.notes
			}
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"Hi [2]"`+notes+`}}]`+fields+`}`)
			})
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err, name)
			require.Equal(t, "Hi [2]", res.Content, name)
			require.Equal(t, c.want, res.Sources, name)

			client = b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `data: {"choices":[{"delta":{"content":"Hi [2]"`+notes+`},"finish_reason":"stop"}]}`+"\n\n")
				if fields != "" { // as tale sends them: an event of their own
					_, _ = io.WriteString(w, "data: {"+fields[1:]+"}\n\n")
				}
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
			})
			res, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, name)
			require.Equal(t, "Hi [2]", res.Content, name)
			require.Equal(t, c.want, res.Sources, name)
		}
	})
}

func TestUnavailable(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetMode(fakeupstream.Down)
		_, err := b.client.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrUnavailable)
	})
}

// TestStatusClasses pins D12: only 429 and 503, and the refusals of the
// gateway's own access (401, 407, 404), say the call was not processed.
func TestStatusClasses(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for status, want := range map[int]error{
			429: upstream.ErrUnavailable, 503: upstream.ErrUnavailable,
			401: upstream.ErrDenied, 407: upstream.ErrDenied, 404: upstream.ErrDenied,
			500: upstream.ErrFailed, 502: upstream.ErrFailed, 504: upstream.ErrFailed, 408: upstream.ErrFailed,
		} {
			b.fake.SetStatus(status)
			_, err := b.client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, want, "status %d", status)
			// A 429 is told apart: one request alone can get it.
			require.Equal(t, status == 429, errors.Is(err, upstream.ErrRateLimited), "status %d", status)
			_, _, err = collect(t, b.client, context.Background())
			require.ErrorIs(t, err, want, "stream, status %d", status)
			require.Equal(t, status == 429, errors.Is(err, upstream.ErrRateLimited), "stream, status %d", status)
		}
	})
}

// TestDeniedIsAnOutage: a refusal of the gateway's key is handled as an
// outage (the call was not processed), of its own kind, and neither a
// rejection of the request nor a failure after dispatch; so is OpenAI's 429
// that says the gateway's account is out of credit (insufficient_quota),
// not as a rate limit one request may have caused, while a 429 of another
// code, or of a code that is not a string, stays a rate limit.
func TestDeniedIsAnOutage(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetStatus(http.StatusUnauthorized)
		_, err := b.client.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrUnavailable)
		require.Equal(t, upstream.KindDenied, upstream.Kind(err))
		var rejected *upstream.RejectedError
		require.NotErrorAs(t, err, &rejected)
		require.NotErrorIs(t, err, upstream.ErrFailed)

		for body, denied := range map[string]bool{
			`{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}`: true,
			`{"error":{"message":"Rate limit reached for requests","type":"requests","param":null,"code":"rate_limit_exceeded"}}`:                                                       false,
			`{"error":{"message":"slow down","code":429}}`: false,
		} {
			client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusTooManyRequests)
				_, _ = io.WriteString(w, body)
			})
			_, err = client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, upstream.ErrUnavailable, body)
			require.Equal(t, denied, upstream.Kind(err) == upstream.KindDenied, body)
			require.Equal(t, !denied, errors.Is(err, upstream.ErrRateLimited), body)
			if denied {
				require.ErrorContains(t, err, "status 429 (insufficient_quota): You exceeded your current quota")
			} else {
				require.NotContains(t, err.Error(), `{"error"`, "the message, not the body")
			}
		}

		// 402 and 403 may refuse one request (credits for its size, a
		// moderation flag): they stay the request's rejection.
		for _, status := range []int{http.StatusPaymentRequired, http.StatusForbidden} {
			b.fake.SetStatus(status)
			_, err = b.client.Complete(context.Background(), &req)
			require.ErrorAs(t, err, &rejected, "status %d", status)
			require.Equal(t, upstream.KindRejected, upstream.Kind(err))
		}
	})
}

// TestRedirectsAreNotFollowed: over either transport, no redirect is
// followed, so the prompt and the gateway's headers reach no other address.
// 301, 307 and 308 say the API has moved: a refusal of the gateway's base
// URL (not processed), whose message names where it points. Any other 3xx
// may answer a POST that was processed: failed after dispatch.
func TestRedirectsAreNotFollowed(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		elsewhere := fakeupstream.New()
		t.Cleanup(elsewhere.Close)
		location := elsewhere.BaseURL() + "/chat/completions"
		b.fake.SetReplyHeader("Location", location)
		statuses := map[int]string{
			301: upstream.KindDenied, 307: upstream.KindDenied, 308: upstream.KindDenied,
			300: upstream.KindFailed, 302: upstream.KindFailed, 303: upstream.KindFailed,
		}
		for status, want := range statuses {
			b.fake.SetStatus(status)
			_, err := b.client.Complete(context.Background(), &req)
			require.Equal(t, want, upstream.Kind(err), "status %d: %v", status, err)
			_, _, streamErr := collect(t, b.client, context.Background())
			require.Equal(t, want, upstream.Kind(streamErr), "stream, status %d: %v", status, streamErr)
			if want == upstream.KindDenied {
				require.ErrorContains(t, err, location)
				require.ErrorContains(t, streamErr, location)
			}
		}
		require.Zero(t, elsewhere.Connections(), "no call followed a redirect")
		require.Len(t, b.fake.Calls(), 2*len(statuses))
	})
}

// TestRepliesAreAskedUncompressed: both transports ask for an uncompressed
// reply, for a call and a stream (a compressing layer may hold a stream's
// events until its buffer fills). A reply compressed with gzip all the same
// (a CDN in front of the upstream may ignore identity) is read inflated, a
// stream's events as they come, and so is an error's body; one in another
// coding, or not the gzip it says, fails saying so, after dispatch, rather
// than as bytes that do not parse, but its status is read all the same.
func TestRepliesAreAskedUncompressed(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		var mu sync.Mutex
		var asked []string
		client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			asked = append(asked, r.Header.Get("Accept-Encoding"))
			mu.Unlock()
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`))
		})
		_, err := client.Complete(context.Background(), &req)
		require.NoError(t, err)
		_, _, _ = collect(t, client, context.Background())
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, []string{"identity", "identity"}, asked, "Accept-Encoding of a call and of a stream")

		// A stream's second event waits for its first to reach the caller
		// (seen closed).
		compressing := func(coding string, seen <-chan struct{}) *openai.Client {
			return b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				var call struct{ Stream bool }
				_ = json.NewDecoder(r.Body).Decode(&call)
				w.Header().Set("Content-Encoding", coding)
				zw := gzip.NewWriter(w)
				defer zw.Close()
				if !call.Stream {
					w.Header().Set("Content-Type", "application/json")
					_, _ = zw.Write([]byte(`{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`))
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				for i, e := range []string{`{"choices":[{"delta":{"content":"o"}}]}`, `{"choices":[{"delta":{"content":"k"},"finish_reason":"stop"}]}`, "[DONE]"} {
					_, _ = io.WriteString(zw, "data: "+e+"\n\n")
					_ = zw.Flush()
					w.(http.Flusher).Flush()
					if i == 0 {
						select {
						case <-seen:
						case <-r.Context().Done():
							return
						}
					}
				}
			})
		}
		for _, coding := range []string{"gzip", "X-GZIP"} {
			res, err := compressing(coding, nil).Complete(context.Background(), &req)
			require.NoError(t, err, coding)
			require.Equal(t, "ok", res.Content, coding)
			seen := make(chan struct{})
			var once sync.Once
			res, err = compressing(coding, seen).Stream(context.Background(), &req, func(upstream.Delta) error {
				once.Do(func() { close(seen) })
				return nil
			})
			require.NoError(t, err, coding)
			require.Equal(t, "ok", res.Content, coding, "the first event was read before the second was sent")
		}

		identity := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Encoding", " Identity")
			_, _ = w.Write([]byte(`{"choices":[{"message":{"content":"ok"}}]}`))
		})
		res, err := identity.Complete(context.Background(), &req)
		require.NoError(t, err, "a reply labelled uncompressed")
		require.Equal(t, "ok", res.Content)

		_, err = compressing("br", nil).Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.ErrorContains(t, err, `Content-Encoding "br"`)
		_, _, err = collect(t, compressing("br", nil), context.Background())
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.ErrorContains(t, err, `Content-Encoding "br"`)

		refusing := func(status int, coding string) *openai.Client {
			return b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Encoding", coding)
				w.WriteHeader(status)
				zw := gzip.NewWriter(w)
				_, _ = io.WriteString(zw, `{"error":{"message":"the prompt is refused"}}`)
				_ = zw.Close()
			})
		}
		_, err = refusing(http.StatusBadRequest, "gzip").Complete(context.Background(), &req)
		require.ErrorContains(t, err, "the prompt is refused", "an error's body is read inflated too")
		_, err = refusing(http.StatusServiceUnavailable, "br").Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrUnavailable, "a status is read whatever the coding")

		empty := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Encoding", "gzip")
		})
		_, err = empty.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.ErrorContains(t, err, "the body is empty", "an empty body is empty, whatever its coding")
		_, _, err = collect(t, empty, context.Background())
		require.ErrorIs(t, err, upstream.ErrStreamBroken)
		require.ErrorContains(t, err, "the body is empty")

		notGzip := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"ok"}}]}`)
		})
		_, err = notGzip.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.ErrorContains(t, err, "not the gzip its Content-Encoding says")
		_, _, err = collect(t, notGzip, context.Background())
		require.ErrorIs(t, err, upstream.ErrStreamBroken)
		require.ErrorContains(t, err, "not the gzip its Content-Encoding says")
	})
}

// TestRetryAfter: a busy upstream's wait is read from its reply, bounded,
// on both paths; other failures carry none.
func TestRetryAfter(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		wait := func(status int, header, value string) (time.Duration, time.Duration) {
			b.fake.SetStatus(status)
			b.fake.SetReplyHeader(header, value)
			defer b.fake.SetReplyHeader(header, "")
			_, err := b.client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, upstream.ErrUnavailable)
			_, _, streamErr := collect(t, b.client, context.Background())
			return upstream.RetryAfter(err), upstream.RetryAfter(streamErr)
		}
		for _, tc := range []struct {
			status        int
			header, value string
			want          time.Duration
		}{
			{429, "Retry-After", "7", 7 * time.Second},
			{503, "Retry-After", " 2 ", 2 * time.Second},
			{429, "Retry-After-Ms", "1500", 1500 * time.Millisecond},
			{429, "Retry-After", "99999999999999999", upstream.MaxRetryAfter},
			{429, "Retry-After-Ms", "1e300", upstream.MaxRetryAfter},
			{429, "Retry-After", "-3", 0},
			{429, "Retry-After", "soon", 0},
			{429, "Retry-After-Ms", "NaN", 0},
			{429, "Retry-After-Ms", "0", 0},
			{429, "Retry-After", "", 0},
			{401, "Retry-After", "7", 0},
		} {
			complete, stream := wait(tc.status, tc.header, tc.value)
			require.Equal(t, tc.want, complete, "%d %s: %q", tc.status, tc.header, tc.value)
			require.Equal(t, tc.want, stream, "stream, %d %s: %q", tc.status, tc.header, tc.value)
		}

		// A retry-after-ms that asks for no wait leaves it to Retry-After.
		b.fake.SetReplyHeader("Retry-After-Ms", "-5")
		complete, stream := wait(503, "Retry-After", "4")
		require.Equal(t, []time.Duration{4 * time.Second, 4 * time.Second}, []time.Duration{complete, stream})
		b.fake.SetReplyHeader("Retry-After-Ms", "")

		// An HTTP date: the time left until it.
		complete, _ = wait(429, "Retry-After", time.Now().Add(30*time.Second).UTC().Format(http.TimeFormat))
		require.InDelta(t, 30*time.Second, complete, float64(2*time.Second))

		// A 500 asks no wait, whatever its header: it is no outage.
		b.fake.SetStatus(http.StatusInternalServerError)
		b.fake.SetReplyHeader("Retry-After", "7")
		_, err := b.client.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.Zero(t, upstream.RetryAfter(err))
	})
}

// TestIdleConnectionsLastAsLongAsTheUpstreamKeepsThem: a connection waits for
// the next call no longer than IdleTimeout, on both transports, and, over
// HTTP/1.1, no longer than the upstream announces it keeps it.
func TestIdleConnectionsLastAsLongAsTheUpstreamKeepsThem(t *testing.T) {
	t.Parallel()
	completeTwice := func(t *testing.T, c *openai.Client, idle time.Duration) {
		t.Helper()
		for i := range 2 {
			if i > 0 {
				time.Sleep(idle)
			}
			_, err := c.Complete(context.Background(), &req)
			require.NoError(t, err)
		}
	}
	eachTransport(t, func(t *testing.T, b *testBundle) {
		completeTwice(t, b.client, 0)
		// Over h2c, net/http may dial for the second call before the first
		// call's connection is back in its pool (on a busy machine); its
		// HTTP/2 pool then closes the new connection unused, and the call
		// goes on the first. So is one connection kept, dialed again or not.
		require.Eventually(t, func() bool { return b.fake.OpenConnections() == 1 }, 5*time.Second, time.Millisecond,
			"a connection is kept for the next call")
		dialed := b.fake.Connections()
		if !b.h2c {
			require.Equal(t, 1, dialed, "over HTTP/1.1 the second call takes the first's connection back")
		}
		short := b.newClient(openai.Config{Timeout: 2 * time.Second, IdleTimeout: 50 * time.Millisecond})
		completeTwice(t, short, 300*time.Millisecond)
		require.Equal(t, dialed+2, b.fake.Connections(), "a connection idle past IdleTimeout is not used")
		if b.h2c {
			return
		}
		// An upstream that keeps idle connections a second: within the
		// margin, so none is used again.
		b.fake.SetReplyHeader("Keep-Alive", "timeout=1")
		completeTwice(t, b.newClient(openai.Config{Timeout: 2 * time.Second}), 0)
		require.Equal(t, 5, b.fake.Connections(), "a connection the upstream may be closing is not used")
		b.fake.SetReplyHeader("Keep-Alive", "timeout=30")
		completeTwice(t, b.newClient(openai.Config{Timeout: 2 * time.Second, IdleTimeout: 50 * time.Millisecond}), 300*time.Millisecond)
		require.Equal(t, 6, b.fake.Connections(), "what the upstream announces sets how long a connection is kept")
	})
}

// TestALostHTTP2ConnectionIsClosed loses an HTTP/2 connection in the
// network (the proxy drops what either end sends; neither learns of a
// close): once a ping goes unanswered the connection is closed, the call
// that waited on it fails after dispatch (the upstream had it), and the next
// call goes on a new connection. Without the ping, each waits for its
// timeout on the lost connection, the next call too.
func TestALostHTTP2ConnectionIsClosed(t *testing.T) {
	t.Parallel()
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	proxy, err := tcpproxy.Start(fake.Listener.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	client := openai.New(openai.Config{BaseURL: "http://" + proxy.Addr() + "/v1", H2C: true, Timeout: time.Minute, PingAfter: 100 * time.Millisecond})
	_, err = client.Complete(context.Background(), &req)
	require.NoError(t, err)

	fake.SetDelay(2 * time.Second) // its reply is sent after the loss, and lost
	waiting := make(chan error, 1)
	go func() {
		_, err := client.Complete(context.Background(), &req)
		waiting <- err
	}()
	require.Eventually(t, func() bool { return len(fake.Calls()) == 2 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, proxy.Cut())
	fake.SetDelay(0)
	err = <-waiting
	require.ErrorIs(t, err, upstream.ErrFailed, "the upstream may have processed it")
	require.ErrorContains(t, err, "connection lost", "not its timeout")

	_, err = client.Complete(context.Background(), &req)
	require.NoError(t, err, "the next call goes on a new connection")
	require.Equal(t, 2, fake.Connections())
}

// TestConnectionsOverNetHTTPFindALostUpstream checks how a connection made
// by net/http's transport is set up (see lostpeer; package http1 checks its
// own).
func TestConnectionsOverNetHTTPFindALostUpstream(t *testing.T) {
	t.Parallel()
	fake := fakeupstream.New()
	t.Cleanup(fake.Close)
	client := openai.New(openai.Config{BaseURL: fake.BaseURL(), H2C: true, Timeout: 5 * time.Second})
	conns := make(chan net.Conn, 1)
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { conns <- info.Conn }})
	_, err := client.Complete(ctx, &req)
	require.NoError(t, err)
	err = lostpeer.Check(<-conns)
	if errors.Is(err, errors.ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, err)
}

func TestDispatchIsReported(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		var dispatched int
		r := req
		r.OnDispatch = func() { dispatched++ }
		_, err := b.client.Complete(context.Background(), &r)
		require.NoError(t, err)
		require.Equal(t, 1, dispatched)
	})
}

func TestRejected(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetMode(fakeupstream.Reject)
		_, err := b.client.Complete(context.Background(), &req)
		var rejected *upstream.RejectedError
		require.ErrorAs(t, err, &rejected)
		require.Equal(t, 400, rejected.Status)
		require.Equal(t, "content policy violation", rejected.Message)
		require.NotErrorIs(t, err, upstream.ErrUnavailable)
	})
}

func TestConnectionRefusedIsUnavailable(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := l.Addr().String()
		require.NoError(t, l.Close())
		client := b.newClient(openai.Config{BaseURL: "http://" + addr + "/v1"})
		r := req
		r.OnDispatch = func() { t.Error("a refused connection was reported dispatched") }
		_, err = client.Complete(context.Background(), &r)
		require.ErrorIs(t, err, upstream.ErrUnavailable)
		_, err = client.Stream(context.Background(), &r, func(upstream.Delta) error { return nil })
		require.ErrorIs(t, err, upstream.ErrUnavailable)
	})
}

// TestAConnectionNotMadeInTimeIsUnavailable: a call whose connection is not
// made by its Timeout (here a TLS handshake its upstream never answers) was
// never sent: it is unavailable, safe to send elsewhere (D12).
func TestAConnectionNotMadeInTimeIsUnavailable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0") // the kernel accepts; no one answers
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	client := openai.New(openai.Config{BaseURL: "https://" + l.Addr().String() + "/v1", Timeout: 100 * time.Millisecond})
	r := req
	r.OnDispatch = func() { t.Error("a call never connected was reported dispatched") }
	_, err = client.Complete(context.Background(), &r)
	require.ErrorIs(t, err, upstream.ErrUnavailable)
	require.ErrorContains(t, err, "100ms", "ended by its Timeout")
	_, err = client.Stream(context.Background(), &r, func(upstream.Delta) error { return nil })
	require.ErrorIs(t, err, upstream.ErrUnavailable)
}

// TestTimeoutAfterDispatchIsFailed: the upstream got the call and may process
// it, so it must never be retried (D12), whether the client's timeout or
// the caller's deadline ended it.
func TestTimeoutAfterDispatchIsFailed(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetDelay(time.Second)
		client := b.newClient(openai.Config{Timeout: 50 * time.Millisecond})
		_, err := client.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
		require.NotErrorIs(t, err, upstream.ErrUnavailable)
		_, _, err = collect(t, client, context.Background())
		require.ErrorIs(t, err, upstream.ErrFailed)

		for _, call := range []func(context.Context) error{
			func(ctx context.Context) error { _, err := b.client.Complete(ctx, &req); return err },
			func(ctx context.Context) error { _, _, err := collect(t, b.client, ctx); return err },
		} {
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			err := call(ctx)
			cancel()
			require.ErrorIs(t, err, upstream.ErrFailed, "the caller's deadline passed after dispatch")
		}
	})
}

func TestCallerCancellationIsNotAnOutage(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetDelay(time.Second)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(20*time.Millisecond, cancel)
		_, err := b.client.Complete(ctx, &req)
		require.True(t, errors.Is(err, context.Canceled), "got %v", err)
		require.NotErrorIs(t, err, upstream.ErrUnavailable)
	})
}

func collect(t *testing.T, client *openai.Client, ctx context.Context) ([]upstream.Delta, upstream.Result, error) {
	t.Helper()
	var deltas []upstream.Delta
	res, err := client.Stream(ctx, &req, func(d upstream.Delta) error {
		deltas = append(deltas, d)
		return nil
	})
	return deltas, res, err
}

func TestStream(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		deltas, res, err := collect(t, b.client, context.Background())
		require.NoError(t, err)
		pieces := fakeupstream.StreamPieces(req.Prompt)
		require.Len(t, deltas, len(pieces)+1, "one delta per piece plus the evidence; role-only deltas are skipped")
		for i, p := range pieces {
			require.Equal(t, p, deltas[i].Content)
		}
		require.Equal(t, []gateway.Source{{Title: "Example doc", URL: "https://example.org/doc"}}, deltas[len(pieces)].Sources)
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.True(t, res.UsageReported)
		pt, ct := fakeupstream.Usage(req.Prompt)
		require.Equal(t, pt, res.InputTokens)
		require.Equal(t, ct, res.OutputTokens)
		require.Len(t, res.Sources, 1)
	})
}

// TestAStreamAnsweredWholeIsTaken: an upstream that does not stream answers
// a stream's call with one JSON completion; its text and sources reach the
// caller as one delta, and its usage is the result's. A JSON reply that is
// not a completion, or longer than a reply to the request may be, breaks
// the stream.
func TestAStreamAnsweredWholeIsTaken(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetNoStreaming(true)
		deltas, res, err := collect(t, b.client, context.Background())
		require.NoError(t, err)
		require.Equal(t, []upstream.Delta{{
			Content: fakeupstream.Reply(req.Prompt),
			Sources: []gateway.Source{{Title: "Example doc", URL: "https://example.org/doc", Snippet: fakeupstream.Reply(req.Prompt)[:4]}},
		}}, deltas)
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.True(t, res.UsageReported)
		pt, ct := fakeupstream.Usage(req.Prompt)
		require.Equal(t, pt, res.InputTokens)
		require.Equal(t, ct, res.OutputTokens)

		for name, reply := range map[string]string{
			"not a completion":           `{"choices":[]}`,
			"longer than a reply may be": `{"choices":[{"message":{"content":"` + strings.Repeat("x", 8<<20) + `"}}]}`,
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = io.WriteString(w, reply) })
			var deltas []upstream.Delta
			_, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error { deltas = append(deltas, d); return nil })
			require.ErrorIs(t, err, upstream.ErrStreamBroken, name)
			require.NotErrorIs(t, err, upstream.ErrFailed, name)
			require.Empty(t, deltas, name)
		}
	})
}

// TestRepliesAreReadByWhatTheyHold: a reply's framing is read from its body,
// not from its Content-Type. An upstream that labels its streams
// application/json streams all the same, its completions labelled
// text/event-stream are taken whole, and one that streams a reply asked for
// whole is read to its [DONE] (its usage counted by the caller when it sent
// none); a completion that a proxy followed with an event stream's end
// (data: [DONE]) is taken. A reply that is none of these fails after
// dispatch, its error saying, of a body empty or without a data: line, so
// and how it begins.
func TestRepliesAreReadByWhatTheyHold(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		pt, ct := fakeupstream.Usage(req.Prompt)
		b.fake.SetMislabelled(true)
		res, err := b.client.Complete(context.Background(), &req)
		require.NoError(t, err, "a completion labelled text/event-stream")
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.True(t, res.UsageReported)
		require.Equal(t, [2]uint64{pt, ct}, [2]uint64{res.InputTokens, res.OutputTokens})

		deltas, res, err := collect(t, b.client, context.Background())
		require.NoError(t, err, "a stream labelled application/json")
		require.Len(t, deltas, len(fakeupstream.StreamPieces(req.Prompt))+1, "a delta a piece, and the evidence")
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.Equal(t, [2]uint64{pt, ct}, [2]uint64{res.InputTokens, res.OutputTokens})

		b.fake.SetMislabelled(false)
		b.fake.SetAlwaysStreaming(true)
		res, err = b.client.Complete(context.Background(), &req)
		require.NoError(t, err, "a reply asked for whole, streamed")
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.Equal(t, []gateway.Source{{Title: "Example doc", URL: "https://example.org/doc"}}, res.Sources)
		require.False(t, res.UsageReported, "no usage was asked for in a stream, and none came")

		completion := `{"choices":[{"message":{"content":"whole"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`
		for name, c := range map[string]struct {
			label, body string
			err         error  // of Complete; Stream's is ErrStreamBroken
			says        string // both errors, for the log
		}{
			"a completion after blank lines":       {"text/event-stream", "\r\n\n  " + completion + "\n", nil, ""},
			"a completion, unlabelled":             {"", completion, nil, ""},
			"a stream with usage, as JSON":         {"application/json", "data: {\"choices\":[{\"delta\":{\"content\":\"whole\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", nil, ""},
			"a stream cut before [DONE]":           {"application/json", "data: {\"choices\":[{\"delta\":{\"content\":\"whole\"}}]}\n\n", upstream.ErrFailed, "connection closed before [DONE] or a finish_reason"},
			"a page of HTML":                       {"text/html", "\n<html>bad gateway</html>\n", upstream.ErrFailed, `no events (no data: line); it begins "<html>bad gateway</html>"`},
			"a page of many lines":                 {"text/html", strings.Repeat("<p>blocked by policy</p>\n", 200), upstream.ErrFailed, `it begins "<p>blocked by policy</p>"`},
			"an empty body":                        {"application/json", "", upstream.ErrFailed, "the body is empty"},
			"a JSON object after a comment":        {"text/event-stream", ": hi\n" + completion, upstream.ErrFailed, ""},
			"a completion, then [DONE]":            {"text/event-stream", completion + "data: [DONE]\n\n", nil, ""},
			"a completion with trailing data":      {"application/json", completion + "data: [DONE] and more", upstream.ErrFailed, ""},
			"two completions, then [DONE]":         {"application/json", completion + "\n" + completion + "\ndata: [DONE]", upstream.ErrFailed, ""},
			"a completion after a byte order mark": {"application/json", "\uFEFF" + completion, nil, ""},
			"a stream after a byte order mark":     {"text/event-stream", "\uFEFFdata: {\"choices\":[{\"delta\":{\"content\":\"whole\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", nil, ""},
		} {
			client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header()["Content-Type"] = []string{c.label}
				_, _ = io.WriteString(w, c.body)
			})
			res, err := client.Complete(context.Background(), &req)
			var deltas []upstream.Delta
			streamed, streamErr := client.Stream(context.Background(), &req, func(d upstream.Delta) error { deltas = append(deltas, d); return nil })
			if c.err != nil {
				require.ErrorIs(t, err, c.err, name)
				require.ErrorIs(t, streamErr, upstream.ErrStreamBroken, name)
				require.ErrorContains(t, err, c.says, name)
				require.ErrorContains(t, streamErr, c.says, name)
				continue
			}
			require.NoError(t, err, name)
			require.NoError(t, streamErr, name)
			require.Equal(t, "whole", res.Content, name)
			require.Equal(t, [2]uint64{3, 1}, [2]uint64{res.InputTokens, res.OutputTokens}, name)
			require.Equal(t, res, streamed, name)
			require.Equal(t, []upstream.Delta{{Content: "whole"}}, deltas, name)
		}
	})
}

// TestAReplyStreamedWholeEnds: a reply asked for whole and streamed, its
// connection then kept open, is taken at its [DONE], or at the end of its
// ending once its finish_reason and usage came, not waited on until the
// call's timeout, when it would fail; one whose stream stops before its
// finish_reason and usage came fails at the timeout, after dispatch. A
// [DONE] inside an event that is spread over lines does not end it.
func TestAReplyStreamedWholeEnds(t *testing.T) {
	t.Parallel()
	const (
		text   = `data: {"choices":[{"delta":{"content":"whole"}}]}` + "\n\n"
		finish = `data: {"choices":[{"delta":{},"finish_reason":"stop"}]}` + "\n\n"
		usage  = `data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}` + "\n\n"
	)
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for name, c := range map[string]struct {
			body  string
			whole bool
		}{
			"[DONE]":                         {text + finish + usage + "data: [DONE]\n\n", true},
			"[DONE] without a space":         {text + finish + usage + "data:[DONE]\r\n\r\n", true},
			"[DONE] after a byte order mark": {"\uFEFF" + text + finish + usage + "data: [DONE]\n\n", true},
			"finished, no [DONE]":            {text + finish + usage, true},
			"no usage, no [DONE]":            {text + finish, false},
			"no finish_reason, no [DONE]":    {text + usage, false},
			"[DONE] in a spread event":       {text + "data: {\"choices\":\ndata: [DONE]\n", false},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				url := b.serve(t, func(w http.ResponseWriter, r *http.Request) {
					_, _ = io.Copy(io.Discard, r.Body)
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, c.body)
					w.(http.Flusher).Flush()
					<-r.Context().Done() // open until the gateway leaves
				})
				client := b.newClient(openai.Config{BaseURL: url, Timeout: time.Second})
				res, err := client.Complete(context.Background(), &req)
				if !c.whole {
					require.ErrorIs(t, err, upstream.ErrFailed)
					require.ErrorContains(t, err, "the call took longer than its limit of 1s")
					return
				}
				require.NoError(t, err)
				require.Equal(t, "whole", res.Content)
				require.Equal(t, [2]uint64{3, 1}, [2]uint64{res.InputTokens, res.OutputTokens})
			})
		}
	})
}

// TestACompletionWithoutUsageIsTaken: a completion from an upstream that
// reports no usage is taken, for the caller to count (UsageReported false),
// as a stream without usage is; a body without a message fails after
// dispatch, usage or not.
func TestACompletionWithoutUsageIsTaken(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for reply, want := range map[string]error{
			`{"choices":[{"message":{"content":"counted"}}]}`:                        nil,
			`{"choices":[{"message":{"content":null}}],"usage":{"prompt_tokens":1}}`: nil,
			`{"choices":[{}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`:     upstream.ErrFailed,
			`{"choices":[null]}`:                 upstream.ErrFailed,
			`{"error":{"message":"overloaded"}}`: upstream.ErrFailed,
			`{"choices":[{"text":"a legacy completion"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`: upstream.ErrFailed,
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = io.WriteString(w, reply) })
			res, err := client.Complete(context.Background(), &req)
			if want != nil {
				require.ErrorIs(t, err, want, reply)
				if strings.Contains(reply, "overloaded") {
					require.ErrorContains(t, err, "answered 200 with an error: overloaded", "the upstream's message, for the log")
				}
				continue
			}
			require.NoError(t, err, reply)
			require.Equal(t, strings.Contains(reply, "usage"), res.UsageReported, reply)
			require.Equal(t, map[bool]string{true: "", false: "counted"}[res.UsageReported], res.Content, reply)
		}
	})
}

// TestTokenCountsAreReadAsTheyCome: a usage count is read whatever number
// an upstream writes it as: a fraction (a server's estimate, a proxy's
// count weighed by cost) rounded up, an exponent, a number in a string; a
// count past uint64 as the most it holds (the metering clamps it); a count
// that is no count (negative, another type, null) as 0, which the metering
// counts with the tokenizer. None of them fails the reply it comes in, whole
// or streamed, as one that json refused to decode into an integer did.
func TestTokenCountsAreReadAsTheyCome(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for count, want := range map[string]uint64{
			`12`:                   12,
			`2.25`:                 3,
			`14417.92`:             14418,
			`7.0`:                  7,
			`1e3`:                  1000,
			`"12"`:                 12,
			`"2.5"`:                3,
			`18446744073709551616`: math.MaxUint64,
			`1e400`:                math.MaxUint64,
			`-1`:                   0,
			`-0.5`:                 0,
			`true`:                 0,
			`"twelve"`:             0,
			`"NaN"`:                0,
			`{"tokens":12}`:        0,
			`[12]`:                 0,
			`null`:                 0,
			`0.0000001`:            1,
			`18446744073709551615`: math.MaxUint64,
		} {
			usage := `"usage":{"prompt_tokens":` + count + `,"completion_tokens":` + count + `}`
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"counted"}}],`+usage+`}`)
			})
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err, count)
			require.True(t, res.UsageReported, count)
			require.Equal(t, [2]uint64{want, want}, [2]uint64{res.InputTokens, res.OutputTokens}, count)

			client = b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `data: {"choices":[{"delta":{"content":"counted"},"finish_reason":"stop"}]}`+"\n\n"+
					`data: {"choices":[],`+usage+`}`+"\n\ndata: [DONE]\n\n")
			})
			res, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, count)
			require.Equal(t, "counted", res.Content, count)
			require.Equal(t, [2]uint64{want, want}, [2]uint64{res.InputTokens, res.OutputTokens}, count)
		}
	})
}

// TestUsageOfOtherConventions: OpenAI's completion_tokens hold the reasoning
// tokens its details break out; xAI's API counts them on top, its
// total_tokens their sum with the prompt and completion tokens. They are
// added when the total says so, and never otherwise: not twice for OpenAI's
// counts, not on a total that is another sum, none, or a sum past the
// counts' range (which wraps), and details of another shape fail nothing.
// Counts under the Responses API's names (as some servers send them in a
// chat completion) are read as the others, which come first.
func TestUsageOfOtherConventions(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for usage, want := range map[string][2]uint64{
			`"prompt_tokens":32,"completion_tokens":9,"total_tokens":135,"completion_tokens_details":{"reasoning_tokens":94}`:                     {32, 103},
			`"prompt_tokens":32,"completion_tokens":9,"total_tokens":135,"completion_tokens_details":{"reasoning_tokens":"94","audio_tokens":0}`:  {32, 103},
			`"prompt_tokens":10,"completion_tokens":500,"total_tokens":510,"completion_tokens_details":{"reasoning_tokens":200,"audio_tokens":0}`: {10, 500},
			`"prompt_tokens":10,"completion_tokens":5,"completion_tokens_details":{"reasoning_tokens":7}`:                                         {10, 5},
			`"prompt_tokens":10,"completion_tokens":5,"total_tokens":20`:                                                                          {10, 5},
			`"prompt_tokens":10,"completion_tokens":5,"total_tokens":20,"completion_tokens_details":{"reasoning_tokens":3}`:                       {10, 5},
			`"prompt_tokens":32,"completion_tokens":9,"total_tokens":135,"completion_tokens_details":"n/a"`:                                       {32, 9},
			`"prompt_tokens":32,"completion_tokens":9,"total_tokens":135,"completion_tokens_details":[94]`:                                        {32, 9},
			`"prompt_tokens":32,"completion_tokens":9,"total_tokens":135,"completion_tokens_details":null`:                                        {32, 9},
			`"prompt_tokens":18446744073709551615,"completion_tokens":9,"total_tokens":8,"completion_tokens_details":{"reasoning_tokens":1}`:      {math.MaxUint64, 9},
			`"prompt_tokens":18446744073709551615,"completion_tokens":9,"total_tokens":9,"completion_tokens_details":{"reasoning_tokens":1}`:      {math.MaxUint64, 9},
			`"input_tokens":32,"output_tokens":9,"total_tokens":41`:                                                                               {32, 9},
			`"input_tokens":32,"output_tokens":9,"total_tokens":135,"completion_tokens_details":{"reasoning_tokens":94}`:                          {32, 103},
			`"prompt_tokens":32,"completion_tokens":9,"input_tokens":1,"output_tokens":1`:                                                         {32, 9},
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"counted"}}],"usage":{`+usage+`}}`)
			})
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err, usage)
			require.Equal(t, want, [2]uint64{res.InputTokens, res.OutputTokens}, usage)

			client = b.eventsClient(t, []string{`{"choices":[{"delta":{"content":"counted"},"finish_reason":"stop"}]}`, `{"choices":[],"usage":{` + usage + `}}`})
			res, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, usage)
			require.Equal(t, want, [2]uint64{res.InputTokens, res.OutputTokens}, usage)
		}
	})
}

// TestAStreamsUsageInParts: a stream's usage is its last count of each
// side, wherever it comes: in every event, as a running count (vLLM's
// continuous usage, proxies that send it so), counts of no tokens in the
// events before the last (DeepSeek's and Kimi's APIs), or in parts: an event
// after the counts with no count in it (a proxy that adds the cached tokens
// in an event of their own) or with only one side's (a translation of
// Anthropic's events, whose first counts the input and whose last the
// output) leaves the counts before it. A count of no tokens is no count
// (the metering counts that side with the tokenizer), so it never replaces
// one.
func TestAStreamsUsageInParts(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for _, c := range []struct {
			events []string
			want   [2]uint64
		}{{
			[]string{
				`{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`,
				`{"choices":[{"delta":{"content":"b"}}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}`,
				`{"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13}}`,
			}, [2]uint64{10, 3},
		}, {
			[]string{
				`{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}`,
				`{"choices":[{"delta":{},"finish_reason":"stop"}],"usage":null}`,
				`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`,
			}, [2]uint64{10, 5},
		}, {
			[]string{
				`{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`,
				`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":8}}}`,
			}, [2]uint64{10, 5},
		}, {
			[]string{
				`{"choices":[{"delta":{"role":"assistant"}}],"usage":{"prompt_tokens":10,"completion_tokens":1}}`,
				`{"choices":[{"delta":{"content":"a b c"}}]}`,
				`{"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":0,"completion_tokens":7}}`,
			}, [2]uint64{10, 7},
		}} {
			client := b.eventsClient(t, c.events)
			res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, c.events)
			require.True(t, res.UsageReported, c.events)
			require.Equal(t, c.want, [2]uint64{res.InputTokens, res.OutputTokens}, c.events)
		}
	})
}

// TestErrorsInReplies: an error an upstream sends in place of output, with
// status 200 or in a stream, fails the call with the upstream's message, for
// the log: an error object (OpenAI's), an error string
// (text-generation-inference's), an event named error whatever its data (as
// some servers send it), even when a [DONE] follows, an error field (as
// llama.cpp's server sent it), a choice's finish_reason "error", with an
// error beside it (OpenRouter's) or alone, or an error of another type that
// says something (an error with a code alone says its code); an empty error
// member beside a real answer (null, "", false, 0, {}, [], a blank message,
// as some servers serialize one) is none. An error status's body gives its
// message the same way, or as vLLM gives it, beside the error, or as FastAPI
// gives it, its detail (a detail of no validation errors says nothing: the
// body is the message), or in a list, as Gemini's OpenAI-compatible API
// gives it; a member of another type does not hide the others. Events of
// other names are read.
func TestErrorsInReplies(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		const delta = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n"
		for reply, want := range map[string]string{
			`{"error":"Input validation error: too long","error_type":"validation"}`:                                                                                       "answered 200 with an error: Input validation error: too long",
			delta + "data: {\"error\":{\"message\":\"overloaded\"}}\n\ndata: [DONE]\n\n":                                                                                   "upstream error in stream: overloaded",
			delta + "data: {\"error\":\"Request failed during generation\"}\n\n":                                                                                           "upstream error in stream: Request failed during generation",
			"event: error\ndata: {\"code\":422,\"details\":\"not with stream\"}\n\ndata: [DONE]\n\n":                                                                       `upstream error in stream: {"code":422,"details":"not with stream"}`,
			delta + "event: error\r\ndata: {\"message\":\"Compute error.\"}\r\n\r\n":                                                                                       "upstream error in stream: Compute error.",
			"event: error\ndata: {\"error\":{\"message\":\"context too long\"}}\n\n":                                                                                       "upstream error in stream: context too long",
			delta + "error: {\"code\":500,\"message\":\"the context is full\",\"type\":\"server_error\"}\n\n":                                                              "upstream error in stream: the context is full",
			"event: error\ndata: it broke\n\n":                                                                                                                             "upstream error in stream: it broke",
			delta + `data: {"error":{"code":502,"message":"Provider disconnected"},"choices":[{"delta":{"content":""},"finish_reason":"error"}]}` + "\n\ndata: [DONE]\n\n": "upstream error in stream: Provider disconnected",
			delta + `data: {"choices":[{"delta":{"content":" the"},"finish_reason":"error"}]}` + "\n\ndata: [DONE]\n\n":                                                    `upstream error in stream: the upstream finished its output with finish_reason "error"`,
			`{"choices":[{"message":{"content":"failed partial answer"},"finish_reason":"error"}],"usage":{"prompt_tokens":3,"completion_tokens":3}}`:                      `the upstream finished its output with finish_reason "error"`,
			`{"error":{"message":"Provider disconnected"},"choices":[{"message":{"content":""},"finish_reason":"error"}]}`:                                                 "Provider disconnected",
			delta + `data: {"error":true}` + "\n\n":                                                                                                                        "upstream error in stream: true",
			delta + `data: {"error":{"type":"server_error","message":null}}` + "\n\n":                                                                                      "upstream error in stream: an error without a message",
			delta + `data: {"error":{"message":503,"code":"overloaded"}}` + "\n\n":                                                                                         "upstream error in stream: 503",
			delta + `data: {"error":{"message":"","code":"rate_limit_exceeded"}}` + "\n\n":                                                                                 "upstream error in stream: rate_limit_exceeded",
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = io.WriteString(w, reply) })
			_, err := client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, upstream.ErrFailed, reply)
			require.ErrorContains(t, err, want, reply)
			_, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.ErrorIs(t, err, upstream.ErrStreamBroken, reply)
			if !strings.HasPrefix(reply, "{") { // a completion's error says it was answered 200
				require.ErrorContains(t, err, want, reply)
			}
		}

		for _, blank := range []string{`""`, `" "`, `{}`, `false`, `0`, `[]`, `null`, `{"message":" "}`, `{"message":"\t\n"}`, `{"message":"","code":null,"type":""}`} {
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `data: {"error":`+blank+`,"choices":[{"delta":{"content":"o"}}]}`+"\n\n"+
					`data: {"error":`+blank+`,"choices":[{"delta":{"content":"k"},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
			})
			res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, blank)
			require.Equal(t, "ok", res.Content, blank)
			client = b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"error":`+blank+`,"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}`)
			})
			res, err = client.Complete(context.Background(), &req)
			require.NoError(t, err, blank)
			require.Equal(t, "ok", res.Content, blank)
		}

		for _, reply := range []string{
			"event: message\ndata: {\"choices\":[{\"delta\":{\"content\":\"ok\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
			"event: error\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"ok\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n", // an event without data is none
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = io.WriteString(w, reply) })
			res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, reply)
			require.Equal(t, "ok", res.Content, reply)
		}

		for body, want := range map[string]string{
			`{"error":"Input validation error: too long","error_type":"validation"}`:                                                                         "Input validation error: too long",
			`{"object":"error","message":"This model's maximum context length is 4096","type":"BadRequestError","code":400}`:                                 "This model's maximum context length is 4096",
			`[{"error":{"code":400,"message":"Invalid JSON payload received. Unknown name \"reasoning\": Cannot find field.","status":"INVALID_ARGUMENT"}}]`: `Invalid JSON payload received. Unknown name "reasoning": Cannot find field.`,
			`{"detail":"Model not found: tiny"}`: "Model not found: tiny",
			`{"detail":[{"loc":["body","messages"],"msg":"field required","type":"value_error.missing"}]}`: "field required",
			`{"error":{"message":"context too long","code":400},"message":5}`:                              "context too long",
			`{"detail":{"reason":"unknown"}}`:                                                              `{"detail":{"reason":"unknown"}}`,
			`{"detail":" "}`:                                                                               `{"detail":" "}`,
			`{"detail":[]}`:                                                                                `{"detail":[]}`,
			`{"error":{"code":"model_not_found"},"message":"The model tiny does not exist"}`:               "The model tiny does not exist",
		} {
			client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusUnprocessableEntity)
				_, _ = io.WriteString(w, body)
			})
			_, err := client.Complete(context.Background(), &req)
			var rejected *upstream.RejectedError
			require.ErrorAs(t, err, &rejected)
			require.Equal(t, want, rejected.Message)
		}
	})
}

// TestContentInParts: content may come as an array of parts, as Mistral's
// API sends it (thinking parts before the text when its models reason): the
// text parts are the content, in order, in a completion and in a stream's
// deltas alike; thinking parts are the thinking (never a delta), unknown
// parts neither. A part whose text is not a string fails the reply.
func TestContentInParts(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		const parts = `[{"type":"thinking","thinking":[{"type":"text","text":"hmm"}]},{"type":"text","text":"Hello "},` +
			`{"type":"image_url","image_url":{"url":"https://example.org/x.png"}},{"type":"text","text":"w\u00f6rld"}]`
		client := b.replyClient(t, func(w http.ResponseWriter) {
			_, _ = io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":`+parts+`}}],"usage":{"prompt_tokens":3,"completion_tokens":2}}`)
		})
		res, err := client.Complete(context.Background(), &req)
		require.NoError(t, err)
		require.Equal(t, "Hello wörld", res.Content)
		require.Equal(t, "hmm", res.Reasoning, "thinking parts are thinking")

		events := []string{
			`{"choices":[{"delta":{"role":"assistant","content":[{"type":"thinking","thinking":[{"type":"text","text":"hmm"}]}]}}]}`,
			`{"choices":[{"delta":{"content":[{"type":"thinking","thinking":" so","closed":true},{"type":"thinking","thinking":7}]}}]}`,
			`{"choices":[{"delta":{"content":[{"type":"text","text":"Hello "}]}}]}`,
			`{"choices":[{"delta":{"content":"w\u00f6rld"}}]}`,
			`{"choices":[{"delta":{"content":null},"finish_reason":"stop"}]}`,
		}
		client = b.eventsClient(t, events)
		var deltas []string
		res, err = client.Stream(context.Background(), &req, func(d upstream.Delta) error { deltas = append(deltas, d.Content); return nil })
		require.NoError(t, err)
		require.Equal(t, []string{"Hello ", "wörld"}, deltas, "the thinking part is no delta")
		require.Equal(t, "Hello wörld", res.Content)
		require.Equal(t, "hmm so", res.Reasoning, "thinking of a shape not known is none")

		client = b.replyClient(t, func(w http.ResponseWriter) {
			_, _ = io.WriteString(w, `{"choices":[{"message":{"content":[{"type":"text","text":5}]}}],"usage":{"prompt_tokens":3,"completion_tokens":2}}`)
		})
		_, err = client.Complete(context.Background(), &req)
		require.ErrorIs(t, err, upstream.ErrFailed)
	})
}

// TestThinkingIsOutputNotSent: a reasoning model's thinking, sent beside
// its content as reasoning_content (DeepSeek's API), reasoning (OpenRouter,
// vLLM since its rename) or both with the same text (servers between the
// two), is the result's Reasoning, counted once, and never a delta; a
// thinking field of another shape is none and fails nothing.
func TestThinkingIsOutputNotSent(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for fields, want := range map[string]string{
			`"reasoning_content":"Sky: light scatters."`:                                    "Sky: light scatters.",
			`"reasoning":"Sky: light scatters."`:                                            "Sky: light scatters.",
			`"reasoning_content":"Sky: light scatters.","reasoning":"Sky: light scatters."`: "Sky: light scatters.",
			`"reasoning_content":null,"reasoning":"Sky."`:                                   "Sky.",
			`"reasoning_content":"","reasoning":"Sky."`:                                     "Sky.",
			`"reasoning":{"effort":"high"},"reasoning_content":["a"]`:                       "",
		} {
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":"Blue.",`+fields+`}}]}`)
			})
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err, fields)
			require.Equal(t, "Blue.", res.Content, fields)
			require.Equal(t, want, res.Reasoning, fields)
		}

		events := []string{
			`{"choices":[{"delta":{"role":"assistant","content":"","reasoning_content":"Sky: "}}]}`,
			`{"choices":[{"delta":{"reasoning":"light "}}]}`,
			`{"choices":[{"delta":{"reasoning_content":"scatters","reasoning":"scatters"}}]}`,
			`{"choices":[{"delta":{"content":null,"reasoning":{"summary":"x"}}}]}`,
			`{"choices":[{"delta":{"content":"Blue","reasoning_content":null}}]}`,
			`{"choices":[{"delta":{"content":[{"type":"text","text":"."}],"reasoning":"."}}]}`,
			`{"choices":[{"delta":{},"finish_reason":"stop"}]}`,
		}
		client := b.eventsClient(t, events)
		var deltas []string
		res, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error { deltas = append(deltas, d.Content); return nil })
		require.NoError(t, err)
		require.Equal(t, []string{"Blue", "."}, deltas, "thinking is no delta")
		require.Equal(t, "Blue.", res.Content)
		require.Equal(t, "Sky: light scatters.", res.Reasoning)
		require.False(t, res.UsageReported, "for the caller to count, thinking with the content")
	})
}

// TestStreamsWithoutDone: a stream that ends without [DONE] after its
// finish_reason, as some OpenAI-compatible servers send it, is whole,
// whatever the finish_reason's type (SGLang's own API sends an object), as a
// completion with one is taken; one that ends without either (a
// finish_reason that says nothing, "" or false or 0, is none) is broken, and
// so is one whose body was cut short of its declared length, finish_reason
// or not.
func TestStreamsWithoutDone(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetNoDone(true)
		deltas, res, err := collect(t, b.client, context.Background())
		require.NoError(t, err)
		require.Len(t, deltas, len(fakeupstream.StreamPieces(req.Prompt))+1)
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
		require.True(t, res.UsageReported)
		b.fake.SetAlwaysStreaming(true)
		res, err = b.client.Complete(context.Background(), &req)
		require.NoError(t, err, "a reply asked for whole, streamed without [DONE]")
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)

		const piece = "data: {\"choices\":[{\"delta\":{\"content\":\"cut\"}}]}\n\n"
		const finish = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
		for _, reason := range []string{`"length"`, `{"type":"stop"}`, `1`, `true`} {
			client := b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, piece+strings.Replace(finish, `"length"`, reason, 1))
			})
			res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, reason)
			require.Equal(t, "cut", res.Content, reason)
			client = b.replyClient(t, func(w http.ResponseWriter) {
				_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"whole"},"finish_reason":`+reason+`}]}`)
			})
			res, err = client.Complete(context.Background(), &req)
			require.NoError(t, err, reason)
			require.Equal(t, "whole", res.Content, reason)
		}
		// The last line may end with the body, without its line end.
		client := b.replyClient(t, func(w http.ResponseWriter) {
			_, _ = io.WriteString(w, piece+strings.TrimRight(finish, "\n"))
		})
		res, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.NoError(t, err, "a last line without its line end")
		require.Equal(t, "cut", res.Content)
		for name, reply := range map[string]func(w http.ResponseWriter){
			"no finish_reason": func(w http.ResponseWriter) { _, _ = io.WriteString(w, piece) },
			"finish_reasons that say nothing": func(w http.ResponseWriter) {
				for _, none := range []string{`""`, `" "`, `false`, `0`, `{}`} {
					_, _ = io.WriteString(w, strings.Replace(finish, `"length"`, none, 1))
				}
				_, _ = io.WriteString(w, piece)
			},
			"cut short of its length": func(w http.ResponseWriter) {
				w.Header().Set("Content-Length", strconv.Itoa(len(piece+finish)+100))
				_, _ = io.WriteString(w, piece+finish)
			},
		} {
			client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "text/event-stream")
				reply(w)
			})
			var deltas []upstream.Delta
			res, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error { deltas = append(deltas, d); return nil })
			require.ErrorIs(t, err, upstream.ErrStreamBroken, name)
			require.Equal(t, "cut", res.Content, name)
			require.Len(t, deltas, 1, name)
		}
	})
}

// TestLargeBodiesPassTheSmallBuffers: the connection buffers are 1 KiB; a
// 100 KB prompt, its reply and a stream event of 3 KB pass whole.
func TestLargeBodiesPassTheSmallBuffers(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		large := req
		large.Prompt = strings.Repeat("word ", 20000) + strings.Repeat("x", 3000)
		res, err := b.client.Complete(context.Background(), &large)
		require.NoError(t, err)
		require.Equal(t, fakeupstream.Reply(large.Prompt), res.Content)
		require.Equal(t, large.Prompt, b.fake.Calls()[0].Prompt)

		var longest int
		res, err = b.client.Stream(context.Background(), &large, func(d upstream.Delta) error {
			longest = max(longest, len(d.Content))
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, fakeupstream.Reply(large.Prompt), res.Content)
		require.Equal(t, 3000, longest, "the last piece, one event of 3 KB")
	})
}

// TestStreamLinesSplitAcrossPauses: events whose lines arrive in pieces, with
// pauses between them, are read whole (the reader's buffer is let go only
// between lines).
func TestStreamLinesSplitAcrossPauses(t *testing.T) {
	t.Parallel()
	events := []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"split \"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"in pieces\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n",
		"data: [DONE]\n\n",
	}
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, e := range events {
			third := len(e) / 3
			for _, piece := range []string{e[:third], e[third : 2*third], e[2*third:]} {
				_, _ = io.WriteString(w, piece)
				w.(http.Flusher).Flush()
				time.Sleep(10 * time.Millisecond)
			}
		}
	}))
	t.Cleanup(server.Close)
	client := openai.New(openai.Config{BaseURL: server.URL, Timeout: 5 * time.Second})
	var got []string
	res, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error {
		got = append(got, d.Content)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"split ", "in pieces"}, got)
	require.Equal(t, "split in pieces", res.Content)
	require.Equal(t, uint64(4), res.OutputTokens)
}

func TestStreamBrokenMidway(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetBreakAfter(2)
		deltas, res, err := collect(t, b.client, context.Background())
		require.ErrorIs(t, err, upstream.ErrStreamBroken)
		require.Len(t, deltas, 2)
		pieces := fakeupstream.StreamPieces(req.Prompt)
		require.Equal(t, pieces[0]+pieces[1], res.Content, "what was received is returned for billing")
		require.False(t, res.UsageReported)
	})
}

func TestStreamRefusedAtStart(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetMode(fakeupstream.Down)
		deltas, _, err := collect(t, b.client, context.Background())
		require.ErrorIs(t, err, upstream.ErrUnavailable)
		require.Empty(t, deltas)
	})
}

func TestStreamSilenceIsBroken(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetChunkDelay(time.Second)
		client := b.newClient(openai.Config{Timeout: 100 * time.Millisecond})
		_, _, err := collect(t, client, context.Background())
		require.ErrorIs(t, err, upstream.ErrStreamBroken)
	})
}

// TestStreamsEndAtTheirLimit: comment lines and empty deltas end a stream's
// silence, not its limit (StreamLimit), nor does a slow head, over either
// transport; what came before is kept.
func TestStreamsEndAtTheirLimit(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for name, keepAlive := range map[string]string{
			"comments":     ": keep-alive\n\n",
			"empty deltas": `data: {"choices":[{"delta":{"content":""}}]}` + "\n\n",
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				url := b.serve(t, func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, `data: {"choices":[{"delta":{"content":"before "}}]}`+"\n\n")
					for r.Context().Err() == nil { // until the gateway leaves
						_, _ = io.WriteString(w, keepAlive)
						w.(http.Flusher).Flush()
						time.Sleep(10 * time.Millisecond)
					}
				})
				client := b.newClient(openai.Config{BaseURL: url, Timeout: 2 * time.Second, StreamLimit: 300 * time.Millisecond})
				res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
				require.ErrorIs(t, err, upstream.ErrStreamBroken)
				require.ErrorContains(t, err, "the stream took longer than its limit of 300ms")
				require.Equal(t, "before ", res.Content)
			})
		}
		t.Run("a slow head", func(t *testing.T) {
			t.Parallel()
			b.fake.SetDelay(5 * time.Second)
			client := b.newClient(openai.Config{Timeout: 10 * time.Second, StreamLimit: 100 * time.Millisecond})
			_, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.ErrorIs(t, err, upstream.ErrFailed, "dispatched: never sent again")
			require.ErrorContains(t, err, "the stream took longer than its limit of 100ms")
		})
	})
}

// TestAFinishedStreamLeftOpenIsWhole: an upstream that sends its
// finish_reason and its usage and then neither [DONE] nor the end of its
// body, quiet or sending keep-alives, ends its stream whole at the end of its
// ending (endingGrace, or its silence Timeout if shorter), over either
// transport. A finish_reason alone starts no ending: output that follows an
// early one, after a pause longer than the ending, is kept; output after a
// finish_reason and the usage ends their ending (an upstream that sends them
// in every event goes on for longer than one); and a stream left open
// without its usage, or never finished, is still broken at its limit.
func TestAFinishedStreamLeftOpenIsWhole(t *testing.T) {
	t.Parallel()
	const (
		all    = `data: {"choices":[{"delta":{"content":"all of it"}}]}` + "\n\n"
		finish = `data: {"choices":[{"delta":{},"finish_reason":"stop"}]}` + "\n\n"
		usage  = `data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}` + "\n\n"
		early  = `data: {"choices":[{"delta":{"content":"all of"},"finish_reason":"stop"}]}` + "\n\n"
		rest   = `data: {"choices":[{"delta":{"content":" it"}}]}` + "\n\n"
		pause  = "pause" // keep-alives for longer than the ending
		beat   = "beat"  // keep-alives for less than half the ending
	)
	// finishing is an event of text with a finish_reason and the usage, as
	// an upstream that sends them in every event sends it.
	finishing := func(text string) string {
		return `data: {"choices":[{"delta":{"content":"` + text + `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}` + "\n\n"
	}
	pauses := map[string]time.Duration{pause: 2500 * time.Millisecond, beat: 900 * time.Millisecond}
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for name, tc := range map[string]struct {
			events     []string
			keepAlives bool
			broken     bool
		}{
			"quiet after its usage":                        {events: []string{all, finish, usage}},
			"keep-alives after its usage":                  {events: []string{all, finish, usage}, keepAlives: true},
			"finish and usage in one event":                {events: []string{finishing("all of it")}},
			"its usage after a pause":                      {events: []string{all, finish, pause, usage}, keepAlives: true},
			"output after an early finish_reason":          {events: []string{early, pause, rest, finish, usage}},
			"a finish_reason and the usage in every event": {events: []string{finishing("all"), beat, finishing(" of"), beat, finishing(" i"), beat, finishing("t")}},
			"keep-alives after a finish, no usage":         {events: []string{all, finish}, keepAlives: true, broken: true},
			"keep-alives, never finished":                  {events: []string{all}, keepAlives: true, broken: true},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				keepAlive := func(w http.ResponseWriter) {
					_, _ = io.WriteString(w, ": keep-alive\n\n")
					w.(http.Flusher).Flush()
					time.Sleep(20 * time.Millisecond)
				}
				url := b.serve(t, func(w http.ResponseWriter, r *http.Request) {
					_, _ = io.Copy(io.Discard, r.Body)
					w.Header().Set("Content-Type", "text/event-stream")
					for _, e := range tc.events {
						if d, ok := pauses[e]; ok {
							for end := time.Now().Add(d); time.Now().Before(end); {
								keepAlive(w)
							}
							continue
						}
						_, _ = io.WriteString(w, e)
						w.(http.Flusher).Flush()
					}
					for r.Context().Err() == nil { // until the gateway leaves
						if tc.keepAlives {
							keepAlive(w)
						} else {
							time.Sleep(20 * time.Millisecond)
						}
					}
				})
				limit := time.Minute // a whole stream ends long before
				if tc.broken {
					limit = 6 * time.Second
				}
				client := b.newClient(openai.Config{BaseURL: url, Timeout: 5 * time.Second, StreamLimit: limit})
				start := time.Now()
				res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
				require.Equal(t, "all of it", res.Content)
				if tc.broken {
					require.ErrorIs(t, err, upstream.ErrStreamBroken)
					require.ErrorContains(t, err, "the stream took longer than its limit of 6s")
					return
				}
				require.NoError(t, err)
				require.Less(t, time.Since(start), limit/2, "ended by its ending, not at its limit")
				require.True(t, res.UsageReported)
				require.Equal(t, [2]uint64{3, 4}, [2]uint64{res.InputTokens, res.OutputTokens})
			})
		}
	})
}

// TestAClientsTimeIsNotTheUpstreamsSilence: the time emit takes (a client
// slow to take a delta) does not count as the upstream's silence, over either
// transport.
func TestAClientsTimeIsNotTheUpstreamsSilence(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetChunkDelay(20 * time.Millisecond)
		client := b.newClient(openai.Config{Timeout: 500 * time.Millisecond})
		var text strings.Builder
		res, err := client.Stream(context.Background(), &req, func(d upstream.Delta) error {
			if text.Len() == 0 {
				time.Sleep(1500 * time.Millisecond) // the client takes its first delta late
			}
			text.WriteString(d.Content)
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, strings.Join(fakeupstream.StreamPieces(req.Prompt), ""), text.String())
		require.Equal(t, text.String(), res.Content)
	})
}

func TestStreamCallerCancels(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetChunkDelay(50 * time.Millisecond)
		ctx, cancel := context.WithCancel(context.Background())
		n := 0
		res, err := b.client.Stream(ctx, &req, func(upstream.Delta) error {
			if n++; n == 2 {
				cancel()
			}
			return nil
		})
		require.ErrorIs(t, err, context.Canceled)
		require.NotEmpty(t, res.Content)
	})
}

// TestStreamEmitErrorStops: an error of the caller's emit stops the stream
// and is the call's error as it is, not a broken stream, whether the
// upstream streams or answers whole.
func TestStreamEmitErrorStops(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		stop := errors.New("client gone")
		res, err := b.client.Stream(context.Background(), &req, func(upstream.Delta) error { return stop })
		require.ErrorIs(t, err, stop)
		require.NotErrorIs(t, err, upstream.ErrStreamBroken)
		require.Equal(t, fakeupstream.StreamPieces(req.Prompt)[0], res.Content)

		b.fake.SetNoStreaming(true)
		res, err = b.client.Stream(context.Background(), &req, func(upstream.Delta) error { return stop })
		require.ErrorIs(t, err, stop, "answered whole")
		require.NotErrorIs(t, err, upstream.ErrStreamBroken, "answered whole")
		require.Equal(t, fakeupstream.Reply(req.Prompt), res.Content)
	})
}

// TestStreamSourcesAreHeldToTheBound: a stream citing far more sources than
// the guard keeps passes each on, for the guard to drop, but its result holds
// no more than upstream.MaxSources of them (of a reply, each source is a few
// words over the reply's own memory, whose length is bounded).
func TestStreamSourcesAreHeldToTheBound(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		b.fake.SetHostile("why", fakeupstream.Hostile{Content: "text", SourceTitle: "t", Citations: 3 * upstream.MaxSources})
		var emitted int
		res, err := b.client.Stream(context.Background(), &req, func(d upstream.Delta) error {
			emitted += len(d.Sources)
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, 3*upstream.MaxSources, emitted, "each is passed on, for the guard to drop")
		require.Len(t, res.Sources, upstream.MaxSources)
	})
}

// TestReplyHeadsAreBounded: a reply whose head passes 1 MiB (here 2 MiB,
// which net/http's default bound of 10 MB let through) fails after dispatch
// over either transport, as a call or as a stream; a large head within the
// bound is read.
func TestReplyHeadsAreBounded(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for size, fits := range map[int]bool{256 << 10: true, 2 << 20: false} {
			value := strings.Repeat("x", size)
			client := b.replyClient(t, func(w http.ResponseWriter) {
				w.Header().Set("X-Padding", value)
				_, _ = w.Write([]byte(`{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`))
			})
			res, err := client.Complete(context.Background(), &req)
			if fits {
				require.NoError(t, err, "head of %d bytes", size)
				require.Equal(t, "ok", res.Content)
				continue
			}
			require.ErrorIs(t, err, upstream.ErrFailed, "head of %d bytes", size)
			_, _, streamErr := collect(t, client, context.Background())
			require.Equal(t, upstream.KindFailed, upstream.Kind(streamErr), "stream, head of %d bytes: %v", size, streamErr)
		}
	})
}

// TestRepliesAreReadNoFurtherThanTheirRequestAllows: a non-streaming reply
// longer than its request's text and sources could make it fails after
// dispatch, read no further (D11): one of unknown length up to the bound,
// whatever it holds (one endless line, or blank lines without end), so the
// upstream can write no more than the bound and the sockets' buffers; one
// that says so in its Content-Length not at all (its upstream here writes
// nothing more). The longest reply the request allows, every byte of it
// escaped, is read whole, as the answer to a stream's call too.
func TestRepliesAreReadNoFurtherThanTheirRequestAllows(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		for name, chunk := range map[string]string{"one line": " ", "blank lines": "\n"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				written := make(chan int64, 1)
				client := b.replyClient(t, func(w http.ResponseWriter) {
					chunk := []byte(strings.Repeat(chunk, 64<<10))
					var n int64
					for n < 1<<30 {
						m, err := w.Write(chunk)
						if n += int64(m); err != nil {
							break
						}
					}
					written <- n
				})
				_, err := client.Complete(context.Background(), &req)
				require.ErrorIs(t, err, upstream.ErrFailed)
				require.ErrorIs(t, err, upstream.ErrTooLong)
				select {
				case n := <-written:
					require.Less(t, n, int64(32<<20), "the upstream wrote no more than the bound and the buffers hold")
				case <-time.After(10 * time.Second):
					t.Fatal("the upstream is still writing: the reply is still read")
				}
			})
		}

		t.Run("declared", func(t *testing.T) {
			t.Parallel()
			client := b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Length", strconv.Itoa(1<<30))
				w.WriteHeader(http.StatusOK)
				w.(http.Flusher).Flush()
				<-r.Context().Done()
			})
			_, err := client.Complete(context.Background(), &req)
			require.ErrorIs(t, err, upstream.ErrFailed)
			require.ErrorIs(t, err, upstream.ErrTooLong, "refused for its length, not waited for")
		})

		t.Run("longest", func(t *testing.T) {
			t.Parallel()
			text := strings.Repeat("\x01", upstream.MaxTextBytes(&req))
			annotations := make([]map[string]any, upstream.MaxSources)
			for i := range annotations {
				annotations[i] = map[string]any{"type": "url_citation", "url_citation": map[string]any{
					"url": strings.Repeat("\x01", upstream.MaxURLBytes), "title": strings.Repeat("\x01", upstream.MaxTitleBytes),
					"start_index": 1_000_000_000, "end_index": 1_000_000_000,
				}}
			}
			reply, err := json.Marshal(map[string]any{
				"choices": []any{map[string]any{"message": map[string]any{"content": text, "annotations": annotations}}},
				"usage":   map[string]any{"prompt_tokens": 1, "completion_tokens": 1},
			})
			require.NoError(t, err)
			require.Greater(t, len(reply), 6*len(text), "every byte escaped")
			client := b.replyClient(t, func(w http.ResponseWriter) { _, _ = w.Write(reply) })
			res, err := client.Complete(context.Background(), &req)
			require.NoError(t, err)
			require.Equal(t, text, res.Content)
			res, err = client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
			require.NoError(t, err, "a stream's call answered with the longest completion")
			require.Equal(t, text, res.Content)
		})
	})
}

// replyClient returns a client, over the bundle's transport, to an upstream
// whose replies reply writes.
func (b *testBundle) replyClient(t *testing.T, reply func(w http.ResponseWriter)) *openai.Client {
	t.Helper()
	return b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		reply(w)
	})
}

// eventsClient returns a client, over the bundle's transport, to an
// upstream that streams events, each a data: line, and then [DONE].
func (b *testBundle) eventsClient(t *testing.T, events []string) *openai.Client {
	t.Helper()
	return b.handlerClient(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, e := range events {
			_, _ = io.WriteString(w, "data: "+e+"\n\n")
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
}

// handlerClient returns a client, over the bundle's transport, to an
// upstream that handle serves.
func (b *testBundle) handlerClient(t *testing.T, handle http.HandlerFunc) *openai.Client {
	t.Helper()
	return b.newClient(openai.Config{BaseURL: b.serve(t, handle), Timeout: 10 * time.Second})
}

// serve starts an upstream that handle serves, over the bundle's protocol,
// and returns its base URL.
func (b *testBundle) serve(t *testing.T, handle http.HandlerFunc) string {
	t.Helper()
	server := httptest.NewUnstartedServer(handle)
	server.Config.Protocols = new(http.Protocols)
	server.Config.Protocols.SetHTTP1(!b.h2c)
	server.Config.Protocols.SetUnencryptedHTTP2(b.h2c)
	server.Start()
	t.Cleanup(server.Close)
	return server.URL + "/v1"
}

// TestStreamLinesAreBoundedByTheirRequest: a stream line longer than a whole
// reply to its request could be (here 4 MB for 123 output tokens, under the
// 8 MiB any line may take) breaks the stream, over either transport.
func TestStreamLinesAreBoundedByTheirRequest(t *testing.T) {
	t.Parallel()
	eachTransport(t, func(t *testing.T, b *testBundle) {
		long := fmt.Sprintf("data: {\"choices\":[{\"delta\":{\"content\":%q}}]}\n\n", strings.Repeat("x", 4<<20))
		client := b.replyClient(t, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"before \"}}]}\n\n"+long+"data: [DONE]\n\n")
		})
		res, err := client.Stream(context.Background(), &req, func(upstream.Delta) error { return nil })
		require.ErrorIs(t, err, upstream.ErrStreamBroken)
		require.ErrorIs(t, err, upstream.ErrTooLong)
		require.Equal(t, "before ", res.Content)
	})
}
