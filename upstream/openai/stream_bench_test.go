package openai

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/rungworks/gateway/upstream"
)

// BenchmarkReadStream reads a stream of 200 token deltas, as OpenAI sends
// them, with its usage and [DONE]: the work a stream's reader does per token.
func BenchmarkReadStream(b *testing.B) {
	var body bytes.Buffer
	body.WriteString("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
	for i := range 200 {
		fmt.Fprintf(&body, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" word%d\"},\"finish_reason\":null}]}\n\n", i)
	}
	body.WriteString("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n")
	body.WriteString("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":200}}\n\ndata: [DONE]\n\n")
	raw := body.Bytes()
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := readStream(bytes.NewReader(raw), maxLineBytes, maxLineBytes, func(bool) {}, func(upstream.Delta) error { return nil }); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseCompletion decodes a completion as OpenAI's API sends one
// with web search, its text citing a source, and its usage with its
// details (openAICompletion); BenchmarkReadWholeReply reads it as Complete
// does, from its body: the work a reply asked for whole (a JSON reply's, a
// batch item's) costs its reader.
func BenchmarkParseCompletion(b *testing.B) {
	raw := openAICompletion()
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseCompletion(raw); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkReadWholeReply(b *testing.B) {
	raw := openAICompletion()
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := readWhole(bytes.NewReader(raw), 64<<10); err != nil {
			b.Fatal(err)
		}
	}
}

// openAICompletion is a completion as OpenAI's API sends one with web
// search.
func openAICompletion() []byte {
	return []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"gpt-4o-mini",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"The answer, with a source for it, in a sentence or two of plain text.",` +
		`"annotations":[{"type":"url_citation","url_citation":{"url":"https://example.org/doc","title":"Example doc","start_index":4,"end_index":10}}]},` +
		`"logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":12,"completion_tokens":18,"total_tokens":30,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},` +
		`"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}`)
}
