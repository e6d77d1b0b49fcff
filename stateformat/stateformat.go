// Package stateformat says which versions of a state file's format a
// gpu-agent build reads, and decodes those files. A version is major.minor:
// a build reads a newer minor of a major it knows, skipping the fields that
// minor added, and refuses a newer major, so that a rollback keeps what the
// newer build recorded whenever the newer build only added to it.
package stateformat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Version is a format's version. A newer minor only adds fields, which a
// reader that does not know them can do without: their absence means what
// it meant in the minor before. Anything else (a field dropped, or read in
// another way) is a new major.
type Version struct {
	Major, Minor int
}

// String is "major.minor".
func (v Version) String() string { return strconv.Itoa(v.Major) + "." + strconv.Itoa(v.Minor) }

// Format is what a build knows of one file's format.
type Format struct {
	// Reads lists, oldest first, the newest minor of each major this
	// build reads; the last is the version it writes.
	Reads []Version
	// Unversioned is the version of a file (or record) that names none:
	// the format of the files written before they carried a version. The
	// zero Version reads none.
	Unversioned Version
}

// Current is the version this build writes.
func (f Format) Current() Version { return f.Reads[len(f.Reads)-1] }

// known returns the newest minor of major this build knows.
func (f Format) known(major int) (Version, bool) {
	for _, v := range f.Reads {
		if v.Major == major {
			return v, true
		}
	}
	return Version{}, false
}

// Describe says which versions this build reads, for messages: "1.0 to
// 4.0, and any newer 4.x".
func (f Format) Describe() string {
	var b strings.Builder
	if len(f.Reads) > 1 || f.Reads[0].Minor > 0 {
		b.WriteString(Version{Major: f.Reads[0].Major}.String() + " to ")
	}
	cur := f.Current()
	b.WriteString(cur.String())
	fmt.Fprintf(&b, ", and any newer %d.x", cur.Major)
	return b.String()
}

// NewerError is a file of a newer major version than this build reads: it
// was written by a newer build and means something this build cannot tell.
// It is not set aside: the newer build, run again, reads it.
type NewerError struct {
	Found  Version
	Format Format
}

func (e *NewerError) Error() string {
	return fmt.Sprintf("format %s, written by a newer gpu-agent; this build reads %s", e.Found, e.Format.Describe())
}

// header is what Decode reads first: the version fields alone, whatever
// else the object holds.
type header struct {
	Major *int `json:"version"`
	Minor *int `json:"minor"`
}

// Decode reads b, one JSON object, into v and returns its version (the
// "version" field is the major, "minor" the minor; a missing one is
// Unversioned's). A version this build knows is decoded strictly: a field
// it does not know means the bytes are not what that version wrote. A newer
// minor of a major it reads is decoded without the fields that minor added.
// A newer major is a *NewerError, and an older one it does not read an
// error; v is not to be used then.
func (f Format) Decode(b []byte, v any) (Version, error) {
	if !bytes.HasPrefix(bytes.TrimLeft(b, " \t\r\n"), []byte("{")) {
		return Version{}, errors.New("not a JSON object")
	}
	var h header
	if err := json.Unmarshal(b, &h); err != nil {
		return Version{}, err
	}
	got := f.Unversioned
	if h.Major != nil {
		got = Version{Major: *h.Major}
	}
	if h.Minor != nil {
		got.Minor = *h.Minor
	}
	if got.Minor < 0 {
		return got, fmt.Errorf("minor version %d", got.Minor)
	}
	known, ok := f.known(got.Major)
	switch {
	case got.Major > f.Current().Major:
		return got, &NewerError{Found: got, Format: f}
	case !ok:
		return got, fmt.Errorf("format %s, this build reads %s", got, f.Describe())
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if got.Minor <= known.Minor {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return got, err
	}
	if dec.More() {
		return got, errors.New("data after the JSON object")
	}
	return got, nil
}
