package config

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzParse checks that Parse never panics, and that whatever it accepts
// re-validates and survives a marshal/parse round trip unchanged.
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.yaml")
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, tt := range parseErrorTests() {
		f.Add([]byte(tt.in))
	}
	f.Add([]byte("version: v1\nconfigs:\n  default:\n"))
	for _, in := range hostileInputs(4 << 10) {
		f.Add(in.data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		file, _, err := Parse(data)
		if err != nil {
			errorsOf(t, err) // every error is an ErrorList
			if file != nil {
				t.Fatal("Parse returned both a File and an error")
			}
			return
		}
		checkRoundTrip(t, data)
	})
}
