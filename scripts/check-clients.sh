#!/usr/bin/env bash
# Proves clients generate from the document the gateway serves: runs the
# gateway (embedded default), fetches /openapi.json, regenerates the Go client
# from it (it must equal the committed gen/client), generates a TypeScript
# client with openapi-typescript, which must type-check against a usage sample,
# compiles the served JSON Schema in Ajv and validates a reply with it,
# and generates a Go client and server with ogen (another generator family),
# which must compile and read a reply carrying an error code and fields newer
# than the document; and then follows the README's "Generating a client": its
# oapi-codegen command (the version tools.mod pins) and its Go call, built as
# written and run against the gateway.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
ogen=$(mktemp -d ./.ogen-check.XXXXXX) # inside the module, to build with tools.mod
readme=$(mktemp -d ./readme-client-XXXXXX) # inside the module, to build with its go.mod (an import path has no leading dot)
chmod 755 "$tmp" # as root, the private PostgreSQL runs as postgres and must reach it
pid=""
cleanup() {
	if [ -n "$pid" ]; then
		kill -INT "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	rm -rf "$tmp" "$ogen" "$readme"
}
trap cleanup EXIT

go build -o "$tmp/gateway" ./cmd/gateway
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
GATEWAY_LISTEN="127.0.0.1:$port" GATEWAY_METRICS_LISTEN=off DATABASE_URL= \
	"$tmp/gateway" dev --data "$tmp/data" --pg-port 0 >"$tmp/dev.log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do
	curl -sf "http://127.0.0.1:$port/openapi.json" -o "$tmp/served.json" && break
	sleep 0.1
done
[ -s "$tmp/served.json" ] || { cat "$tmp/dev.log"; echo "the gateway did not serve /openapi.json" >&2; exit 1; }

sed "s|^output: .*|output: $tmp/client.gen.go|" gen/client/oapi-codegen.yaml > "$tmp/client.yaml"
go tool -modfile=tools.mod oapi-codegen -config "$tmp/client.yaml" "$tmp/served.json"
diff -u gen/client/client.gen.go "$tmp/client.gen.go"
echo "Go client from the served document: identical to gen/client"

npx --no-install openapi-typescript "$tmp/served.json" -o "$tmp/api.d.ts" >/dev/null 2>&1
cat > "$tmp/usage.ts" <<'TS'
import type { components, paths } from "./api";
type ResponseRequest = components["schemas"]["ResponseRequest"];
type Reply = paths["/api/v1/responses"]["post"]["responses"]["200"]["content"]["application/json"];
type Batch = components["schemas"]["Batch"];
const request: ResponseRequest = { prompt: "hello", model: "instant", max_output_rungs: 100, stream: false };
function rungs(r: Reply): number { return r.usage.total_rungs; }
function done(b: Batch): boolean { return ["completed", "failed", "cancelled", "expired"].includes(b.status); }
export { request, rungs, done };
TS
npx --no-install tsc --noEmit --strict --skipLibCheck --target es2020 "$tmp/usage.ts"
echo "TypeScript client from the served document: type-checks"

# The JSON Schema the gateway serves compiles in Ajv as Ajv is mostly used
# (JSON Schema 2020-12, its strict defaults, formats asserted by ajv-formats)
# and describes what the gateway answers: a reply it sent validates, a
# request without its prompt does not.
curl -sf "http://127.0.0.1:$port/api/schema.json" -o "$tmp/schema.json"
key=""
for _ in $(seq 1 100); do
	key=$(grep -o 'igw_[a-z0-9]*' "$tmp/dev.log" | head -1 || true)
	[ -n "$key" ] && break
	sleep 0.1
done
[ -n "$key" ] || { cat "$tmp/dev.log"; echo "gateway dev printed no key" >&2; exit 1; }
curl -sf "http://127.0.0.1:$port/api/v1/responses" -H "Authorization: Bearer $key" \
	-H 'Content-Type: application/json' -d '{"prompt":"hello","web_search":true}' -o "$tmp/reply.json"
node - "$tmp/schema.json" "$tmp/reply.json" <<'JS'
const fs = require("fs");
const Ajv2020 = require("ajv/dist/2020").default;
const addFormats = require("ajv-formats");
const [schema, reply] = process.argv.slice(2).map((f) => JSON.parse(fs.readFileSync(f, "utf8")));
const ajv = new Ajv2020();
addFormats(ajv);
ajv.addSchema(schema, "gateway");
const check = (def, value, want) => {
  const valid = ajv.validate({ $ref: `gateway#/$defs/${def}` }, value);
  if (valid !== want) {
    console.error(`${def} ${JSON.stringify(value).slice(0, 300)}: valid ${valid}, want ${want}`, ajv.errors);
    process.exit(1);
  }
};
check("Response", reply, true);
check("ResponseRequest", { prompt: "hello", max_output_rungs: 100 }, true);
check("ResponseRequest", { max_output_rungs: 100 }, false);
check("ErrorEnvelope", { error: { code: "A_NEWER_CODE", message: "added later" } }, true);
JS
echo "JSON Schema served: compiles in Ajv (2020-12, strict, formats) and validates a reply"

# ogen does not generate the two operations whose replies are not JSON it
# knows (application/schema+json, text/event-stream); everything else must.
printf 'generator:\n  ignore_not_implemented: ["unsupported content types"]\n' > "$tmp/ogen.yml"
go tool -modfile=tools.mod ogen --config "$tmp/ogen.yml" --target "$ogen" --package gatewayclient --clean "$tmp/served.json" >"$tmp/ogen.log" 2>&1 ||
	{ cat "$tmp/ogen.log"; exit 1; }
go build -modfile=tools.mod "$ogen"
echo "ogen client and server from the served document: compile"

# ogen validates what it decodes against the document: a reply carrying an
# error code added after the client was generated must still be read (the
# document lists its codes as an extensible enum), and so must one carrying
# fields added since (replies gain fields within v1).
cat > "$ogen/newer_code_test.go" <<'GO'
package gatewayclient

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

type key struct{}

func (key) BearerAuth(context.Context, OperationName) (BearerAuth, error) {
	return BearerAuth{Token: "igw_test"}, nil
}

func TestAReplyNewerThanTheDocumentIsRead(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":{"code":"A_NEWER_CODE","message":"added later","param":"prompt"},"request_id":"r"}`))
	}))
	defer srv.Close()
	c, err := NewClient(srv.URL, key{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.CreateResponse(context.Background(), &ResponseRequest{Prompt: "hi"})
	if err != nil {
		t.Fatalf("a reply with a newer error code and fields was refused: %v", err)
	}
	bad, ok := res.(*BadRequestHeaders)
	if !ok || bad.Response.Error.Code != "A_NEWER_CODE" {
		t.Fatalf("reply %#v, want a 400 with code A_NEWER_CODE", res)
	}
}
GO
go test -modfile=tools.mod -count=1 "$ogen" >"$tmp/ogen-test.log" 2>&1 || { cat "$tmp/ogen-test.log"; exit 1; }
echo "ogen client from the served document: reads an error code and fields newer than the document"

# The README's way to a Go client, as a reader follows it: its oapi-codegen
# command (the version it names must be the one tools.mod pins), then its Go
# call, built as written inside a program and run against the gateway.
readme_version=$(grep -o 'oapi-codegen/v2/cmd/oapi-codegen@v[0-9.]*' README.md | head -1 | sed 's/.*@//')
pinned=$(awk '$1 == "github.com/oapi-codegen/oapi-codegen/v2" {print $2}' tools.mod)
[ -n "$readme_version" ] && [ "$readme_version" = "$pinned" ] ||
	{ echo "README.md names oapi-codegen ${readme_version:-(none)}, tools.mod pins ${pinned:-(none)}" >&2; exit 1; }
mkdir "$readme/gateway"
# The command's flags, from the line after its first: "-generate … gateway.json > gateway.gen.go".
flags=$(grep -A1 'oapi-codegen/v2/cmd/oapi-codegen@v' README.md | sed -n 2p | sed -n 's/^ *\(-.*\) gateway\.json > gateway\.gen\.go$/\1/p')
[ -n "$flags" ] || { echo "README.md's oapi-codegen command is not \"… gateway.json > gateway.gen.go\" on its second line" >&2; exit 1; }
# shellcheck disable=SC2086 # the flags are words
go tool -modfile=tools.mod oapi-codegen $flags "$tmp/served.json" >"$readme/gateway/gateway.gen.go"
call=$(awk '/^## Generating a client/ {in_section = 1; next} /^## / {in_section = 0}
	in_section && /^```go$/ {in_code = 1; next} in_code && /^```$/ {exit} in_code {print "\t" $0}' README.md)
[ -n "$call" ] || { echo "README.md's \"Generating a client\" has no Go block" >&2; exit 1; }
module=$(go list -m)
cat >"$readme/main.go" <<GO
package main

import (
	"context"
	"fmt"
	"net/http"
	"os"

	"$module/${readme#./}/gateway"
)

func main() {
	ctx := context.Background()
$(printf '%s\n' "$call" | sed "s|http://127.0.0.1:8080|http://127.0.0.1:$port|")
	if err != nil || res.JSON200 == nil {
		fmt.Fprintln(os.Stderr, "no reply:", err)
		os.Exit(1)
	}
}
GO
out=$(GATEWAY_KEY="$key" go run "$readme") || { cat "$readme/main.go"; exit 1; }
[[ "$out" =~ [^[:space:]]+\ [1-9][0-9]*$ ]] || { echo "the README's Go call printed \"$out\", want the content and its rungs" >&2; exit 1; }
echo "README's Go client call: builds as written and prints a reply (its content, then ${out##* } rungs)"
