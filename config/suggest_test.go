package config

import (
	"slices"
	"strings"
	"testing"
)

// An unknown field names the field it is likely a typo of, and only then
// (issue 32).
func TestUnknownFieldDidYouMean(t *testing.T) {
	for _, tt := range []struct {
		name, in string
		path     string
		line     int
		want     string // the whole message
	}{
		{"a letter missing", "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          replica: 4\n",
			"configs.default.sharing.timeSlicing.resources[0].replica", 8, "unknown field; did you mean replicas?"},
		{"letters swapped", "version: v1\nconfigs:\n  default:\n    mig:\n      stratgey: mixed\n",
			"configs.default.mig.stratgey", 5, "unknown field; did you mean strategy?"},
		{"case", "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      passdevicespecs: true\n",
			"configs.default.devicePlugin.passdevicespecs", 5, "unknown field; did you mean passDeviceSpecs?"},
		{"mig-parted", "version: v1\nmig-configs:\n  a:\n  - devices: all\n    mig-enabled: false\n    device-filters: [\"0x20B010DE\"]\n",
			"mig-configs.a[0].device-filters", 6, "unknown field; did you mean device-filter?"},
		{"nothing close", "version: v1\nconfigs:\n  default:\n    mig:\n      layout: []\n",
			"configs.default.mig.layout", 5, "unknown field"},
		{"top level", "version: v1\nconfig:\n  default: {}\n",
			"", 1, "unrecognised config file: expected top-level configs: (gpu-agent), flags:/sharing: (NVIDIA device plugin) or mig-configs: (mig-parted); config (line 2): did you mean configs?"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := Parse([]byte(tt.in))
			list := errorsOf(t, err)
			i := slices.IndexFunc(list, func(e *FieldError) bool { return e.Path == tt.path })
			if i < 0 || list[i].Line != tt.line || list[i].Msg != tt.want {
				t.Errorf("errors:\n%v\nwant %s: %s (line %d)", err, tt.path, tt.want, tt.line)
			}
		})
	}

	// NVIDIA's format ignores the field, with a warning that says so.
	_, warnings, err := Parse([]byte("version: v1\nsharing:\n  timeSlicing:\n    renameByDefualt: true\n    resources:\n    - name: gpu\n      replicas: 2\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := "sharing.timeSlicing.renameByDefualt: unknown field, ignored as NVIDIA's device plugin ignores it; did you mean renameByDefault? (line 4)"
	if !slices.Contains(warnings, want) {
		t.Errorf("warnings %q, want %q", warnings, want)
	}
}

func TestClosest(t *testing.T) {
	names := []string{"devices", "device-filter", "mig-devices", "mig-enabled", "name", "rename", "replicas"}
	for key, want := range map[string]string{
		"devcies": "devices", "device": "devices", "migdevices": "mig-devices", "mig_enabled": "mig-enabled",
		"Replicas": "replicas", "nmae": "name", "renam": "rename",
		"x": "", "devicefilters": "device-filter", "deviceFilterz": "device-filter", "something": "", "replicasss": "replicas", "replicassssss": "",
		strings.Repeat("a", 300): "",
	} {
		if got := closest(key, names); got != want {
			t.Errorf("closest(%.20q) = %q, want %q", key, got, want)
		}
	}
}
