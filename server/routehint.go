package server

import (
	"cmp"
	"net/http"
	"slices"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway/openapi"
)

// oneSegmentParams answers as no route (with the route it nearly is) a path
// whose parameter holds a slash: a parameter of the document is one
// segment, but the router's last one takes the rest of the path
// (/api/v1/sources/{id}/, /api/v1/sources/a/b).
func oneSegmentParams(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		for _, v := range c.ParamValues() {
			if strings.Contains(v, "/") {
				return noSuchRoute()
			}
		}
		return next(c)
	}
}

// routeTemplates are the document's operations, their paths split into
// segments, for a 404 to name the route a request nearly is.
type routeTemplates []routeTemplate

// routeTemplate is an operation's method and the segments of its path.
type routeTemplate struct {
	method   string
	segments []string
}

// newRouteTemplates reads policies' operations, ordered by path and method.
func newRouteTemplates(policies map[string]openapi.Policy) routeTemplates {
	t := make(routeTemplates, 0, len(policies))
	for _, p := range policies {
		t = append(t, routeTemplate{method: p.Method, segments: strings.Split(p.Path, "/")})
	}
	slices.SortFunc(t, func(a, b routeTemplate) int {
		return cmp.Or(slices.Compare(a.segments, b.segments), strings.Compare(a.method, b.method))
	})
	return t
}

// near is the path template of an operation of method (HEAD is GET's) that
// path is but for trailing slashes or the letter case of its fixed segments
// (`/api/v1/responses/`, `/API/V1/Responses`), or "" when there is none. A
// parameter's segment must not be empty: `/api/v1/batch//results` is near
// nothing.
func (t routeTemplates) near(method, path string) string {
	if method == http.MethodHead {
		method = http.MethodGet
	}
	segments := strings.Split(strings.TrimRight(path, "/"), "/")
	for _, r := range t {
		if r.method == method && len(r.segments) == len(segments) && matches(r.segments, segments) {
			return strings.Join(r.segments, "/")
		}
	}
	return ""
}

// matches says whether segments fill template: its fixed segments in any
// letter case, its parameters ({name}) with a segment that is not empty.
func matches(template, segments []string) bool {
	for i, want := range template {
		if strings.HasPrefix(want, "{") {
			if segments[i] == "" {
				return false
			}
		} else if !strings.EqualFold(want, segments[i]) {
			return false
		}
	}
	return true
}
