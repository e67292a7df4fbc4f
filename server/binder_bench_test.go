package server

import (
	"bytes"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
)

// BenchmarkBind decodes a response request with a short prompt and with the
// longest the API takes: of one line, of lines of 60 bytes (each newline an
// escape in JSON), of newlines alone (an escape every other byte), and of
// two-byte characters (é).
func BenchmarkBind(b *testing.B) {
	for _, prompt := range []struct {
		name string
		text string
	}{
		{"prompt=76B", strings.Repeat("x", 76)},
		{fmt.Sprintf("prompt=%dB", gateway.MaxPromptBytes), strings.Repeat("x", gateway.MaxPromptBytes)},
		{fmt.Sprintf("prompt=%dB-lines", gateway.MaxPromptBytes), strings.Repeat(strings.Repeat("x", 59)+"\n", gateway.MaxPromptBytes/60)},
		{fmt.Sprintf("prompt=%dB-escapes", gateway.MaxPromptBytes), strings.Repeat("\n", gateway.MaxPromptBytes/2)},
		{fmt.Sprintf("prompt=%dB-accents", gateway.MaxPromptBytes), strings.Repeat("é", gateway.MaxPromptBytes/2)},
	} {
		body := fmt.Appendf(nil, `{"prompt":%q,"max_output_rungs":200,"web_search":true}`, prompt.text)
		b.Run(prompt.name, func(b *testing.B) {
			e := echo.New()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				req := httptest.NewRequest("POST", "/api/v1/responses", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				var r api.ResponseRequest
				if err := (jsonBinder{}).Bind(&r, e.NewContext(req, httptest.NewRecorder())); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
