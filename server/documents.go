package server

import (
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway/gen/api"
)

// ifNoneMatch is the header of a conditional request for a document.
const ifNoneMatch = "If-None-Match"

// documentCaching is how long clients and shared caches may keep the two
// public documents before revalidating them.
const documentCaching = "public, max-age=300"

// document is one of the two public documents, encoded once at start, with
// the entity tag that names its content.
type document struct {
	contentType string
	body        []byte
	tag         string
}

// newDocument returns body as a document of contentType. Its tag is weak
// (W/"…"): the document compressed and not is the same content, and
// If-None-Match compares weakly anyway. The tag is a digest of the body, so
// replicas serving the same document give the same tag.
func newDocument(contentType string, body []byte) document {
	sum := sha256.Sum256(body)
	return document{contentType: contentType, body: body, tag: `W/"` + base64.RawURLEncoding.EncodeToString(sum[:18]) + `"`}
}

// documentReply is a reply of either document's operation.
type documentReply interface {
	api.GetOpenAPIResponseObject
	api.GetJSONSchemaResponseObject
}

// reply is the document, or 304 Not Modified when ifNoneMatch (the request's
// If-None-Match, nil: none) names it.
func (d document) reply(ifNoneMatch *string) documentReply {
	if ifNoneMatch != nil && namesTag(*ifNoneMatch, d.tag) {
		return api.DocumentNotModifiedResponse{Headers: api.DocumentNotModifiedResponseHeaders{CacheControl: documentCaching, ETag: d.tag}}
	}
	return d
}

func (d document) write(w http.ResponseWriter) error {
	h := w.Header()
	h.Set("Content-Type", d.contentType)
	h.Set("Cache-Control", documentCaching)
	h.Set("ETag", d.tag)
	w.WriteHeader(http.StatusOK)
	_, err := w.Write(d.body)
	return err
}

// VisitGetOpenAPIResponse implements api.GetOpenAPIResponseObject.
func (d document) VisitGetOpenAPIResponse(w http.ResponseWriter) error { return d.write(w) }

// VisitGetJSONSchemaResponse implements api.GetJSONSchemaResponseObject.
func (d document) VisitGetJSONSchemaResponse(w http.ResponseWriter) error { return d.write(w) }

// namesTag reports whether an If-None-Match value, "*" or a list of entity
// tags, names tag by the weak comparison (RFC 9110 §8.8.3.2: W/ aside, the
// quoted strings are equal). A malformed member ends the list: nothing after
// it is taken, so a value that does not parse is a copy that is not current.
func namesTag(value, tag string) bool {
	if strings.TrimSpace(value) == "*" {
		return true
	}
	opaque := strings.TrimPrefix(tag, "W/")
	for rest := value; ; {
		rest = strings.TrimLeft(rest, " \t,")
		if rest == "" {
			return false
		}
		rest = strings.TrimPrefix(rest, "W/")
		if !strings.HasPrefix(rest, `"`) {
			return false
		}
		end := strings.IndexByte(rest[1:], '"')
		if end < 0 {
			return false
		}
		if rest[:end+2] == opaque {
			return true
		}
		rest = rest[end+2:]
	}
}

// foldList folds the lines of header name, whose value is a comma-separated
// list (If-None-Match), into one line (RFC 9110 §5.3), for the generated
// server, which takes a header parameter from one line only.
func foldList(name string) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			h := c.Request().Header
			if lines := h.Values(name); len(lines) > 1 {
				h.Set(name, strings.Join(lines, ", "))
			}
			return next(c)
		}
	}
}
