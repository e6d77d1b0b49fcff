package config

import (
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

func TestConfigMapManifest(t *testing.T) {
	tests := []struct {
		name     string
		in       string
		manifest bool
		keys     map[string]string
		err      string // in the error; "" for none
	}{
		{name: "gpu-agent config", in: "version: v1\nconfigs:\n  default: {}\n"},
		{name: "NVIDIA config", in: "version: v1\nflags:\n  migStrategy: none\n"},
		{name: "not YAML", in: "{"},
		{name: "another kind", in: "apiVersion: v1\nkind: Secret\ndata: {a: b}\n"},
		{name: "two keys", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata:\n  a.yaml: |\n    version: v1\n  b: x\n",
			keys: map[string]string{"a.yaml": "version: v1\n", "b": "x"}},
		{name: "empty data", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\ndata: {}\n", keys: map[string]string{}},
		{name: "no data", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\n", err: "data: a ConfigMap of configs needs data"},
		{name: "apiVersion", manifest: true, in: "apiVersion: v2\nkind: ConfigMap\ndata: {a: b}\n", err: "apiVersion: a ConfigMap is apiVersion v1"},
		{name: "binaryData", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\ndata: {a: b}\nbinaryData: {c: ZA==}\n", err: "binaryData: configs are text"},
		{name: "data a list", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\ndata: [a]\n", err: "data: expected a mapping"},
		{name: "value a mapping", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\ndata:\n  c.yaml:\n    version: v1\n", err: "data.c.yaml: expected a config as a string"},
		{name: "key twice", manifest: true, in: "apiVersion: v1\nkind: ConfigMap\ndata:\n  a: x\n  a: y\n", err: "data.a: key given twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			keys, manifest, err := ConfigMapManifest([]byte(tt.in))
			if manifest != tt.manifest {
				t.Fatalf("isManifest = %t, want %t", manifest, tt.manifest)
			}
			switch {
			case tt.err == "" && err != nil:
				t.Fatalf("error %v", err)
			case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
				t.Fatalf("error %v, want one saying %q", err, tt.err)
			case tt.err == "" && !maps.Equal(keys, tt.keys):
				t.Errorf("keys %q, want %q", keys, tt.keys)
			}
		})
	}
}

// Every example in deploy/examples is a ConfigMap manifest whose keys parse
// as the agent parses the ConfigMap.
func TestConfigMapManifestExamples(t *testing.T) {
	files, _ := filepath.Glob("../deploy/examples/*.yaml")
	if len(files) == 0 {
		t.Fatal("no deploy/examples/*.yaml")
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		keys, manifest, err := ConfigMapManifest(data)
		if !manifest || err != nil || len(keys) == 0 {
			t.Errorf("%s: isManifest %t, %d keys, error %v", name, manifest, len(keys), err)
			continue
		}
		if _, _, err := ParseConfigMap(keys, ""); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// FuzzConfigMapManifest reads any bytes as a ConfigMap manifest: the answer
// is the same every time; a file that is not a manifest has no error and no
// keys; the keys of a good one survive being written back as a manifest.
func FuzzConfigMapManifest(f *testing.F) {
	for _, s := range configSeeds(f) {
		f.Add(s)
	}
	files, _ := filepath.Glob("../deploy/examples/*.yaml")
	for _, name := range files {
		if data, err := os.ReadFile(name); err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte("apiVersion: v1\nkind: ConfigMap\ndata:\n  a: &x y\n  b: *x\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		keys, manifest, err := ConfigMapManifest(data)
		keys2, manifest2, err2 := ConfigMapManifest(data)
		if manifest != manifest2 || (err == nil) != (err2 == nil) || !maps.Equal(keys, keys2) {
			t.Fatalf("two reads differ: %t %v %q, then %t %v %q", manifest, err, keys, manifest2, err2, keys2)
		}
		if !manifest {
			if err != nil || keys != nil {
				t.Fatalf("not a manifest, yet error %v and keys %q", err, keys)
			}
			return
		}
		if err != nil {
			if keys != nil {
				t.Fatalf("error %v with keys %q", err, keys)
			}
			return
		}
		out, merr := yaml.Marshal(map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "data": keys})
		if merr != nil {
			t.Fatal(merr)
		}
		back, manifest, err := ConfigMapManifest(out)
		if len(out) <= MaxBytes && (!manifest || err != nil || !maps.Equal(back, keys)) {
			t.Fatalf("keys %q written back read as %t %v %q:\n%s", keys, manifest, err, back, out)
		}
	})
}
