// Package docs holds the project's documents; its test checks what they cite.
package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// cited is a test, benchmark or fuzz target named in a document.
var cited = regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z][A-Za-z0-9_]*`)

// TestDocumentsCiteTestsThatExist: every test, benchmark and fuzz target the
// README, these documents and the OpenAPI document name as proof of a claim
// is defined in the module, so that a test renamed or dropped does not leave
// a claim that cites nothing.
func TestDocumentsCiteTestsThatExist(t *testing.T) {
	t.Parallel()
	defined := map[string]bool{}
	declared := regexp.MustCompile(`(?m)^func (?:\([^)]*\) )?((?:Test|Benchmark|Fuzz)[A-Za-z0-9_]*)\(`)
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".") && d.Name() != "..") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range declared.FindAllSubmatch(src, -1) {
			defined[string(m[1])] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.True(t, defined["TestDocumentsCiteTestsThatExist"], "the walk reads the module's tests")

	documents, err := filepath.Glob("*.md")
	require.NoError(t, err)
	documents = append(documents, "../README.md", "../openapi/openapi.yaml")
	for _, doc := range documents {
		text, err := os.ReadFile(doc)
		require.NoError(t, err)
		for _, name := range cited.FindAllString(string(text), -1) {
			require.True(t, defined[name], "%s cites %s, which no test file defines", doc, name)
		}
	}
}
