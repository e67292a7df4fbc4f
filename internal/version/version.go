// Package version says which build of the gateway runs: its version, set
// when it is linked or taken from its module, and the source revision it
// was built from.
package version

import (
	"cmp"
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version and Revision are set when the binary is linked, for builds whose
// toolchain stamps no version control information (an image's, whose
// context leaves .git out; a machine with GOFLAGS=-buildvcs=false):
//
//	go build -ldflags "-X github.com/rungworks/gateway/internal/version.Version=v1.4.0 -X github.com/rungworks/gateway/internal/version.Revision=$(git rev-parse HEAD)"
//
// Left empty, Version is the module's as the toolchain stamps it (v1.4.0
// for a tagged commit or go install …@v1.4.0, a pseudo-version such as
// v0.0.0-20261207041431-ab0891588ea4+dirty for another commit of a
// checkout) or "devel", and Revision the commit it stamps, or "".
var (
	Version  string
	Revision string
)

// Info is what a build says of itself.
type Info struct {
	// Version is the release (v1.4.0), a pseudo-version of a commit, or
	// "devel" when the build says none.
	Version string
	// Revision is the source revision (a git commit), or "" when unknown.
	Revision string
	// Modified reports that the checkout had changes not committed.
	Modified bool
	// Go is the toolchain's version (go1.26.0).
	Go string
}

// Read returns the running binary's Info.
func Read() Info {
	bi, _ := debug.ReadBuildInfo()
	return read(bi, Version, Revision)
}

// read returns the Info of bi (nil when the binary has none), linked and
// linkedRevision overriding what bi says when set.
func read(bi *debug.BuildInfo, linked, linkedRevision string) Info {
	info := Info{Version: cmp.Or(linked, "devel"), Revision: linkedRevision, Go: runtime.Version()}
	if bi == nil {
		return info
	}
	if linked == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		info.Version = bi.Main.Version
	}
	info.Go = cmp.Or(bi.GoVersion, info.Go)
	if info.Revision != "" {
		return info
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.modified":
			info.Modified = s.Value == "true"
		}
	}
	return info
}

// String is the line `gateway --version` prints after the program's name:
// "devel (revision 1a2b3c…, modified, go1.26.0)".
func (i Info) String() string {
	revision := i.Revision
	if revision == "" {
		revision = "unknown"
	}
	if i.Modified {
		revision += ", modified"
	}
	return fmt.Sprintf("%s (revision %s, %s)", i.Version, revision, i.Go)
}
