package config

import (
	"reflect"
	"regexp"
	"slices"
	"strings"
)

// Stray is a variable of the environment named as the gateway's settings
// are (GATEWAY_…) that the gateway does not read: a typo, or a setting of
// another version.
type Stray struct {
	// Name is the variable's name.
	Name string
	// Nearest is the variable it likely means (a setting, or a key's that
	// GATEWAY_CONFIG's file names), a typo or two away; or "".
	Nearest string
}

// settingPrefix begins the name of every setting but DATABASE_URL.
const settingPrefix = "GATEWAY_"

// settings are the names of the variables Config reads.
var settings = func() []string {
	var names []string
	t := reflect.TypeFor[Config]()
	for i := range t.NumField() {
		if name, ok := t.Field(i).Tag.Lookup("env"); ok {
			names = append(names, name)
		}
	}
	return names
}()

// otherUses are the names of the variables the documentation gives other
// uses than settings: the client's key in its examples (GATEWAY_KEY), the
// image's tag in docker-compose.yml (GATEWAY_VERSION) and the revision its
// build stamps (GATEWAY_REVISION).
var otherUses = []string{"GATEWAY_KEY", "GATEWAY_VERSION", "GATEWAY_REVISION"}

// serviceLinks are the names of the variables Kubernetes sets in a pod for
// each service of its namespace, for a service named gateway or gateway-…
// (GATEWAY_SERVICE_HOST, GATEWAY_PORT_8080_TCP_ADDR): not settings.
var serviceLinks = regexp.MustCompile(`_SERVICE_HOST$|_SERVICE_PORT$|_SERVICE_PORT_|_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?$`)

// Strays returns the strays of environ (as os.Environ gives it), in its
// order, leaving out the variables GATEWAY_CONFIG's file names for its
// providers' keys (api_key_env), otherUses and the variables Kubernetes
// sets for services.
func (c Config) Strays(environ []string) []Stray {
	read := slices.Concat(settings, otherUses)
	if f, err := c.routes(); err == nil { // one that does not load stops the start anyway
		for _, p := range f.Providers {
			read = append(read, p.APIKeyEnv)
		}
	}
	var strays []Stray
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, settingPrefix) || slices.Contains(read, name) || serviceLink(name, value) {
			continue
		}
		strays = append(strays, Stray{Name: name, Nearest: nearest(name, read)})
	}
	return strays
}

// serviceLink reports whether name=value is a variable Kubernetes sets for
// a service: its address (GATEWAY_PORT=tcp://10.0.0.7:8080) or its parts.
func serviceLink(name, value string) bool {
	if serviceLinks.MatchString(name) {
		return true
	}
	return strings.HasSuffix(name, "_PORT") &&
		(strings.HasPrefix(value, "tcp://") || strings.HasPrefix(value, "udp://") || strings.HasPrefix(value, "sctp://"))
}

// maxTypos is how many letters a stray's name may have wrong, missing or
// extra and still be taken for the name of a variable the gateway reads.
const maxTypos = 2

// nearest is the one of names fewest edits from name, when that is maxTypos
// or fewer; or "".
func nearest(name string, names []string) string {
	best, bestDistance := "", maxTypos+1
	for _, s := range names {
		if d := distance(name, s); d < bestDistance {
			best, bestDistance = s, d
		}
	}
	return best
}

// distance is the Levenshtein distance between a and b: the fewest letters
// inserted, deleted or replaced that turn one into the other.
func distance(a, b string) int {
	previous := make([]int, len(b)+1)
	current := make([]int, len(b)+1)
	for j := range previous {
		previous[j] = j
	}
	for i := 1; i <= len(a); i++ {
		current[0] = i
		for j := 1; j <= len(b); j++ {
			replace := previous[j-1]
			if a[i-1] != b[j-1] {
				replace++
			}
			current[j] = min(previous[j]+1, current[j-1]+1, replace)
		}
		previous, current = current, previous
	}
	return previous[len(b)]
}
