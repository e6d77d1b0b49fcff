package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	typesFile = "../../config/types.go"
	pageFile  = "../../docs/config-reference.md"
)

// The committed reference is what the generator writes from the config
// types as they are now.
func TestReferenceIsCurrent(t *testing.T) {
	want, err := generate(typesFile)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(pageFile)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("docs/config-reference.md is stale: run `go run ./internal/configref` from the repository root and commit the result")
	}
}

// What the reference says of fields whose type, default or values come
// from different places: the probe's defaults, a stated default, typed
// constants, a constant group, a stated range, a pointer's default.
func TestReferenceEntries(t *testing.T) {
	page, err := generate(typesFile)
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		"configs.<config>.allocation.policy":                               "Type: string; default: `topology`; values: `topology`, `packed`, `distributed`.",
		"configs.<config>.health.probeInterval":                            "default: `10s`.",
		"configs.<config>.health.recoveryQuietPeriod":                      "default: `5m`.",
		"configs.<config>.health.draTaintEffect":                           "default: `NoSchedule`; values: `NoSchedule`, `NoExecute`.",
		"configs.<config>.devicePlugin.deviceListStrategy":                 "values: `envvar`, `volume-mounts`, `cdi-annotations`, `cdi-cri`.",
		"configs.<config>.devicePlugin.enabled":                            "Type: bool; default: `true`.",
		"configs.<config>.mig.resetPolicy":                                 "default: `whenIdle`; values: `whenIdle`, `never`.",
		"configs.<config>.sharing.timeSlicing.failRequestsGreaterThanOne":  "Type: bool; default: `false`.",
		"configs.<config>.sharing.mps.failRequestsGreaterThanOne":          "Type: bool; default: `true`.",
		"configs.<config>.sharing.mps.resources[].replicas":                "values: 2 to 1024.",
		"configs.<config>.sharing.mps.resources[].devices":                 "default: `all`.",
		"configs.<config>.sharing.mps.resources[].activeThreadPercentage":  "values: 1 to 100.",
		"configs.<config>.mig.devices[].mig-devices":                       "Type: map of `<profile>` to integer",
		"configs.<config>.sharing.timeSlicing.resources[].rename":          "default: name, or &lt;name>.shared with renameByDefault.",
		"configs.<config>.sharing.mps.resources[].pinnedDeviceMemoryLimit": "Type: quantity",
		"configs.<config>.dra.migOnDemand.profiles":                        "default: every profile the GPU has.",
		"configs.<config>.devicePlugin.cdiAnnotationPrefix":                "default: `cdi.k8s.io/`.",
		"configs.<config>.mig.strategy":                                    "default: `none`; values: `none`, `single`, `mixed`.",
		"mig-configs":                                                      "as [`configs.<config>.mig.devices`](#configsconfigmigdevices)",
		"version":                                                          "values: `v1`.",
	} {
		_, entry, ok := strings.Cut(string(page), "\n### `"+path+"`\n")
		if !ok {
			t.Errorf("no entry for %s", path)
			continue
		}
		entry, _, _ = strings.Cut(entry, "\n#")
		if !strings.Contains(entry, want) {
			t.Errorf("%s: want %q in\n%s", path, want, entry)
		}
	}
	// Every field of a section has its entry: one per YAML key of Health.
	for _, key := range []string{"ignoredXids", "fatalXids", "disableDefaultIgnored", "recoveryQuietPeriod", "probeInterval", "draTaintEffect"} {
		if !strings.Contains(string(page), "### `configs.<config>.health."+key+"`") {
			t.Errorf("no entry for health.%s", key)
		}
	}
}

// editedTypes writes config/types.go with old replaced by new, and returns
// its path.
func editedTypes(t *testing.T, old, new string) string {
	t.Helper()
	src, err := os.ReadFile(typesFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(src), old) {
		t.Fatalf("config/types.go has no %q", old)
	}
	path := filepath.Join(t.TempDir(), "types.go")
	if err := os.WriteFile(path, []byte(strings.Replace(string(src), old, new, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// The generator refuses doc comments it cannot make a true reference of: a
// field without one, a default that is not the one Parse fills in, a
// stated list of values where constants give them.
func TestGenerateRefuses(t *testing.T) {
	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"undocumented field",
			"\t// Version is the schema version, required at the top of every file.\n\t// Values: `v1`.\n",
			"", "version (File.Version): no doc comment"},
		{"stated default that Parse contradicts",
			"\t// Policy decides for shared devices",
			"\t// Default: `packed`.\n\t// Policy decides for shared devices",
			"configs.<config>.allocation.policy: the doc comment says \"Default: `packed`\", Parse fills in \"topology\""},
		{"stated values beside constants",
			"\t// Strategy is how MIG devices are offered",
			"\t// Values: any.\n\t// Strategy is how MIG devices are offered",
			"configs.<config>.mig.strategy: \"Values: any\", while the constants say"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := generate(editedTypes(t, tc.old, tc.new))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestPrettyDuration(t *testing.T) {
	for in, want := range map[string]string{"10s": "10s", "5m0s": "5m", "1h0m0s": "1h", "1h30m0s": "1h30m", "1m30s": "1m30s", "500ms": "500ms"} {
		if got := prettyDuration(in); got != want {
			t.Errorf("prettyDuration(%q) = %q, want %q", in, got, want)
		}
	}
}
