# The gateway's developer commands. `make run` and `make test` are all a newcomer needs.
GO    ?= go
TOOLS := $(GO) tool -modfile=tools.mod
# testpg runs the command with TEST_DATABASE_URL on one throwaway PostgreSQL
# cluster (unless TEST_DATABASE_URL or DATABASE_URL is already set).
WITH_PG := $(GO) run ./internal/testdb/testpg

.PHONY: all generate check-generated build run test chaos fuzz lint bench clean

all: build

## generate: regenerate gen/ from openapi/openapi.yaml and the .sql queries
generate:
	$(TOOLS) oapi-codegen -config gen/api/oapi-codegen.yaml openapi/openapi.yaml
	$(TOOLS) oapi-codegen -config gen/client/oapi-codegen.yaml openapi/openapi.yaml
	$(TOOLS) sqlc generate

## check-generated: fail when `make generate` changes anything
check-generated: generate
	@git add -N gen && git diff --exit-code --stat -- gen || \
		(echo "generated code is stale: run make generate and commit" >&2; exit 1)

# The commit bin/gateway is built from (-dirty with changes not committed),
# for gateway --version and gateway_build_info where the toolchain stamps
# none (GOFLAGS=-buildvcs=false); empty outside a git checkout. VERSION, when
# set (make build VERSION=v1.4.0), is the version they say.
REVISION ?= $(shell git describe --always --dirty --abbrev=40 --exclude '*' 2>/dev/null)
VERSION  ?=
LDFLAGS  := -X github.com/rungworks/gateway/internal/version.Revision=$(REVISION) -X github.com/rungworks/gateway/internal/version.Version=$(VERSION)

## build: the gateway binary in bin/
build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/gateway ./cmd/gateway

## run: the embedded default (private PostgreSQL, simulator, a ready key); flags in ARGS, e.g. ARGS="--pg-port 0"
run: build
	./bin/gateway dev $(ARGS)

## test: every test, on a real PostgreSQL
test:
	$(WITH_PG) $(GO) test -race -count=1 ./...

## chaos: the end-to-end chaos test for CHAOS (make test runs it for 20s): replicas killed, PostgreSQL crashed, the upstream failing, under mixed load
CHAOS ?= 5m
chaos:
	GATEWAY_CHAOS=$(CHAOS) $(WITH_PG) $(GO) test -count=1 -run '^TestChaos$$' -timeout 0 -v ./e2e

## fuzz: each fuzz target for FUZZTIME executions (request decoding, upstream replies, streams and error bodies, the guard's bounds and HTTP/1.1 replies)
FUZZTIME ?= 20000x
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzBind$$' -fuzztime $(FUZZTIME) ./server
	$(GO) test -run '^$$' -fuzz '^FuzzExactFieldNames$$' -fuzztime $(FUZZTIME) ./server
	$(GO) test -run '^$$' -fuzz '^FuzzParseReply$$' -fuzztime $(FUZZTIME) ./upstream/openai
	$(GO) test -run '^$$' -fuzz '^FuzzReadStream$$' -fuzztime $(FUZZTIME) ./upstream/openai
	$(GO) test -run '^$$' -fuzz '^FuzzErrorSays$$' -fuzztime $(FUZZTIME) ./upstream/openai
	$(GO) test -run '^$$' -fuzz '^FuzzGuard$$' -fuzztime $(FUZZTIME) ./upstream
	$(GO) test -run '^$$' -fuzz '^FuzzReply$$' -fuzztime $(FUZZTIME) ./upstream/http1
	$(GO) test -run '^$$' -fuzz '^FuzzPrice$$' -fuzztime $(FUZZTIME) ./metering
	$(GO) test -run '^$$' -fuzz '^FuzzCounterMatchesTheCodec$$' -fuzztime $(FUZZTIME) ./metering

## lint: go vet, staticcheck, gofmt, the OpenAPI lints (Redocly, Spectral's spectral:oas) and no change to the contract that breaks a client generated from the released one (oasdiff)
lint:
	$(GO) vet ./...
	$(TOOLS) staticcheck ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^gen/')); \
		if [ -n "$$out" ]; then echo "gofmt would change: $$out" >&2; exit 1; fi
	npm ci --no-audit --no-fund --loglevel=error
	npx redocly lint openapi/openapi.yaml
	npx spectral lint --fail-severity=hint openapi/openapi.yaml
	$(TOOLS) oasdiff breaking --allow-external-refs=false --fail-on WARN openapi/released/v1.yaml openapi/openapi.yaml

## bench: Go benchmarks, then gateway vs. upstream-direct load (see docs/benchmarks.md)
bench: build
	$(WITH_PG) $(GO) test -run '^$$' -bench . -benchmem ./...
	$(GO) run ./bench/load -binary bin/gateway
	$(GO) run ./bench/load -binary bin/gateway -rates 1000 -connections 0 -tenants 5000 -warmup 12s -duration 60s -floor=false
	$(GO) run ./bench/load -binary bin/gateway -rates 1000 -connections 0 -uncited -floor=false
	$(GO) run ./bench/load -binary bin/gateway -rates 1000 -connections 0 -floor=false -backlog 5000000 -duration 20s
	$(GO) run ./bench/drain -binary bin/gateway -rounds 3
	$(GO) run ./bench/drain -binary bin/gateway -replicas 1 -probes 5 -capped
	$(GO) run ./bench/drain -binary bin/gateway -replicas 1 -probes 0 -output-bytes 4096
	$(GO) run ./bench/stream -binary bin/gateway

clean:
	rm -rf bin
