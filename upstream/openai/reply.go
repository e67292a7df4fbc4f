package openai

// The reply: the types a chat completion and a stream's events are decoded
// into, and what they say (content, thinking, evidence, usage, errors),
// read leniently wherever an upstream may send another shape.

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"math"
	"math/bits"
	"strconv"
	"strings"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/upstream"
)

// usage is a reply's or a stream's token counts, under Chat Completions'
// names or, as some servers send them in a chat completion, under those of
// OpenAI's Responses API (input_tokens, output_tokens), which stand in for
// counts of no tokens.
type usage struct {
	PromptTokens     tokenCount `json:"prompt_tokens"`
	CompletionTokens tokenCount `json:"completion_tokens"`
	InputTokens      tokenCount `json:"input_tokens"`
	OutputTokens     tokenCount `json:"output_tokens"`
	TotalTokens      tokenCount `json:"total_tokens"`
	// Details is completion_tokens_details, read only when the total says
	// it holds tokens the completion count does not (output): as it comes,
	// so that one of another shape fails nothing.
	Details json.RawMessage `json:"completion_tokens_details"`
}

// report puts the counts u reports in res. A count of no tokens leaves the
// one in res: a stream's usage may come in parts (the input's count in one
// event, the output's in a later one, the cached tokens in an event of
// their own after both) and counts that run never fall, so a count of no
// tokens after one is none; the metering counts a side with none with the
// tokenizer.
func (u *usage) report(res *upstream.Result) {
	res.UsageReported = true
	res.InputTokens, res.OutputTokens = cmp.Or(u.input(), res.InputTokens), cmp.Or(u.output(), res.OutputTokens)
}

// input is the input tokens u reports.
func (u *usage) input() uint64 { return uint64(cmp.Or(u.PromptTokens, u.InputTokens)) }

// output is the output tokens u reports. In OpenAI's API completion_tokens
// holds the reasoning tokens (completion_tokens_details.reasoning_tokens
// is a part of it, and total_tokens is prompt and completion tokens); xAI's
// counts them apart, on top of it, as its total_tokens shows (prompt,
// completion and reasoning tokens). So the reasoning tokens are added when,
// and only when, the total is that sum: a count is never taken twice, and a
// model's thinking is never free.
func (u *usage) output() uint64 {
	out := uint64(cmp.Or(u.CompletionTokens, u.OutputTokens))
	sum, carry := bits.Add64(u.input(), out, 0)
	if carry != 0 || uint64(u.TotalTokens) <= sum {
		return out // the usual total, or none
	}
	var details struct {
		ReasoningTokens tokenCount `json:"reasoning_tokens"`
	}
	_ = json.Unmarshal(u.Details, &details) // of another shape, it counts none
	if uint64(u.TotalTokens)-sum != uint64(details.ReasoningTokens) {
		return out
	}
	return out + uint64(details.ReasoningTokens)
}

// tokenCount is a count of tokens as an upstream reports it. A whole number
// is read as it is; one with a fraction (some servers estimate, some
// proxies weigh counts by cost: 2.25, 14417.92) is rounded up, as a part of
// a token is priced as a whole one; a number in a string is read as the
// number. Anything else (a negative number, another type) reads as 0, which
// the metering counts with the tokenizer as nothing reported, so that a
// reply is not lost for a count it cannot use; a count past uint64 reads as
// the most it holds, which the metering clamps. null leaves it as it is.
type tokenCount uint64

// UnmarshalJSON implements json.Unmarshaler.
func (c *tokenCount) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	if n, err := strconv.ParseUint(string(b), 10, 64); err == nil {
		*c = tokenCount(n) // the usual case
		return nil
	}
	if len(b) >= 2 && b[0] == '"' && b[len(b)-1] == '"' {
		b = b[1 : len(b)-1]
	}
	f, err := strconv.ParseFloat(string(b), 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange), !(f > 0):
		*c = 0 // not a count, negative or NaN
	case f >= math.MaxUint64:
		*c = math.MaxUint64
	default:
		*c = tokenCount(math.Ceil(f))
	}
	return nil
}

type annotation struct {
	Type        string    `json:"type"`
	URLCitation *citation `json:"url_citation"`
}

// citation is an annotation's url_citation: a source, and the characters
// of the content that cite it.
type citation struct {
	URL        string `json:"url"`
	Title      string `json:"title"`
	StartIndex int    `json:"start_index"`
	EndIndex   int    `json:"end_index"`
}

// spans reports whether the citation names characters of content: a start
// before its end, which is not past content's bytes (nor, then, its
// characters, fewer or as many).
func (c *citation) spans(content string) bool {
	return c.StartIndex >= 0 && c.StartIndex < c.EndIndex && c.EndIndex <= len(content)
}

// contents is how a message's or a delta's content is decoded: plainly
// (plainText), or leniently (parts) when a reply is decoded again (see
// mistyped). Either tells the content from the thinking it carried.
type contents interface {
	content() string
	reasoning() string
}

// plainText is content as a string, as OpenAI's API sends it.
type plainText string

func (t plainText) content() string { return string(t) }
func (plainText) reasoning() string { return "" }

// parts is the content of a message or a delta as a decoding of a reply
// reads it again when its content was not a string (see mistyped): a
// string, or, as Mistral's API sends it, an array of parts, whose parts of
// type text are the content, in order, and whose parts of type thinking
// (its reasoning models', their own parts of type text, or a string) are
// thinking; other parts (images, kinds not known) are neither.
type parts struct{ text, thinking string }

func (p parts) content() string   { return p.text }
func (p parts) reasoning() string { return p.thinking }

// UnmarshalJSON implements json.Unmarshaler; null leaves p as it is.
func (p *parts) UnmarshalJSON(b []byte) error {
	if len(b) == 0 || b[0] != '[' {
		var s *string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		if s != nil {
			*p = parts{text: *s}
		}
		return nil
	}
	var list []struct {
		Type     string          `json:"type"`
		Text     string          `json:"text"`
		Thinking json.RawMessage `json:"thinking"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return err
	}
	var text, thinking strings.Builder
	for _, part := range list {
		switch part.Type {
		case "text":
			text.WriteString(part.Text)
		case "thinking":
			var inner parts
			if inner.UnmarshalJSON(part.Thinking) == nil {
				thinking.WriteString(inner.text) // thinking is no deeper
			}
		}
	}
	*p = parts{text: text.String(), thinking: thinking.String()}
	return nil
}

// thinking is a reasoning model's thinking as an upstream sends it beside
// a message's or a delta's content: reasoning_content (DeepSeek's API, and
// the servers after it) or reasoning (OpenRouter's, vLLM's since its
// rename); servers between the two send both, with the same text. It is
// output the upstream charges for, never sent on (see
// upstream.Result.Reasoning).
type thinking struct {
	ReasoningContent *thought `json:"reasoning_content"`
	Reasoning        *thought `json:"reasoning"`
}

// reasoning is the thinking: reasoning_content, or else reasoning, so that
// text sent under both names counts once.
func (t *thinking) reasoning() string {
	if t.ReasoningContent != nil && *t.ReasoningContent != "" {
		return string(*t.ReasoningContent)
	}
	if t.Reasoning != nil {
		return string(*t.Reasoning)
	}
	return ""
}

// thought is one of thinking's fields: a string, read as it is. Anything
// else (a shape not known) is none, so that no reply fails for it; null
// leaves the field nil without a call.
type thought string

// UnmarshalJSON implements json.Unmarshaler.
func (t *thought) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if json.Unmarshal(b, &s) == nil {
			*t = thought(s)
		}
	}
	return nil
}

// mistyped reports whether err is the decoder's word that a value in a
// reply is not of the type its field is decoded as (a content that is an
// array of parts, an annotation of another shape): the reply is decoded
// again, leniently (its content as parts, its annotations as evidence). The
// usual reply is decoded once, by the plain types, at no cost of leniency.
func mistyped(err error) bool {
	if err == nil {
		return false // before te is declared, whose address escapes
	}
	var te *json.UnmarshalTypeError
	return errors.As(err, &te)
}

// annotationList is how a message's or a delta's annotations are decoded:
// plainly ([]annotation), or leniently (evidence) in a second pass.
type annotationList interface {
	~[]annotation
}

// chatResponse is a chat completion; C is its messages' content and A their
// annotations: plainText and []annotation, or parts and
// evidence[annotation] when the reply is decoded again leniently
// (mistyped).
type chatResponse[C contents, A annotationList] struct {
	Choices []struct {
		Message *struct {
			Content     C `json:"content"`
			Annotations A `json:"annotations"`
			thinking
		} `json:"message"`
		FinishReason finishReason `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
	// Error is an error some upstreams answer with status 200.
	Error *upstreamError `json:"error"`
	searchResults
}

// searchResults are the sources that Perplexity's API gives beside a
// reply's or an event's choices: its search results (a title, a URL, a
// snippet), and its citations (URLs alone), which are the same sources
// without their titles.
type searchResults struct {
	SearchResults evidence[searchResult] `json:"search_results"`
	Citations     evidence[citedLink]    `json:"citations"`
}

// searchResult is one of Perplexity's search results.
type searchResult struct {
	Title   string `json:"title"`
	URL     string `json:"url"`
	Snippet string `json:"snippet"`
}

// citedLink is a citation: a URL, as Perplexity's API sends one, or an
// object with a url and a title (or the name of its source), as other
// servers send one (tale's agents, beside a RAG citation's own fields).
type citedLink struct {
	URL   string `json:"url"`
	Title string `json:"title"`
}

// UnmarshalJSON implements json.Unmarshaler.
func (l *citedLink) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		return json.Unmarshal(b, &l.URL)
	}
	var o struct {
		URL    string `json:"url"`
		Title  string `json:"title"`
		Source string `json:"source"`
	}
	if err := json.Unmarshal(b, &o); err != nil {
		return err
	}
	l.URL, l.Title = o.URL, cmp.Or(o.Title, o.Source)
	return nil
}

// evidence is a list of sources an upstream sends beside its output,
// read as far as it is of the expected shape: an element of another shape
// is left empty (its URL empty, it names no source) and a list that is no
// list is none, so that a reply is never failed for its evidence. An
// element keeps its place, for the count of those taken (Perplexity
// repeats the list, grown, in every event).
type evidence[T any] []T

// UnmarshalJSON implements json.Unmarshaler.
func (e *evidence[T]) UnmarshalJSON(b []byte) error {
	var raw []json.RawMessage
	if json.Unmarshal(b, &raw) != nil {
		*e = nil // null, or not a list
		return nil
	}
	out := make(evidence[T], len(raw))
	for i, r := range raw {
		if json.Unmarshal(r, &out[i]) != nil {
			var zero T
			out[i] = zero
		}
	}
	*e = out
	return nil
}

// count is how many sources the search results, or else the citations,
// name.
func (s *searchResults) count() int {
	if len(s.SearchResults) > 0 {
		return len(s.SearchResults)
	}
	return len(s.Citations)
}

// from returns the sources from the i-th on, those without a URL left
// out; a source without a title (a citation) takes its URL as its title.
func (s *searchResults) from(i int) []gateway.Source {
	var out []gateway.Source
	if len(s.SearchResults) > 0 {
		for _, r := range s.SearchResults[min(i, len(s.SearchResults)):] {
			if r.URL != "" {
				out = append(out, gateway.Source{Title: cmp.Or(r.Title, r.URL), URL: r.URL, Snippet: r.Snippet})
			}
		}
		return out
	}
	for _, link := range s.Citations[min(i, len(s.Citations)):] {
		if link.URL != "" {
			out = append(out, gateway.Source{Title: cmp.Or(link.Title, link.URL), URL: link.URL})
		}
	}
	return out
}

// upstreamError is an error an upstream reports in a body or an event: an
// object with a message and maybe a code, as OpenAI's API sends it, or a
// string, as text-generation-inference does.
type upstreamError struct {
	Message string
	// Code is the object's code, if it is a string (OpenAI's are; other
	// servers send numbers, which are not kept).
	Code string
	// said is whether it says something. Beside a real answer some servers
	// send an error member that is empty (null, "", false, 0, {}, [], a
	// blank message: a struct serialized whole, as Copilot's API and
	// gateways before it do): that is no error.
	said bool
}

// present reports whether e, if any, is an error.
func (e *upstreamError) present() bool { return e != nil && e.said }

// what is what e says, for the log: its message, else its code.
func (e *upstreamError) what() string {
	return cmp.Or(errorMessage(e.Message), errorMessage(e.Code), "an error without a message")
}

// UnmarshalJSON decodes an error object's message and code, or an error
// string; a value of another type is its own message. Members of other
// types than these are none: an error is never unreadable.
func (e *upstreamError) UnmarshalJSON(b []byte) error {
	switch {
	case len(b) > 0 && b[0] == '"':
		if err := json.Unmarshal(b, &e.Message); err != nil {
			return err
		}
		e.said = strings.TrimSpace(e.Message) != ""
	case len(b) > 0 && b[0] == '{':
		var o struct {
			Message json.RawMessage `json:"message"`
			Code    json.RawMessage `json:"code"`
			Type    json.RawMessage `json:"type"`
		}
		_ = json.Unmarshal(b, &o)
		if json.Unmarshal(o.Message, &e.Message) != nil {
			e.Message = string(o.Message) // a message that is not a string
		}
		_ = json.Unmarshal(o.Code, &e.Code) // a code that is not a string is none
		e.said = says(o.Message) || says(o.Code) || says(o.Type)
	default:
		e.Message, e.said = string(b), says(b)
	}
	return nil
}

// says reports whether a JSON value, as the decoder hands one on (without
// the space around it), says something: it is not absent, null, false, 0,
// an empty object or list, or a blank string.
func says(v []byte) bool {
	switch string(v) {
	case "", "null", "false", "0", "{}", "[]":
		return false
	}
	if v[0] != '"' {
		return true
	}
	if bytes.IndexByte(v, '\\') < 0 {
		return len(bytes.TrimSpace(v[1:len(v)-1])) > 0 // the usual string, read as it is
	}
	var str string
	return json.Unmarshal(v, &str) != nil || strings.TrimSpace(str) != ""
}

// errorSays is what an error body or event says: its error's message,
// else its own message (as vLLM's error bodies and LM Studio's events give
// one), else its detail (FastAPI's: a string, or validation errors, of
// which the first's msg), else the body as it is, cut and cleaned
// (errorMessage); and its error's code, when it is a string. A body that is
// a list says what its first element says, as Google's APIs (Gemini's
// OpenAI-compatible one among them) send their errors in one. Members of
// other types than these are passed over.
func errorSays(body []byte) (message, code string) {
	var e struct {
		Error   *upstreamError  `json:"error"`
		Message string          `json:"message"`
		Detail  json.RawMessage `json:"detail"`
	}
	message = strings.TrimSpace(string(body))
	var list []json.RawMessage
	if strings.HasPrefix(message, "[") && json.Unmarshal(body, &list) == nil && len(list) > 0 {
		body = list[0]
	}
	_ = json.Unmarshal(body, &e) // what it could read
	switch detail := detailSays(e.Detail); {
	case e.Error.present() && e.Error.Message != "":
		message = e.Error.Message
	case e.Message != "":
		message = e.Message
	case detail != "":
		message = detail
	}
	if e.Error.present() {
		code = e.Error.Code
	}
	return errorMessage(message), code
}

// detailSays is what a FastAPI error body's detail says: the detail, if it
// is a string, or the msg of its first validation error.
func detailSays(detail json.RawMessage) string {
	var s string
	if json.Unmarshal(detail, &s) == nil {
		return strings.TrimSpace(s)
	}
	var errs []struct {
		Msg string `json:"msg"`
	}
	if json.Unmarshal(detail, &errs) == nil && len(errs) > 0 {
		return strings.TrimSpace(errs[0].Msg)
	}
	return ""
}
