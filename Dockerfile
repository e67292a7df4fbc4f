# syntax=docker/dockerfile:1
# The gateway as a static binary on a distroless, non-root image.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# What gateway --version and gateway_build_info say: the context leaves .git
# out, so the toolchain stamps no revision (docker build --build-arg
# GATEWAY_VERSION=v1.4.0 --build-arg GATEWAY_REVISION=$(git rev-parse HEAD) .).
ARG GATEWAY_VERSION=devel
ARG GATEWAY_REVISION=
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X github.com/rungworks/gateway/internal/version.Version=${GATEWAY_VERSION} -X github.com/rungworks/gateway/internal/version.Revision=${GATEWAY_REVISION}" -o /out/gateway ./cmd/gateway

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/gateway /usr/local/bin/gateway
USER nonroot:nonroot
# API and metrics.
EXPOSE 8080 9810
ENTRYPOINT ["/usr/local/bin/gateway"]
CMD ["serve"]
