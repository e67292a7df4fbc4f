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
// longest the API takes.
func BenchmarkBind(b *testing.B) {
	for _, size := range []int{76, gateway.MaxPromptBytes} {
		body := fmt.Appendf(nil, `{"prompt":%q,"max_output_rungs":200,"web_search":true}`, strings.Repeat("x", size))
		b.Run(fmt.Sprintf("prompt=%dB", size), func(b *testing.B) {
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
