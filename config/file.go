package config

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"golang.org/x/net/http/httpguts"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/routing"
	"github.com/rungworks/gateway/upstream/openai"
)

// File is a parsed configuration file (GATEWAY_CONFIG): named providers, the
// targets of each canonical model, and the bounds of fallback and circuits.
type File struct {
	path      string
	Providers map[string]ProviderSpec
	Models    map[gateway.Model]RouteSpec
	// MaxAttempts, MaxTime and Circuit are zero where the file leaves them out.
	MaxAttempts int
	MaxTime     time.Duration
	Circuit     routing.CircuitConfig
}

// ProviderSpec is one upstream provider of the file.
type ProviderSpec struct {
	// Type is "openai" (an OpenAI-compatible API, the default) or "sim".
	Type    string
	BaseURL string
	// APIKeyEnv names the environment variable holding the key: the file
	// never holds a secret.
	APIKeyEnv string
	// APIKeyFile names a file holding the key (a mounted secret), read at
	// every load, so a rotated key is taken on a reload; relative to the
	// configuration file's folder.
	APIKeyFile string
	// APIKeyHeader names the header that carries the key as it is
	// (openai.Config.APIKeyHeader); empty sends it as a bearer token.
	APIKeyHeader string
	Timeout      time.Duration
	// StreamLimit bounds a stream's call, however long the upstream keeps it
	// going; zero takes openai.Config's default.
	StreamLimit time.Duration
	// IdleTimeout is how long an idle connection is kept for the next call;
	// zero takes openai.Config's default.
	IdleTimeout time.Duration
	// PingAfter is how long an HTTP/2 connection may be silent before it is
	// pinged (openai.Config.PingAfter); zero takes its default.
	PingAfter time.Duration
	H2C       bool
	Headers   map[string]string
	// MaxTokensField names the field of a call's output limit
	// (openai.Config.MaxTokensField); empty takes its default.
	MaxTokensField string
	// NoStreamOptions leaves stream_options out of stream calls
	// (openai.Config.NoStreamOptions), for servers that refuse it.
	NoStreamOptions bool
	line            int
}

// maxTokensField reports whether name may name the field of a call's output
// limit: empty (the default), openai.MaxCompletionTokens or openai.MaxTokens.
func maxTokensField(name string) bool {
	return name == "" || name == openai.MaxCompletionTokens || name == openai.MaxTokens
}

// RouteSpec is the targets of one canonical model.
type RouteSpec struct {
	Strategy routing.Strategy
	Targets  []TargetSpec
}

// TargetSpec is "provider/upstream-model", with its weight.
type TargetSpec struct {
	Provider      string
	UpstreamModel string
	Weight        int
	line          int
}

// LoadFile reads and checks a configuration file. Every problem found is
// reported, each with the line it is on.
func LoadFile(path string) (*File, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("error reading the configuration file: %w", err)
	}
	return ParseFile(path, raw)
}

// ParseFile parses a configuration file's content; path names it in messages.
func ParseFile(path string, raw []byte) (*File, error) {
	p := &fileParser{f: &File{path: path, Providers: map[string]ProviderSpec{}, Models: map[gateway.Model]RouteSpec{}}}
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(doc.Content) == 0 {
		return nil, fmt.Errorf("%s: the file is empty; it needs providers and models", path)
	}
	p.root(doc.Content[0])
	if len(p.errs) > 0 {
		return nil, errors.Join(p.errs...)
	}
	return p.f, nil
}

// maxKeyFile bounds what is read of an api_key_file.
const maxKeyFile = 16 << 10

// Keys reads every provider's key, by provider name: from the environment
// variable it names (api_key_env), or from the file it names (api_key_file,
// read now, white space around the key trimmed). Every provider whose key
// is missing or unreadable is reported, with its line.
func (f *File) Keys(getenv func(string) string) (map[string]string, error) {
	keys := map[string]string{}
	var errs []error
	for _, name := range f.providerNames() {
		pr := f.Providers[name]
		switch {
		case pr.APIKeyEnv != "":
			keys[name] = getenv(pr.APIKeyEnv)
			if keys[name] == "" {
				errs = append(errs, fmt.Errorf("%s:%d: provider %q: the environment variable %s (api_key_env) is not set", f.path, pr.line, name, pr.APIKeyEnv))
			}
		case pr.APIKeyFile != "":
			key, err := readKey(f.keyPath(pr.APIKeyFile))
			if err != nil {
				errs = append(errs, fmt.Errorf("%s:%d: provider %q: api_key_file: %w", f.path, pr.line, name, err))
			}
			keys[name] = key
		}
	}
	return keys, errors.Join(errs...)
}

// keyFiles are the key files the providers name (api_key_file), resolved.
func (f *File) keyFiles() []string {
	var files []string
	for _, pr := range f.Providers {
		if pr.APIKeyFile != "" {
			files = append(files, f.keyPath(pr.APIKeyFile))
		}
	}
	slices.Sort(files)
	return files
}

// keyPath resolves an api_key_file against the configuration file's folder.
func (f *File) keyPath(name string) string {
	if filepath.IsAbs(name) {
		return name
	}
	return filepath.Join(filepath.Dir(f.path), name)
}

// readKey reads a key file: one line, nothing else but white space around it.
func readKey(path string) (string, error) {
	file, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer file.Close()
	raw, err := io.ReadAll(io.LimitReader(file, maxKeyFile+1))
	if err != nil {
		return "", fmt.Errorf("error reading %s: %w", path, err)
	}
	key := strings.TrimSpace(string(raw))
	switch {
	case len(raw) > maxKeyFile:
		return "", fmt.Errorf("%s is larger than a key (%d bytes at most)", path, maxKeyFile)
	case key == "":
		return "", fmt.Errorf("%s is empty", path)
	case strings.ContainsFunc(key, func(r rune) bool { return r < ' ' || r == 0x7f }):
		return "", fmt.Errorf("%s holds more than a key (a line break or a control character)", path)
	}
	return key, nil
}

func (f *File) providerNames() []string {
	names := make([]string, 0, len(f.Providers))
	for name := range f.Providers {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

type fileParser struct {
	f    *File
	errs []error
}

func (p *fileParser) errorf(n *yaml.Node, format string, args ...any) {
	p.errs = append(p.errs, fmt.Errorf("%s:%d: %s", p.f.path, n.Line, fmt.Sprintf(format, args...)))
}

// mapping calls fn for each key of a mapping node, refusing keys not in known.
func (p *fileParser) mapping(n *yaml.Node, what string, known []string, fn func(key string, k, v *yaml.Node)) {
	if n.Kind != yaml.MappingNode {
		p.errorf(n, "%s must be a mapping", what)
		return
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		switch {
		case known != nil && !slices.Contains(known, k.Value):
			p.errorf(k, "unknown key %q in %s (known: %s)", k.Value, what, strings.Join(known, ", "))
		case seen[k.Value]:
			p.errorf(k, "key %q appears twice in %s", k.Value, what)
		default:
			seen[k.Value] = true
			fn(k.Value, k, v)
		}
	}
}

func (p *fileParser) root(n *yaml.Node) {
	var providers, models *yaml.Node
	p.mapping(n, "the file", []string{"providers", "models", "fallback", "circuit"}, func(key string, _, v *yaml.Node) {
		switch key {
		case "providers":
			providers = v
		case "models":
			models = v
		case "fallback":
			p.mapping(v, "fallback", []string{"max_attempts", "max_time"}, func(key string, _, v *yaml.Node) {
				if key == "max_attempts" {
					p.f.MaxAttempts = p.positiveInt(v, "fallback.max_attempts")
				} else {
					p.f.MaxTime = p.duration(v, "fallback.max_time")
				}
			})
		case "circuit":
			p.mapping(v, "circuit", []string{"failures", "cooldown", "max_cooldown"}, func(key string, _, v *yaml.Node) {
				switch key {
				case "failures":
					p.f.Circuit.Failures = p.positiveInt(v, "circuit.failures")
				case "cooldown":
					p.f.Circuit.Cooldown = p.duration(v, "circuit.cooldown")
				default:
					p.f.Circuit.MaxCooldown = p.duration(v, "circuit.max_cooldown")
				}
			})
		}
	})
	if providers == nil || models == nil {
		p.errorf(n, "the file needs both providers and models")
		return
	}
	p.mapping(providers, "providers", nil, func(name string, k, v *yaml.Node) { p.provider(name, k, v) })
	p.mapping(models, "models", nil, func(name string, k, v *yaml.Node) { p.model(name, k, v) })
	if len(p.f.Models) == 0 && len(p.errs) == 0 {
		p.errorf(models, "models must route at least one canonical model (instant, reasoning, elements)")
	}
	if c := p.f.Circuit; c.MaxCooldown > 0 && c.Cooldown > c.MaxCooldown {
		p.errorf(n, "circuit.cooldown (%s) must not exceed circuit.max_cooldown (%s)", c.Cooldown, c.MaxCooldown)
	}
}

func (p *fileParser) provider(name string, k, v *yaml.Node) {
	if name == "" || strings.ContainsAny(name, "/ \t") {
		p.errorf(k, "provider name %q must be non-empty, without '/' or spaces", name)
		return
	}
	spec := ProviderSpec{Type: "openai", line: k.Line}
	what := fmt.Sprintf("provider %q", name)
	p.mapping(v, what, []string{"type", "base_url", "api_key_env", "api_key_file", "api_key_header", "timeout", "stream_limit", "idle_timeout", "ping_after", "h2c", "max_tokens_field", "stream_options", "headers"}, func(key string, _, v *yaml.Node) {
		switch key {
		case "type":
			spec.Type = p.str(v, what+" type")
			if spec.Type != "openai" && spec.Type != "sim" {
				p.errorf(v, "%s: type must be openai or sim, got %q", what, spec.Type)
			}
		case "base_url":
			spec.BaseURL = p.str(v, what+" base_url")
			if problem := baseURLProblem(spec.BaseURL); problem != "" {
				p.errorf(v, "%s: base_url %s", what, problem)
			}
		case "api_key_env":
			spec.APIKeyEnv = p.str(v, what+" api_key_env")
			if strings.HasPrefix(spec.APIKeyEnv, "sk-") || strings.ContainsAny(spec.APIKeyEnv, " =$") {
				p.errorf(v, "%s: api_key_env names an environment variable (e.g. OPENAI_API_KEY); never put the key itself in the file", what)
			}
		case "api_key_file":
			spec.APIKeyFile = p.str(v, what+" api_key_file")
		case "api_key_header":
			spec.APIKeyHeader = p.str(v, what+" api_key_header")
			if problem := headerProblem(spec.APIKeyHeader); problem != "" {
				p.errorf(v, "%s: api_key_header %s", what, problem)
			}
		case "timeout":
			spec.Timeout = p.duration(v, what+" timeout")
		case "stream_limit":
			spec.StreamLimit = p.duration(v, what+" stream_limit")
		case "idle_timeout":
			spec.IdleTimeout = p.duration(v, what+" idle_timeout")
		case "ping_after":
			spec.PingAfter = p.duration(v, what+" ping_after")
		case "h2c":
			spec.H2C = p.boolean(v, what+" h2c")
		case "max_tokens_field":
			spec.MaxTokensField = p.str(v, what+" max_tokens_field")
			if spec.MaxTokensField == "" || !maxTokensField(spec.MaxTokensField) {
				p.errorf(v, "%s: max_tokens_field must be %s (the default) or %s, got %q", what, openai.MaxCompletionTokens, openai.MaxTokens, spec.MaxTokensField)
			}
		case "stream_options":
			spec.NoStreamOptions = !p.boolean(v, what+" stream_options")
		case "headers":
			spec.Headers = map[string]string{}
			p.mapping(v, what+" headers", nil, func(h string, k, v *yaml.Node) {
				if problem := headerProblem(h); problem != "" {
					p.errorf(k, "%s: header %s", what, problem)
					return
				}
				spec.Headers[h] = p.str(v, what+" header "+h)
			})
		}
	})
	if spec.Type == "openai" && spec.BaseURL == "" {
		p.errorf(k, "%s needs a base_url", what)
	}
	if spec.APIKeyEnv != "" && spec.APIKeyFile != "" {
		p.errorf(k, "%s: give api_key_env or api_key_file, not both", what)
	}
	for h := range spec.Headers {
		if spec.APIKeyHeader != "" && http.CanonicalHeaderKey(h) == http.CanonicalHeaderKey(spec.APIKeyHeader) {
			p.errorf(k, "%s: header %s is api_key_header's: it carries the key", what, http.CanonicalHeaderKey(h))
		}
	}
	p.f.Providers[name] = spec
}

func (p *fileParser) model(name string, k, v *yaml.Node) {
	model, err := gateway.ParseModel(name)
	if err != nil || string(model) != name {
		p.errorf(k, "models: %q is not a canonical model (instant, reasoning, elements)", name)
		return
	}
	spec := RouteSpec{Strategy: routing.Ordered}
	what := "model " + name
	var targets *yaml.Node
	p.mapping(v, what, []string{"strategy", "targets"}, func(key string, _, v *yaml.Node) {
		if key == "strategy" {
			spec.Strategy = routing.Strategy(p.str(v, what+" strategy"))
			if spec.Strategy != routing.Ordered && spec.Strategy != routing.Weighted {
				p.errorf(v, "%s: strategy must be ordered or weighted, got %q", what, spec.Strategy)
			}
			return
		}
		targets = v
	})
	if targets == nil || targets.Kind != yaml.SequenceNode || len(targets.Content) == 0 {
		p.errorf(k, "%s needs a non-empty list of targets (provider/upstream-model)", what)
		return
	}
	seen := map[string]bool{}
	for _, t := range targets.Content {
		ts := p.target(t, what, spec.Strategy)
		if ts.Provider == "" {
			continue
		}
		if id := ts.Provider + "/" + ts.UpstreamModel; seen[id] {
			p.errorf(t, "%s: target %s is listed twice", what, id)
		} else {
			seen[id] = true
		}
		spec.Targets = append(spec.Targets, ts)
	}
	p.f.Models[model] = spec
}

// target parses "provider/upstream-model" or {target: ..., weight: N}.
func (p *fileParser) target(n *yaml.Node, what string, strategy routing.Strategy) TargetSpec {
	ts := TargetSpec{Weight: 1, line: n.Line}
	ref, refNode := "", n
	if n.Kind == yaml.MappingNode {
		weightSet := false
		p.mapping(n, what+" target", []string{"target", "weight"}, func(key string, _, v *yaml.Node) {
			if key == "target" {
				ref, refNode = p.str(v, what+" target"), v
			} else {
				ts.Weight, weightSet = p.positiveInt(v, what+" weight"), true
			}
		})
		if weightSet && strategy != routing.Weighted {
			p.errorf(n, "%s: weight is only used with strategy: weighted", what)
		}
	} else {
		ref = p.str(n, what+" target")
	}
	provider, model, ok := strings.Cut(ref, "/")
	if !ok || provider == "" || model == "" {
		if ref != "" {
			p.errorf(refNode, "%s: target %q must be provider/upstream-model", what, ref)
		}
		return TargetSpec{}
	}
	if _, known := p.f.Providers[provider]; !known {
		p.errorf(refNode, "%s: target %q names provider %q, which providers does not define", what, ref, provider)
		return TargetSpec{}
	}
	ts.Provider, ts.UpstreamModel = provider, model
	return ts
}

// httpURL reports whether s is an absolute http(s) URL with a host.
func httpURL(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// gatewayHeader reports whether the gateway sets the header (canonical)
// on every call itself, so that no setting may.
func gatewayHeader(canonical string) bool {
	switch canonical {
	case "Content-Type", "Accept", "Accept-Encoding", "Traceparent", "Tracestate", http.CanonicalHeaderKey(openai.HintsHeader):
		return true
	}
	return false
}

// headerProblem says, after the setting's name, what is wrong with name as
// a header a provider's calls carry from the settings (the key's, or another);
// "" when nothing is.
func headerProblem(name string) string {
	switch canonical := http.CanonicalHeaderKey(name); {
	case !httpguts.ValidHeaderFieldName(name):
		return fmt.Sprintf("%q is not a valid header name", name)
	case canonical == "Authorization":
		return "Authorization is set by the gateway: it carries the key, as a bearer token, unless another header is named for it"
	case gatewayHeader(canonical):
		return canonical + " is set by the gateway"
	}
	return ""
}

// baseURLProblem says, after the setting's name, what is wrong with s as an
// upstream's base URL; "" when nothing is. A query is kept on every call
// (Azure OpenAI's deployments take their api-version there). Credentials
// are refused, and not repeated: a call would not send them (the key goes
// in api_key_env, api_key_file or GATEWAY_UPSTREAM_KEY), and an error would
// print them.
func baseURLProblem(s string) string {
	if !httpURL(s) {
		return fmt.Sprintf("must be an http(s) URL such as https://api.openai.com/v1, got %q", s)
	}
	u, _ := url.Parse(s)
	switch {
	case u.User != nil:
		return "must not hold credentials (user:password@): give the upstream's key in api_key_env or api_key_file (GATEWAY_UPSTREAM_KEY in the shorthand), or another header in headers"
	case strings.Contains(s, "#"):
		return fmt.Sprintf("must not end in a fragment (#…): it is never sent, got %q", s)
	}
	return ""
}

func (p *fileParser) str(n *yaml.Node, what string) string {
	if n.Kind != yaml.ScalarNode || n.Tag == "!!null" {
		p.errorf(n, "%s must be a string", what)
		return ""
	}
	return n.Value
}

func (p *fileParser) positiveInt(n *yaml.Node, what string) int {
	var v int
	if n.Kind != yaml.ScalarNode || n.Decode(&v) != nil || v < 1 {
		p.errorf(n, "%s must be a whole number of at least 1, got %q", what, n.Value)
		return 0
	}
	return v
}

func (p *fileParser) duration(n *yaml.Node, what string) time.Duration {
	d, err := time.ParseDuration(n.Value)
	if n.Kind != yaml.ScalarNode || err != nil || d <= 0 {
		p.errorf(n, "%s must be a positive duration such as 30s or 2m, got %q", what, n.Value)
		return 0
	}
	return d
}

func (p *fileParser) boolean(n *yaml.Node, what string) bool {
	var v bool
	if n.Kind != yaml.ScalarNode || n.Decode(&v) != nil {
		p.errorf(n, "%s must be true or false, got %q", what, n.Value)
	}
	return v
}

// Describe lists the file's routes, one model per line, for operators.
func (f *File) Describe() string {
	var b strings.Builder
	for _, model := range gateway.Models {
		spec, ok := f.Models[model]
		if !ok {
			fmt.Fprintf(&b, "%-9s not served\n", model)
			continue
		}
		fmt.Fprintf(&b, "%-9s %s:", model, spec.Strategy)
		for _, t := range spec.Targets {
			fmt.Fprintf(&b, " %s/%s", t.Provider, t.UpstreamModel)
			if spec.Strategy == routing.Weighted {
				fmt.Fprintf(&b, " (weight %d)", t.Weight)
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}
