// Package readmetest reads the README's tables, for tests that keep it
// current with the code.
package readmetest

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Rows returns the rows of the tables in the section "## heading" of the
// README at path: the lines that start with "| ", a table's header among
// them (its rule, "|---|", is not). It fails t when the file or the section
// is missing.
func Rows(t testing.TB, path, heading string) []string {
	t.Helper()
	readme, err := os.ReadFile(path)
	require.NoError(t, err)
	_, section, found := strings.Cut(string(readme), "\n## "+heading+"\n")
	require.True(t, found, "%s has its section %q", path, heading)
	section, _, _ = strings.Cut(section, "\n## ")
	var rows []string
	for _, line := range strings.Split(section, "\n") {
		if strings.HasPrefix(line, "| ") {
			rows = append(rows, line)
		}
	}
	return rows
}
