// Package api holds the models and the Echo strict-server interface generated from
// openapi/openapi.yaml. Do not edit api.gen.go; run `make generate`.
package api
