package config

import (
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/readmetest"
)

// TestTheREADMEsTableNamesEverySetting: every variable Config reads has a
// row of its own (or shares one) in the tables of the README's section
// "Configuration", so that a setting added is documented where operators
// look for it.
func TestTheREADMEsTableNamesEverySetting(t *testing.T) {
	t.Parallel()
	named := regexp.MustCompile("`((?:GATEWAY_|DATABASE_)[A-Z0-9_]+)`")
	rows := map[string]bool{}
	for _, line := range readmetest.Rows(t, "../README.md", "Configuration") {
		cells := strings.Split(line, "|")
		for _, m := range named.FindAllStringSubmatch(cells[1], -1) {
			rows[m[1]] = true
		}
	}
	require.True(t, rows["DATABASE_URL"], "the table's rows are read")
	require.Greater(t, len(settings), 30, "Config's settings are read")
	for _, name := range settings {
		require.True(t, rows[name], "%s has no row in the tables of the README's section \"Configuration\"", name)
	}
}
