// Package filestamp tells versions of files apart by what stat says of
// them, for what reads files again when a rotation or an edit replaces them.
package filestamp

import (
	"os"
	"slices"
)

// Stamp is what stat says of some files, in order: a rewrite or a
// replacement changes a file's size or modification time, and a file gone,
// or back, changes whether it is there.
type Stamp []state

type state struct {
	size, modified int64 // bytes; nanoseconds since 1970
	missing        bool  // stat failed
}

// Of stamps the files at paths.
func Of(paths ...string) Stamp {
	s := make(Stamp, len(paths))
	for i, path := range paths {
		info, err := os.Stat(path)
		if err != nil {
			s[i].missing = true
			continue
		}
		s[i].size, s[i].modified = info.Size(), info.ModTime().UnixNano()
	}
	return s
}

// Equal reports whether s and o stamp the same versions.
func (s Stamp) Equal(o Stamp) bool { return slices.Equal(s, o) }
