package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/access"
	"github.com/rungworks/gateway/internal/apitest"
	"github.com/rungworks/gateway/openapi"
	"github.com/rungworks/gateway/ratelimit"
	"github.com/rungworks/gateway/server"
	"github.com/rungworks/gateway/store"
	"github.com/rungworks/gateway/upstream"
)

// errorExample is an error the document shows, in a reply or a stream's
// event.
type errorExample struct {
	status int
	error  json.RawMessage // the envelope's error: code and message
}

// errorExamples returns the document's examples of error replies (status
// 400 or more) and of streams' error events (status 200), named by the reply
// they belong to (a shared reply's name, or the operation and status of one
// written in place) and their own name.
func errorExamples(t *testing.T) map[string]errorExample {
	t.Helper()
	type reply struct {
		Ref     string `json:"$ref"`
		Content map[string]struct {
			Examples map[string]struct {
				Value json.RawMessage `json:"value"`
			} `json:"examples"`
		} `json:"content"`
	}
	var doc struct {
		Paths      map[string]map[string]struct{ Responses map[string]reply } `json:"paths"`
		Components struct {
			Responses map[string]reply `json:"responses"`
		} `json:"components"`
	}
	raw, err := yaml.YAMLToJSON(openapi.YAML())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &doc))
	examples := map[string]errorExample{}
	for route, ops := range doc.Paths {
		for method, op := range ops {
			for status, r := range op.Responses {
				code, err := strconv.Atoi(status)
				require.NoError(t, err, "%s %s: a status, not %q", method, route, status)
				owner := fmt.Sprintf("%s %s %s", method, route, status)
				if r.Ref != "" {
					owner = strings.TrimPrefix(r.Ref, "#/components/responses/")
					r = doc.Components.Responses[owner]
				}
				for name, e := range r.Content["text/event-stream"].Examples {
					var text string
					require.NoError(t, json.Unmarshal(e.Value, &text), "%s: example %s", owner, name)
					for _, ev := range apitest.ParseEvents(t, strings.NewReader(text)).Events {
						if ev.Name == "response.error" {
							var v struct {
								Error json.RawMessage `json:"error"`
							}
							ev.Decode(t, &v)
							examples[owner+"/"+name] = errorExample{status: code, error: v.Error}
						}
					}
				}
				if code < 400 {
					continue // a reply's own error field (a batch's) is no error reply
				}
				for name, e := range r.Content["application/json"].Examples {
					var v struct {
						Error json.RawMessage `json:"error"`
					}
					require.NoError(t, json.Unmarshal(e.Value, &v), "%s: example %s", owner, name)
					require.NotNil(t, v.Error, "%s: example %s is no error envelope", owner, name)
					examples[owner+"/"+name] = errorExample{status: code, error: v.Error}
				}
			}
		}
	}
	return examples
}

// TestErrorExamplesAreWhatTheGatewaySends: each error reply and stream error
// event the document shows is what the request it depicts gets, status,
// code and message word for word. An example added to the document needs its
// request here.
func TestErrorExamplesAreWhatTheGatewaySends(t *testing.T) {
	t.Parallel()
	const (
		shownBatch   = "01a2434e-10e2-7663-88c3-1a2f68036927"
		shownRequest = "01a2434e-0fd6-7f17-8098-7459302aeb12"
	)
	post := func(path string, body any) func(*testing.T, *testBundle) reply {
		return func(_ *testing.T, b *testBundle) reply { return b.post(path, b.key, body) }
	}
	get := func(path string) func(*testing.T, *testBundle) reply {
		return func(_ *testing.T, b *testBundle) reply { return b.do(http.MethodGet, path, b.key, "", nil) }
	}
	requests := map[string]struct {
		options func(t *testing.T) options
		send    func(t *testing.T, b *testBundle) reply
	}{
		"post /api/v1/batch 400/itemInvalid": {send: post("/api/v1/batch", map[string]any{"requests": []map[string]any{{"prompt": "a"}, {"prompt": ""}}})},
		"post /api/v1/batch 400/tooLarge":    {send: post("/api/v1/batch", map[string]any{"requests": items(101)})},
		"post /api/v1/batch 422/reused": {send: func(t *testing.T, b *testBundle) reply {
			key := http.Header{"Idempotency-Key": {"retry-1"}}
			require.Equal(t, http.StatusAccepted, b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(1)}, key).status)
			return b.postWith("/api/v1/batch", b.key, map[string]any{"requests": items(2)}, key)
		}},
		"post /api/v1/batch/{batch_id}/cancel 409/finished": {send: func(t *testing.T, b *testBundle) reply {
			id := b.completedBatch(t, 1, "done")
			_, err := b.store.Pool().Exec(context.Background(), `UPDATE batches SET status = 'completed', completed_at = now() WHERE id = $1`, id)
			require.NoError(t, err)
			return b.do(http.MethodPost, "/api/v1/batch/"+id+"/cancel", b.key, "", nil)
		}},
		"BadRequest/emptyPrompt":   {send: post("/api/v1/responses", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}})},
		"BadRequest/invalidModel":  {send: post("/api/v1/responses", map[string]any{"prompt": "hi", "model": "gpt-4o"})},
		"BadRequest/outputCeiling": {send: post("/api/v1/responses", map[string]any{"prompt": "hi", "model": "instant", "max_output_rungs": 32001})},
		"Unauthorized/noKey": {send: func(_ *testing.T, b *testBundle) reply {
			return b.do(http.MethodPost, "/api/v1/responses", "", "application/json", []byte(`{"prompt":"hi"}`))
		}},
		"Forbidden/scope": {send: func(_ *testing.T, b *testBundle) reply {
			return b.post("/api/v1/responses", b.newKey("acme", gateway.TierDeveloper, gateway.ScopeUsage), map[string]any{"prompt": "hi"})
		}},
		"Forbidden/tier": {send: func(_ *testing.T, b *testBundle) reply {
			return b.post("/api/v1/batch", b.newKey("freeco", gateway.TierFree, gateway.ScopeInference), map[string]any{"requests": items(1)})
		}},
		"NotFound/batch":   {send: get("/api/v1/batch/" + shownBatch)},
		"NotFound/sources": {send: get("/api/v1/sources/" + shownRequest)},
		"BudgetExceeded/overTheCap": {send: func(t *testing.T, b *testBundle) reply {
			b.setLimits(t, nil, ptr(int64(1000)))
			return b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		}},
		"RequestTooLarge/declared": {send: func(_ *testing.T, b *testBundle) reply {
			return b.do(http.MethodPost, "/api/v1/responses", b.key, "application/json", make([]byte, 2<<20))
		}},
		"RateLimited/rate": {options: at49s, send: func(t *testing.T, b *testBundle) reply {
			b.fillMinute(t)
			return b.do(http.MethodGet, "/api/v1/usage", b.key, "", nil)
		}},
		"ResponseCreated/refused": {options: at49s, send: func(t *testing.T, b *testBundle) reply {
			b.fillMinute(t)
			return streamError(t, b)
		}},
		"ResponseCreated/brokenOff": {send: func(t *testing.T, b *testBundle) reply {
			b.upstream.configure(func(s *scripted) { s.breakAfter = 1 })
			return streamError(t, b)
		}},
		"RateLimited/ceiling": {send: func(t *testing.T, b *testBundle) reply {
			b.setLimits(t, ptr(int64(1000)), nil)
			return b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		}},
		"InferenceBusy/unavailable": {send: func(_ *testing.T, b *testBundle) reply {
			b.upstream.fail(upstream.ErrUnavailable)
			return b.post("/api/v1/responses", b.key, map[string]any{"prompt": "hi"})
		}},
		"ServiceUnavailable/database": {
			options: func(t *testing.T) options {
				o, _ := databaseAway(t)
				return o
			},
			send: post("/api/v1/responses", map[string]any{"prompt": "hi"}),
		},
		"RequestTimeout/slowBody": {
			options: func(*testing.T) options {
				return options{server: func(c *server.Config) { c.BodyTimeout = 200 * time.Millisecond }}
			},
			send: func(t *testing.T, b *testBundle) reply {
				return b.trickle(t, "/api/v1/responses", `{"prompt":`)
			},
		},
		"InternalError/internal": {
			options: func(*testing.T) options {
				return options{server: func(c *server.Config) { c.Usage = failingUsage{} }}
			},
			send: get("/api/v1/usage"),
		},
	}
	examples := errorExamples(t)
	require.NotEmpty(t, examples)
	for name := range requests {
		require.Contains(t, examples, name, "a request for an example the document no longer shows")
	}
	for name, want := range examples {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c, ok := requests[name]
			require.True(t, ok, "no request here sends the document's example %s", name)
			var o options
			if c.options != nil {
				o = c.options(t)
			}
			b := setupWith(t, o)
			r := c.send(t, b)
			require.Equal(t, want.status, r.status, string(r.body))
			var got struct {
				Error json.RawMessage `json:"error"`
			}
			require.NoError(t, json.Unmarshal(r.body, &got), string(r.body))
			require.JSONEq(t, string(want.error), string(got.Error))
		})
	}
}

// at49s stops the rate limiter's clock 49 s into the current minute: a key's
// 600 requests fill that minute, and the next is refused until a second into
// the next minute, 12 s later, where the 600 weigh 599.
func at49s(*testing.T) options {
	at := time.Now().Truncate(time.Minute).Add(49 * time.Second)
	return options{rates: ratelimit.Config{Clock: func() time.Time { return at }}}
}

// fillMinute sends the 600 requests of the bundle key's minute.
func (b *testBundle) fillMinute(t *testing.T) {
	t.Helper()
	for range 600 {
		require.Equal(t, http.StatusOK, b.do(http.MethodGet, "/api/v1/usage", b.key, "", nil).status)
	}
}

// streamError streams a response and returns its reply with the data of
// its response.error event, an error envelope, as the body.
func streamError(t *testing.T, b *testBundle) reply {
	t.Helper()
	r, s := b.stream("/api/v1/responses", map[string]any{"prompt": "hi"})
	for _, ev := range s.Events {
		if ev.Name == "response.error" {
			r.body = ev.Data
			return r
		}
	}
	require.FailNow(t, "the stream sent no response.error", "%+v", s.Events)
	return r
}

// databaseAway returns the options of a server that authenticates against a
// database, at addr, that refuses every connection.
func databaseAway(t *testing.T) (o options, addr string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr = l.Addr().String()
	require.NoError(t, l.Close())
	pool, err := pgxpool.New(t.Context(), "postgres://nobody@"+addr+"/none?connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	away := store.New(pool)
	return options{server: func(c *server.Config) {
		c.Auth = &access.Authenticator{Keys: access.NewKeys(access.Config{}, away), Rates: ratelimit.New(ratelimit.Config{}, away)}
		c.Unavailable = store.Transient
	}}, addr
}

// failingUsage is a usage view that fails for a reason no caller may see.
type failingUsage struct{}

func (failingUsage) Usage(context.Context, *gateway.Principal, time.Time, time.Time) (*gateway.UsageView, error) {
	return nil, errors.New("the disk is on fire")
}
