package stateformat

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// record stands for a state file's content at version 2.1: a field of 2.0
// and the version fields.
type record struct {
	Version int    `json:"version,omitempty"`
	Minor   int    `json:"minor,omitempty"`
	Name    string `json:"name"`
}

var format = Format{Reads: []Version{{1, 0}, {2, 1}}, Unversioned: Version{1, 0}}

func TestDecode(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     Version
		wantName string
		// err is a part of the error wanted ("": none); newer, that it is
		// a *NewerError.
		err   string
		newer bool
	}{
		{name: "unversioned is 1.0", in: `{"name":"a"}`, want: Version{1, 0}, wantName: "a"},
		{name: "current", in: `{"version":2,"minor":1,"name":"a"}`, want: Version{2, 1}, wantName: "a"},
		{name: "older minor", in: `{"version":2,"name":"a"}`, want: Version{2, 0}, wantName: "a"},
		{name: "unknown field of a known version", in: `{"version":2,"minor":1,"name":"a","new":1}`, want: Version{2, 1}, err: `unknown field "new"`},
		{name: "unknown field of an unversioned file", in: `{"name":"a","new":1}`, want: Version{1, 0}, err: `unknown field "new"`},
		{name: "newer minor skips what it added", in: `{"version":2,"minor":7,"name":"a","new":{"x":[1]}}`, want: Version{2, 7}, wantName: "a"},
		{name: "newer minor of an older major", in: `{"version":1,"minor":3,"name":"a","new":1}`, want: Version{1, 3}, wantName: "a"},
		{name: "newer major", in: `{"version":3,"name":"a"}`, want: Version{3, 0}, err: "format 3.0, written by a newer gpu-agent; this build reads 1.0 to 2.1, and any newer 2.x", newer: true},
		{name: "newer major, minor too", in: `{"version":3,"minor":2,"name":"a","new":1}`, want: Version{3, 2}, err: "format 3.2", newer: true},
		{name: "unknown older major", in: `{"version":0,"name":"a"}`, want: Version{0, 0}, err: "format 0.0, this build reads 1.0 to 2.1"},
		{name: "negative minor", in: `{"version":2,"minor":-1,"name":"a"}`, want: Version{2, -1}, err: "minor version -1"},
		{name: "version of another type", in: `{"version":"2","name":"a"}`, err: "cannot unmarshal"},
		{name: "data after the object", in: `{"name":"a"} {}`, err: "after top-level value"},
		{name: "not JSON", in: `{"name":`, err: "unexpected end"},
		{name: "not an object", in: ` null`, err: "not a JSON object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r record
			got, err := format.Decode([]byte(tc.in), &r)
			var newer *NewerError
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("error %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("error %v, want one with %q", err, tc.err)
			case errors.As(err, &newer) != tc.newer:
				t.Fatalf("error %v: newer %t, want %t", err, !tc.newer, tc.newer)
			case got != tc.want:
				t.Fatalf("version %s, want %s", got, tc.want)
			case tc.err == "" && r.Name != tc.wantName:
				t.Fatalf("name %q, want %q", r.Name, tc.wantName)
			}
		})
	}
}

// A format none of whose files went without a version refuses a file that
// names none.
func TestDecodeUnversionedNotRead(t *testing.T) {
	f := Format{Reads: []Version{{4, 0}}}
	if _, err := f.Decode([]byte(`{"name":"a"}`), &record{}); err == nil || !strings.Contains(err.Error(), "format 0.0, this build reads 4.0, and any newer 4.x") {
		t.Fatalf("error %v", err)
	}
}

// Whatever the bytes, Decode refuses them or gives what it decoded with the
// version it says, and a value that encodes and decodes to itself.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"name":"a"}`, `{"version":2,"minor":1,"name":"a"}`, `{"version":2,"minor":9,"name":"a","x":[]}`,
		`{"version":3}`, `{"version":-1}`, `{"minor":1,"x":1}`, `{"name":"a"}{}`, `[]`, `null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var r record
		v, err := format.Decode(b, &r)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		if _, ok := format.known(v.Major); !ok || v.Minor < 0 {
			t.Fatalf("read version %s, which it does not read", v)
		}
		again, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		var r2 record
		if _, err := format.Decode(again, &r2); err != nil || r2 != r {
			t.Fatalf("%s decodes to %+v, %v; want %+v", again, r2, err, r)
		}
	})
}
