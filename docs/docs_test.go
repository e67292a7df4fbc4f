// Package docs holds the project's documents; its tests check what they cite
// and that the README's layout names every package.
package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/readmetest"
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
	for _, path := range goFiles(t) {
		if !strings.HasSuffix(path, "_test.go") {
			continue
		}
		src, err := os.ReadFile(filepath.Join("..", path))
		require.NoError(t, err)
		for _, m := range declared.FindAllSubmatch(src, -1) {
			defined[string(m[1])] = true
		}
	}
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

// TestTheLayoutNamesEveryPackage: every folder of Go files in the module
// (generated, test helpers and benchmarks included) is named in a row of the
// README's table "Layout", so that a package added is placed where a newcomer
// looks for it.
func TestTheLayoutNamesEveryPackage(t *testing.T) {
	t.Parallel()
	rows := strings.Join(readmetest.Rows(t, "../README.md", "Layout"), "\n")
	folders := map[string]bool{}
	for _, path := range goFiles(t) {
		if dir := filepath.ToSlash(filepath.Dir(path)); dir != "." {
			folders[dir] = true
		}
	}
	require.True(t, folders["server"] && folders["internal/testdb/testpg"], "the walk reads the module's folders")
	for dir := range folders {
		named := strings.Contains(rows, "`"+dir+"/") || strings.Contains(rows, "`"+dir+"`")
		require.True(t, named, "%s is not named in the README's table \"Layout\"", dir)
	}
}

// goFiles returns the module's Go files, as paths from its root, outside
// node_modules, test data and hidden folders.
func goFiles(t *testing.T) []string {
	t.Helper()
	var paths []string
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != ".." && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") {
			rel, err := filepath.Rel("..", path)
			if err != nil {
				return err
			}
			paths = append(paths, rel)
		}
		return nil
	})
	require.NoError(t, err)
	return paths
}
