package version

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkout is the build info the Go toolchain stamps on a binary built in
// a git checkout with changes not committed.
func checkout() *debug.BuildInfo {
	return &debug.BuildInfo{
		GoVersion: "go1.26.0",
		Main:      debug.Module{Path: "github.com/rungworks/gateway", Version: "(devel)"},
		Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
}

// TestReadTellsTheBuild: a checkout's build is devel at its stamped
// revision; a version and a revision set when linking win; a module
// installed at a version is that version; a binary without build info is
// devel of an unknown revision.
func TestReadTellsTheBuild(t *testing.T) {
	t.Parallel()
	require.Equal(t, Info{Version: "devel", Revision: "0123456789abcdef0123456789abcdef01234567", Modified: true, Go: "go1.26.0"}, read(checkout(), "", ""))
	require.Equal(t, Info{Version: "v1.4.0", Revision: "fedcba", Go: "go1.26.0"}, read(checkout(), "v1.4.0", "fedcba"))
	require.Equal(t, Info{Version: "v1.4.0", Revision: "0123456789abcdef0123456789abcdef01234567", Modified: true, Go: "go1.26.0"}, read(checkout(), "v1.4.0", ""))

	installed := checkout()
	installed.Main.Version, installed.Settings = "v1.3.2", nil
	require.Equal(t, Info{Version: "v1.3.2", Go: "go1.26.0"}, read(installed, "", ""))

	require.Equal(t, Info{Version: "devel", Go: runtime.Version()}, read(nil, "", ""))
}

// TestInfoString: the line names the version, the revision (or that it is
// unknown) with its changes, and the toolchain.
func TestInfoString(t *testing.T) {
	t.Parallel()
	require.Equal(t, "devel (revision 0123456789abcdef0123456789abcdef01234567, modified, go1.26.0)", read(checkout(), "", "").String())
	require.Equal(t, "v1.3.2 (revision unknown, go1.26.1)", Info{Version: "v1.3.2", Go: "go1.26.1"}.String())
}
