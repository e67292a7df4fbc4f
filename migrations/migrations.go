// Package migrations embeds the goose SQL migrations of the gateway's schema.
package migrations

import "embed"

// FS holds every migration file, applied in version order.
//
//go:embed *.sql
var FS embed.FS
