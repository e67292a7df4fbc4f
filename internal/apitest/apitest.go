// Package apitest checks HTTP replies against the gateway's OpenAPI document, so
// every test that calls the API also proves the reply matches the contract.
package apitest

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/openapi"
)

var (
	loadOnce sync.Once
	doc      *openapi3.T
	router   routers.Router
	loadErr  error
)

func load() {
	doc, loadErr = openapi3.NewLoader().LoadFromData(openapi.YAML())
	if loadErr != nil {
		return
	}
	if loadErr = doc.Validate(context.Background()); loadErr != nil {
		return
	}
	closeExtensibleEnums(doc)
	doc.Servers = nil // match paths on any host
	router, loadErr = gorillamux.NewRouter(doc)
}

// closeExtensibleEnums makes each component schema's x-extensible-enum its
// enum: clients are told such a set grows (a code newer than their document),
// but the gateway itself sends only the values its document lists.
func closeExtensibleEnums(doc *openapi3.T) {
	for _, ref := range doc.Components.Schemas {
		if values, ok := ref.Value.Extensions["x-extensible-enum"].([]any); ok {
			ref.Value.Enum = values
		}
	}
}

// Validate fails t unless resp (with its body) is a reply the document allows
// for req: a declared status, content type, headers and a body matching the
// schema. It returns the body, which it has read and restored.
func Validate(t testing.TB, req *http.Request, resp *http.Response) []byte {
	t.Helper()
	loadOnce.Do(load)
	require.NoError(t, loadErr, "loading openapi.yaml")

	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body = io.NopCloser(bytes.NewReader(body))

	// A HEAD is answered as its path's GET operation, without the body.
	head := req.Method == http.MethodHead
	if resp.Header.Get("Content-Encoding") == "gzip" && !head {
		// A reply compressed as the request allowed (a client that asked
		// for gzip itself): validated, and returned, as it inflates.
		zr, err := gzip.NewReader(bytes.NewReader(body))
		require.NoError(t, err, "a reply said to be gzip")
		body, err = io.ReadAll(zr)
		require.NoError(t, err, "a reply said to be gzip inflates whole")
	}
	if head {
		get := req.Clone(req.Context())
		get.Method = http.MethodGet
		req = get
		require.Empty(t, body, "a reply to HEAD has no body")
	}
	route, pathParams, err := router.FindRoute(req)
	if err != nil {
		// Unknown routes have no operation; they must still use the error envelope.
		require.Equal(t, http.StatusNotFound, resp.StatusCode, "a request outside the document must be 404")
		return body
	}
	input := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{
			Request:    req,
			PathParams: pathParams,
			Route:      route,
			Options:    &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc},
		},
		Status: resp.StatusCode,
		Header: resp.Header,
		Body:   io.NopCloser(bytes.NewReader(body)),
		Options: &openapi3filter.Options{
			IncludeResponseStatus: true,
			MultiError:            true,
			ExcludeResponseBody:   head,
		},
	}
	require.NoError(t, openapi3filter.ValidateResponse(context.Background(), input),
		"reply %d to %s %s does not match openapi.yaml: %s", resp.StatusCode, req.Method, req.URL.Path, body)
	return body
}
