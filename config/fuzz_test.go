package config

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// configSeeds are config files of all three formats, written in this
// repository: the testdata files, the config keys of deploy/examples, the
// inputs of the parse, NVIDIA-format and ConfigMap tests, and hostile ones.
func configSeeds(tb testing.TB) [][]byte {
	var out [][]byte
	files, _ := filepath.Glob("testdata/*.yaml")
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, data)
	}
	for _, data := range exampleConfigs(tb) {
		for _, k := range sortedKeys(data) {
			out = append(out, []byte(data[k]))
		}
	}
	for _, tt := range parseErrorTests() {
		out = append(out, []byte(tt.in))
	}
	for _, tt := range nvidiaFormatTests() {
		out = append(out, []byte(tt.in))
	}
	for _, s := range []string{operatorMigParted, nvTimeSlice4, nvPlain, ownWithNodes, combinedNodes, "version: v1\nconfigs:\n  default:\n"} {
		out = append(out, []byte(s))
	}
	for _, in := range hostileInputs(4 << 10) {
		out = append(out, in.data)
	}
	return out
}

// exampleConfigs are the data of the ConfigMaps in deploy/examples.
func exampleConfigs(tb testing.TB) []map[string]string {
	files, _ := filepath.Glob("../deploy/examples/*.yaml")
	if len(files) == 0 {
		tb.Fatal("no deploy/examples/*.yaml")
	}
	var out []map[string]string
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			tb.Fatal(err)
		}
		var cm struct {
			Kind string            `yaml:"kind"`
			Data map[string]string `yaml:"data"`
		}
		if err := yaml.Unmarshal(b, &cm); err != nil {
			tb.Fatalf("%s: %v", name, err)
		}
		if cm.Kind == "ConfigMap" && len(cm.Data) > 0 {
			out = append(out, cm.Data)
		}
	}
	return out
}

// FuzzParse parses any bytes as a config file. Parse gives a File or an
// ErrorList of one or more errors, each with a message; the same bytes give
// the same answer every time; a File it gives is of one of the three
// formats, validates (the same way twice) and survives a marshal/parse round
// trip unchanged. The seeds reach all three formats: the target fails when
// one has no seed that parses.
func FuzzParse(f *testing.F) {
	parsed := map[Format]int{}
	for _, data := range configSeeds(f) {
		f.Add(data)
		if file, _, err := Parse(data); err == nil {
			parsed[file.Format]++
		}
	}
	for _, format := range []Format{FormatGPUAgent, FormatNVIDIADevicePlugin, FormatMigParted} {
		if parsed[format] == 0 {
			f.Fatalf("no seed of the %s format parses (seeds parsed: %v)", format, parsed)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		file, warnings, err := Parse(data)
		file2, warnings2, err2 := Parse(data)
		if !reflect.DeepEqual(ordered(file), ordered(file2)) || !slices.Equal(warnings, warnings2) || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("two parses of the same bytes differ:\n%v\n%q\n---\n%v\n%q", err, warnings, err2, warnings2)
		}
		if err != nil {
			if file != nil {
				t.Fatal("Parse returned both a File and an error")
			}
			list := errorsOf(t, err) // every error is an ErrorList
			if len(list) == 0 {
				t.Fatal("an empty ErrorList")
			}
			for _, e := range list {
				if e.Msg == "" {
					t.Fatalf("an error without a message: %+v", e)
				}
			}
			return
		}
		switch file.Format {
		case FormatGPUAgent, FormatNVIDIADevicePlugin, FormatMigParted:
		default:
			t.Fatalf("format %q", file.Format)
		}
		w1, err1 := file.Validate()
		w2, err2 := file.Validate()
		if !slices.Equal(w1, w2) || fmt.Sprint(err1) != fmt.Sprint(err2) {
			t.Fatalf("two validations differ:\n%v %q\n%v %q", err1, w1, err2, w2)
		}
		checkRoundTrip(t, data)
	})
}

// ordered is f with its path rewrites in one order. Parse sorts them longest
// first and leaves rewrites of one length in map order, which means nothing:
// of two paths of one length neither is a prefix of the other.
func ordered(f *File) *File {
	if f == nil {
		return nil
	}
	g := *f
	g.rewrites = slices.Clone(f.rewrites)
	slices.SortFunc(g.rewrites, func(a, b pathRewrite) int { return strings.Compare(a.from, b.from) })
	return &g
}
