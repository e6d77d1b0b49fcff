package config

import (
	"strings"
	"testing"
)

// A mig-parted file shaped like the GPU Operator's default one: named
// layouts, some per GPU model (device-filter), nothing else.
const operatorMigParted = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  all-enabled:
  - devices: all
    mig-enabled: true
    mig-devices: {}
  all-1g.10gb:
  - device-filter: ["0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.10gb": 7
  all-balanced:
  - device-filter: ["0x20B010DE", "0x20B110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.5gb": 2
      "2g.10gb": 1
      "3g.20gb": 1
  - device-filter: ["0x233010DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.10gb": 2
      "2g.20gb": 1
      "3g.40gb": 1
`

// NVIDIA device-plugin configs, one per key (the GPU Operator's
// devicePlugin.config map).
const (
	nvTimeSlice4 = `version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
`
	nvPlain = `version: v1
flags:
  migStrategy: none
`
)

func TestSelectByLabels(t *testing.T) {
	mp, _, err := ParseConfigMap(map[string]string{"config.yaml": operatorMigParted}, "")
	if err != nil {
		t.Fatal(err)
	}
	dp, _, err := ParseConfigMap(map[string]string{"a100-ts4": nvTimeSlice4, "plain": nvPlain}, "plain")
	if err != nil {
		t.Fatal(err)
	}
	dpNoDefault, _, err := ParseConfigMap(map[string]string{"a100-ts4": nvTimeSlice4, "plain": nvPlain}, "")
	if err != nil {
		t.Fatal(err)
	}
	own, _, err := Parse([]byte("version: v1\nnodes:\n  gpu-7: pinned\nconfigs:\n  default: {}\n  pinned: {}\n  labelled: {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		f         *File
		node      string
		labels    map[string]string
		want      string
		reason    SelectReason
		migSource string // "" = no layout
		replicas  int
		err       string
	}{
		{name: "operator mig-parted file, no label: whole GPUs, MIG left alone", f: mp, want: "default", reason: ReasonImplicit},
		{name: "operator mig-parted file, mig.config label", f: mp, labels: map[string]string{MIGConfigLabel: "all-1g.10gb"},
			want: "default", reason: ReasonImplicit, migSource: "label nvidia.com/mig.config=all-1g.10gb"},
		{name: "mig.config label naming nothing", f: mp, labels: map[string]string{MIGConfigLabel: "all-2g"},
			err: "label nvidia.com/mig.config=all-2g names no mig-configs entry (entries: all-1g.10gb, all-balanced, all-disabled, all-enabled)"},
		{name: "device-plugin map, label picks a key", f: dp, labels: map[string]string{DevicePluginConfigLabel: "a100-ts4"},
			want: "a100-ts4", reason: ReasonDevicePluginLabel, replicas: 4},
		{name: "device-plugin map, no label: config.default", f: dp, want: "plain", reason: ReasonDefaultKey},
		{name: "device-plugin map without a default key: implicit", f: dpNoDefault, want: "default", reason: ReasonImplicit},
		{name: "device-plugin label naming nothing", f: dp, labels: map[string]string{DevicePluginConfigLabel: "h100"},
			err: "label nvidia.com/device-plugin.config=h100 names a config that is not defined (defined: a100-ts4, plain)"},
		{name: "nodes entry beats every label", f: own, node: "gpu-7",
			labels: map[string]string{ConfigLabel: "labelled", DevicePluginConfigLabel: "default"}, want: "pinned", reason: ReasonNodeEntry},
		{name: "gpu-agent label beats the device-plugin label", f: own,
			labels: map[string]string{ConfigLabel: "labelled", DevicePluginConfigLabel: "pinned"}, want: "labelled", reason: ReasonNodeLabel},
		{name: "device-plugin label beats default", f: own, labels: map[string]string{DevicePluginConfigLabel: "pinned"}, want: "pinned", reason: ReasonDevicePluginLabel},
		{name: "mig.config label without mig-configs", f: own, labels: map[string]string{MIGConfigLabel: "all-1g.10gb"},
			err: "names no mig-configs entry (entries: none)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel, err := tt.f.Select(tt.node, tt.labels)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if sel.Name != tt.want || sel.Reason != tt.reason || sel.MIGSource != tt.migSource {
				t.Errorf("selected %q by %q, MIG from %q; want %q by %q, MIG from %q", sel.Name, sel.Reason, sel.MIGSource, tt.want, tt.reason, tt.migSource)
			}
			if tt.migSource != "" && (sel.MIGLayout == nil || sel.Config.MIG.Strategy == MIGStrategyNone) {
				t.Errorf("a labelled layout must be applied and served: layout %v, strategy %q", sel.MIGLayout, sel.Config.MIG.Strategy)
			}
			if tt.replicas > 0 && (sel.Config.Sharing.TimeSlicing == nil || sel.Config.Sharing.TimeSlicing.Resources[0].Replicas != tt.replicas) {
				t.Errorf("config %q does not time-slice ×%d: %+v", sel.Name, tt.replicas, sel.Config.Sharing)
			}
		})
	}
}

func TestParseConfigMap(t *testing.T) {
	tests := []struct {
		name       string
		data       map[string]string
		defaultKey string
		configs    []string // configs defined, sorted
		migs       int      // mig-configs entries
		err        string
	}{
		{name: "one gpu-agent key is that file", data: map[string]string{"config.yaml": "version: v1\nconfigs:\n  default: {}\n  big: {}\n"},
			configs: []string{"big", "default"}},
		{name: "device-plugin keys become configs", data: map[string]string{"a": nvTimeSlice4, "b": nvPlain}, configs: []string{"a", "b"}},
		{name: "mig-parted key adds its entries", data: map[string]string{"dp": nvPlain, "mig": operatorMigParted},
			configs: []string{"all-1g.10gb", "all-balanced", "all-disabled", "all-enabled", "dp"}, migs: 4},
		{name: "a name defined by two keys", data: map[string]string{"a.yaml": "version: v1\nconfigs:\n  x: {}\n", "b.yaml": "version: v1\nconfigs:\n  x: {}\n"},
			err: `key b.yaml: configs.x: config "x" is also defined by key "a.yaml"`},
		{name: "an error in one key names the key", data: map[string]string{"good": nvPlain, "bad": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 100000\n"},
			err: "key bad: sharing.timeSlicing.resources[0].replicas: 100000 exceeds the maximum of 1024"},
		{name: "default key naming nothing", data: map[string]string{"a": nvPlain, "b": nvPlain}, defaultKey: "c",
			err: `default key "c" names no config (defined: a, b)`},
		{name: "too large in all", data: map[string]string{"a": strings.Repeat("#", MaxBytes/2+1), "b": strings.Repeat("#", MaxBytes/2+1)},
			err: "exceeds the maximum of 1048576 bytes"},
		{name: "empty", data: map[string]string{}, err: "no keys"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, _, err := ParseConfigMap(tt.data, tt.defaultKey)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := listNames(f.Configs); got != strings.Join(tt.configs, ", ") {
				t.Errorf("configs %s, want %v", got, tt.configs)
			}
			if len(f.MigConfigs) != tt.migs {
				t.Errorf("%d mig-configs entries, want %d", len(f.MigConfigs), tt.migs)
			}
		})
	}
}

func FuzzParseConfigMap(f *testing.F) {
	f.Add("a", nvPlain, "b", operatorMigParted, "")
	f.Add("config.yaml", "version: v1\nconfigs:\n  default: {}\n", "x", nvTimeSlice4, "x")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2, def string) {
		f, _, err := ParseConfigMap(map[string]string{k1: v1, k2: v2}, def)
		if err == nil {
			if _, err := f.Select("node", map[string]string{DevicePluginConfigLabel: k1}); err != nil && !strings.Contains(err.Error(), "not defined") {
				t.Fatalf("Select: %v", err)
			}
		}
	})
}
