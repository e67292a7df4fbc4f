# syntax=docker/dockerfile:1
# The gateway as a static binary on a distroless, non-root image.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/gateway ./cmd/gateway

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/gateway /usr/local/bin/gateway
USER nonroot:nonroot
# API and metrics.
EXPOSE 8080 9810
ENTRYPOINT ["/usr/local/bin/gateway"]
CMD ["serve"]
