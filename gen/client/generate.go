// Package client is a Go client of the gateway generated from
// openapi/openapi.yaml, as the gateway's users generate theirs; the end-to-end
// tests drive the gateway through it. Do not edit client.gen.go; run
// `make generate`.
package client
