package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
)

// jsonBinder decodes request bodies for the generated strict handlers: the body
// must be application/json, one JSON value, within the operation's size limit.
// Unknown fields are ignored. Every failure is INVALID_REQUEST naming the field,
// or REQUEST_TOO_LARGE.
type jsonBinder struct{}

// Bind implements echo.Binder.
func (jsonBinder) Bind(i any, c echo.Context) error {
	r := c.Request()
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
		return gateway.Errorf(gateway.EInvalidRequest, "Content-Type must be application/json")
	}
	dec := json.NewDecoder(r.Body)
	if err := dec.Decode(i); err != nil {
		return decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		if tooLarge(err) {
			return decodeError(err)
		}
		return gateway.Errorf(gateway.EInvalidRequest, "the body must hold exactly one JSON value")
	}
	return nil
}

func tooLarge(err error) bool {
	var mbe *http.MaxBytesError
	return errors.As(err, &mbe)
}

func decodeError(err error) error {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case tooLarge(err):
		return gateway.Errorf(gateway.ERequestTooLarge, "request body is larger than the limit of this route")
	case errors.As(err, &typeErr) && typeErr.Field != "":
		return gateway.Errorf(gateway.EInvalidRequest, "field %q: %s is not a valid %s", typeErr.Field, typeErr.Value, jsonType(typeErr.Type.String()))
	case errors.As(err, &typeErr):
		return gateway.Errorf(gateway.EInvalidRequest, "the body must be a JSON object")
	case errors.As(err, &syntaxErr):
		return gateway.Errorf(gateway.EInvalidRequest, "malformed JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.EOF):
		return gateway.Errorf(gateway.EInvalidRequest, "a JSON body is required")
	default:
		return gateway.Errorf(gateway.EInvalidRequest, "malformed JSON: %v", err)
	}
}

// jsonType names a Go type as the JSON value it accepts.
func jsonType(goType string) string {
	switch {
	case goType == "string" || strings.HasSuffix(goType, "string"):
		return "string"
	case goType == "bool":
		return "boolean"
	case strings.HasPrefix(goType, "uint"):
		return fmt.Sprintf("non-negative integer (%s)", goType)
	case strings.HasPrefix(goType, "int"):
		return "integer"
	case strings.HasPrefix(goType, "[]"):
		return "array"
	default:
		return "object"
	}
}

// limitBody bounds the request body: a declared Content-Length over the limit is
// refused at once, a chunked body when the decoder reads past it.
func limitBody(limit int64) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			r := c.Request()
			if r.ContentLength > limit {
				return gateway.Errorf(gateway.ERequestTooLarge, "request body is %d bytes; the limit of this route is %d bytes", r.ContentLength, limit)
			}
			r.Body = http.MaxBytesReader(c.Response(), r.Body, limit)
			return next(c)
		}
	}
}
