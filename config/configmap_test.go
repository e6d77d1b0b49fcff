package config

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// A mig-parted file shaped like the GPU Operator's default one: named
// layouts, some per GPU model (device-filter blocks), nothing else.
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
  - device-filter: "0x20B510DE"
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
// devicePlugin.config ConfigMap).
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

// ownWithNodes is a gpu-agent file with nodes:, its own mig-configs and a
// config that names one of them.
const ownWithNodes = `version: v1
nodes:
  gpu-7: pinned
configs:
  default: {}
  pinned: {}
  labelled:
    mig:
      strategy: mixed
      migPartedConfig: half
  inline:
    mig:
      strategy: single
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: {"3g.40gb": 2}
mig-configs:
  half:
  - devices: all
    mig-enabled: true
    mig-devices: {"3g.40gb": 2}
  off:
  - devices: all
    mig-enabled: false
`

// combinedNodes is a gpu-agent key of a ConfigMap whose names are all
// defined by the other keys of combinedMap.
const combinedNodes = `version: v1
nodes:
  gpu-3: a100-timeslice
configs:
  big:
    mig:
      strategy: mixed
      migPartedConfig: all-balanced
`

// combinedMap holds every shape at once: mig-parted's file, device-plugin
// configs, and a gpu-agent key naming both.
func combinedMap() map[string]string {
	return map[string]string{
		"config.yaml":    operatorMigParted,
		"a100-timeslice": nvTimeSlice4,
		"plain":          nvPlain,
		"nodes.yaml":     combinedNodes,
	}
}

func mustConfigMap(t *testing.T, data map[string]string, defaultKey string) *File {
	t.Helper()
	f, _, err := ParseConfigMap(data, defaultKey)
	if err != nil {
		t.Fatalf("ParseConfigMap: %v", err)
	}
	return f
}

func mustParse(t *testing.T, data string) *File {
	t.Helper()
	f, _, err := Parse([]byte(data))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return f
}

func TestSelectByLabels(t *testing.T) {
	files := map[string]*File{
		"operator mig-parted key":           mustConfigMap(t, map[string]string{"config.yaml": operatorMigParted}, ""),
		"operator mig-parted file":          mustParse(t, operatorMigParted),
		"device-plugin map":                 mustConfigMap(t, map[string]string{"a100-timeslice": nvTimeSlice4, "plain": nvPlain}, "plain"),
		"device-plugin map, no default key": mustConfigMap(t, map[string]string{"a100-timeslice": nvTimeSlice4, "plain": nvPlain}, ""),
		"device-plugin map of one key":      mustConfigMap(t, map[string]string{"a100-timeslice": nvTimeSlice4}, ""),
		"gpu-agent file":                    mustParse(t, ownWithNodes),
		"combined map":                      mustConfigMap(t, combinedMap(), "plain"),
	}
	const (
		mig  = MIGConfigLabel
		dp   = DevicePluginConfigLabel
		ours = ConfigLabel
	)
	tests := []struct {
		file     string
		node     string
		labels   map[string]string
		name     string // selected config
		reason   SelectReason
		entry    string // mig-configs entry of the layout, if it is one
		source   string // MIGSource; "" = no layout
		strategy MIGStrategy
		replicas int    // time-slicing replicas of the selected config; 0 = none
		note     string // in Notes
		err      string
	}{
		// The GPU Operator's mig-parted ConfigMap, mounted as it is.
		{file: "operator mig-parted key", name: "default", reason: ReasonImplicit, strategy: MIGStrategyMixed},
		{file: "operator mig-parted file", name: "default", reason: ReasonImplicit, strategy: MIGStrategyMixed},
		{file: "operator mig-parted key", labels: map[string]string{mig: "all-disabled"},
			name: "default", reason: ReasonImplicit, entry: "all-disabled", source: "label nvidia.com/mig.config=all-disabled", strategy: MIGStrategyMixed},
		{file: "operator mig-parted key", labels: map[string]string{mig: "all-1g.10gb"},
			name: "default", reason: ReasonImplicit, entry: "all-1g.10gb", source: "label nvidia.com/mig.config=all-1g.10gb", strategy: MIGStrategyMixed},
		{file: "operator mig-parted file", labels: map[string]string{mig: "all-balanced"},
			name: "default", reason: ReasonImplicit, entry: "all-balanced", source: "label nvidia.com/mig.config=all-balanced", strategy: MIGStrategyMixed},
		{file: "operator mig-parted key", labels: map[string]string{mig: "all-3g.40gb"},
			err: "node n: label nvidia.com/mig.config=all-3g.40gb names no mig-configs entry (entries: all-1g.10gb, all-balanced, all-disabled, all-enabled)"},
		// An entry is still a config of its own, as before labels had
		// NVIDIA's meaning.
		{file: "operator mig-parted key", labels: map[string]string{ours: "all-balanced"},
			name: "all-balanced", reason: ReasonGPUAgentLabel, entry: "all-balanced", source: `configs.all-balanced.mig.migPartedConfig`, strategy: MIGStrategyMixed},
		{file: "operator mig-parted key", labels: map[string]string{ours: "all-balanced", mig: "all-disabled"},
			name: "all-balanced", reason: ReasonGPUAgentLabel, entry: "all-disabled", source: "label nvidia.com/mig.config=all-disabled", strategy: MIGStrategyMixed},

		// NVIDIA's device-plugin ConfigMap.
		{file: "device-plugin map", labels: map[string]string{dp: "a100-timeslice"},
			name: "a100-timeslice", reason: ReasonDevicePluginLabel, strategy: MIGStrategyNone, replicas: 4},
		{file: "device-plugin map", name: "plain", reason: ReasonDefaultKey, strategy: MIGStrategyNone},
		{file: "device-plugin map", labels: map[string]string{dp: ""}, name: "plain", reason: ReasonDefaultKey, strategy: MIGStrategyNone},
		{file: "device-plugin map", labels: map[string]string{dp: "h100"},
			err: "node n: label nvidia.com/device-plugin.config=h100 names no config (configs: a100-timeslice, plain)"},
		{file: "device-plugin map, no default key", name: "default", reason: ReasonImplicit, strategy: MIGStrategyMixed},
		{file: "device-plugin map, no default key", labels: map[string]string{dp: "plain"}, name: "plain", reason: ReasonDevicePluginLabel, strategy: MIGStrategyNone},
		{file: "device-plugin map of one key", name: "a100-timeslice", reason: ReasonDefaultKey, strategy: MIGStrategyNone, replicas: 4},
		// The operator's default label on a MIG node, with a ConfigMap that
		// has no layouts: mig-manager's business, not a reason to serve
		// nothing.
		{file: "device-plugin map", labels: map[string]string{mig: "all-disabled"}, name: "plain", reason: ReasonDefaultKey,
			strategy: MIGStrategyNone, note: "label nvidia.com/mig.config=all-disabled ignored: the config defines no mig-configs"},

		// gpu-agent's own file: precedence.
		{file: "gpu-agent file", node: "gpu-7", labels: map[string]string{ours: "labelled", dp: "default"},
			name: "pinned", reason: ReasonNodeEntry, strategy: MIGStrategyNone},
		{file: "gpu-agent file", labels: map[string]string{ours: "labelled", dp: "pinned"},
			name: "labelled", reason: ReasonGPUAgentLabel, entry: "half", source: "configs.labelled.mig.migPartedConfig", strategy: MIGStrategyMixed},
		{file: "gpu-agent file", labels: map[string]string{dp: "pinned"}, name: "pinned", reason: ReasonDevicePluginLabel, strategy: MIGStrategyNone},
		{file: "gpu-agent file", labels: map[string]string{ours: ""}, name: "default", reason: ReasonDefaultConfig, strategy: MIGStrategyNone},
		{file: "gpu-agent file", node: "gpu-8", name: "default", reason: ReasonDefaultConfig, strategy: MIGStrategyNone},
		{file: "gpu-agent file", labels: map[string]string{ours: "inline"},
			name: "inline", reason: ReasonGPUAgentLabel, source: "configs.inline.mig.devices", strategy: MIGStrategySingle},
		// The MIG label overrides a config's own layout, whichever way it
		// is given, and makes strategy none serve what it creates.
		{file: "gpu-agent file", labels: map[string]string{ours: "inline", mig: "off"},
			name: "inline", reason: ReasonGPUAgentLabel, entry: "off", source: "label nvidia.com/mig.config=off", strategy: MIGStrategySingle},
		{file: "gpu-agent file", labels: map[string]string{ours: "labelled", mig: "off"},
			name: "labelled", reason: ReasonGPUAgentLabel, entry: "off", source: "label nvidia.com/mig.config=off", strategy: MIGStrategyMixed},
		{file: "gpu-agent file", node: "gpu-7", labels: map[string]string{mig: "half"},
			name: "pinned", reason: ReasonNodeEntry, entry: "half", source: "label nvidia.com/mig.config=half", strategy: MIGStrategyMixed},
		// A label naming nothing is an error even when a lower step would
		// have matched: a typo must not silently give another config.
		{file: "gpu-agent file", labels: map[string]string{ours: "labeled", dp: "pinned"},
			err: "node n: label gpu-agent.io/config=labeled names no config (configs: default, inline, labelled, pinned)"},
		{file: "gpu-agent file", labels: map[string]string{mig: "all-disabled"},
			err: "label nvidia.com/mig.config=all-disabled names no mig-configs entry (entries: half, off)"},

		// Every shape in one ConfigMap, names crossing keys.
		{file: "combined map", node: "gpu-3", name: "a100-timeslice", reason: ReasonNodeEntry, strategy: MIGStrategyNone, replicas: 4},
		{file: "combined map", name: "plain", reason: ReasonDefaultKey, strategy: MIGStrategyNone},
		{file: "combined map", labels: map[string]string{ours: "big"},
			name: "big", reason: ReasonGPUAgentLabel, entry: "all-balanced", source: "configs.big.mig.migPartedConfig", strategy: MIGStrategyMixed},
		{file: "combined map", labels: map[string]string{dp: "a100-timeslice", mig: "all-1g.10gb"},
			name: "a100-timeslice", reason: ReasonDevicePluginLabel, entry: "all-1g.10gb", source: "label nvidia.com/mig.config=all-1g.10gb",
			strategy: MIGStrategyMixed, replicas: 4},
		{file: "combined map", node: "gpu-3", labels: map[string]string{ours: "big", dp: "plain", mig: "all-enabled"},
			name: "a100-timeslice", reason: ReasonNodeEntry, entry: "all-enabled", source: "label nvidia.com/mig.config=all-enabled",
			strategy: MIGStrategyMixed, replicas: 4},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%s/%v", tt.file, tt.node, tt.labels), func(t *testing.T) {
			f := files[tt.file]
			node := tt.node
			if node == "" {
				node = "n"
			}
			sel, err := f.Select(node, tt.labels)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if sel.Name != tt.name || sel.Reason != tt.reason {
				t.Errorf("selected %q by %q, want %q by %q", sel.Name, sel.Reason, tt.name, tt.reason)
			}
			if sel.MIGSource != tt.source || sel.MIGEntry != tt.entry {
				t.Errorf("MIG layout from %q (entry %q), want %q (entry %q)", sel.MIGSource, sel.MIGEntry, tt.source, tt.entry)
			}
			switch {
			case tt.entry != "":
				if !reflect.DeepEqual(sel.MIGLayout, f.MigConfigs[tt.entry]) {
					t.Errorf("layout %+v, want mig-configs entry %s", sel.MIGLayout, tt.entry)
				}
			case tt.source != "":
				if !reflect.DeepEqual(sel.MIGLayout, f.Configs[tt.name].MIG.Devices) {
					t.Errorf("layout %+v, want the config's mig.devices", sel.MIGLayout)
				}
			case sel.MIGLayout != nil:
				t.Errorf("layout %+v, want MIG left alone", sel.MIGLayout)
			}
			if sel.Config.MIG.Strategy != tt.strategy {
				t.Errorf("strategy %q, want %q", sel.Config.MIG.Strategy, tt.strategy)
			}
			replicas := 0
			if ts := sel.Config.Sharing.TimeSlicing; ts != nil {
				replicas = ts.Resources[0].Replicas
			}
			if replicas != tt.replicas {
				t.Errorf("time-slicing replicas %d, want %d", replicas, tt.replicas)
			}
			if tt.note == "" && sel.Notes != nil || tt.note != "" && (len(sel.Notes) != 1 || !strings.Contains(sel.Notes[0], tt.note)) {
				t.Errorf("notes %q, want %q", sel.Notes, tt.note)
			}
			if c, ok := f.Configs[tt.name]; ok && sel.Config != c && sel.Config.MIG.Strategy == c.MIG.Strategy {
				t.Error("Select copied a config it did not change")
			}
		})
	}
}

// The implicit default serves whole GPUs and whatever MIG devices exist,
// changing nothing.
func TestImplicitDefault(t *testing.T) {
	sel, err := mustParse(t, operatorMigParted).Select("n", nil)
	if err != nil {
		t.Fatal(err)
	}
	want := Default().Configs[DefaultConfigName]
	want.MIG.Strategy = MIGStrategyMixed
	if !reflect.DeepEqual(sel.Config, want) || sel.MIGLayout != nil {
		t.Errorf("implicit default = %+v, layout %v; want %+v and no layout", sel.Config, sel.MIGLayout, want)
	}
}

func TestSelectedEqual(t *testing.T) {
	f := mustConfigMap(t, map[string]string{"ts": nvTimeSlice4, "mig": operatorMigParted}, "ts")
	sel := func(labels map[string]string) Selected {
		t.Helper()
		s, err := f.Select("n", labels)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a := sel(map[string]string{MIGConfigLabel: "all-balanced"})
	b := sel(map[string]string{MIGConfigLabel: "all-balanced", "unrelated": "x"})
	if a.Config == b.Config {
		t.Fatal("expected two copies of the config (strategy none served as mixed)")
	}
	if !a.Equal(b) {
		t.Error("the same selection twice is not Equal")
	}
	if c := sel(map[string]string{MIGConfigLabel: "all-1g.10gb"}); a.Equal(c) {
		t.Error("a different MIG layout with the same config is Equal")
	}
	if d := sel(nil); a.Equal(d) || !d.Equal(sel(nil)) {
		t.Error("Equal does not tell a labelled layout from none")
	}
	i1, _ := mustParse(t, operatorMigParted).Select("n", nil)
	i2, _ := mustParse(t, operatorMigParted).Select("n", nil)
	if !i1.Equal(i2) {
		t.Error("two implicit defaults are not Equal")
	}
}

// wantKeyErr is one expected entry of a ConfigMap's ErrorList.
type wantKeyErr struct {
	key, path string
	line      int
	msg       string
}

func checkKeyErrors(t *testing.T, err error, want []wantKeyErr) {
	t.Helper()
	got := errorsOf(t, err)
	if len(got) != len(want) {
		t.Fatalf("got %d errors, want %d:\n%v", len(got), len(want), err)
	}
	for i, w := range want {
		g := got[i]
		if g.Key != w.key || g.Path != w.path || g.Line != w.line || !strings.Contains(g.Msg, w.msg) {
			t.Errorf("error %d = %q (key %q, path %q, line %d), want key %q path %q line %d containing %q",
				i, g.Error(), g.Key, g.Path, g.Line, w.key, w.path, w.line, w.msg)
		}
	}
}

func TestParseConfigMap(t *testing.T) {
	gpuAgent := func(body string) string { return "version: v1\n" + body }
	tests := []struct {
		name       string
		data       map[string]string
		defaultKey string
		configs    string // the configs defined, as listNames writes them
		migs       string
		nodes      map[string]string
		defaultIs  string // File.DefaultKey
		format     Format
		warnings   []string
		errs       []wantKeyErr
	}{
		{name: "device-plugin keys become configs", data: map[string]string{"a": nvTimeSlice4, "b": nvPlain},
			configs: "a, b", migs: "none", format: FormatNVIDIADevicePlugin,
			warnings: []string{`configs: no "default" config: a node without a nodes: entry or a gpu-agent.io/config or nvidia.com/device-plugin.config label gets the implicit default (whole GPUs, existing MIG devices)`}},
		{name: "a device-plugin key named default", data: map[string]string{"default": nvTimeSlice4, "b": nvPlain},
			configs: "b, default", migs: "none", format: FormatNVIDIADevicePlugin},
		{name: "default key", data: map[string]string{"a": nvTimeSlice4, "b": nvPlain}, defaultKey: "b",
			configs: "a, b", migs: "none", defaultIs: "b", format: FormatNVIDIADevicePlugin},
		{name: "one device-plugin key is the default (NVIDIA's single fallback)", data: map[string]string{"a100-timeslice": nvTimeSlice4},
			configs: "a100-timeslice", migs: "none", defaultIs: "a100-timeslice", format: FormatNVIDIADevicePlugin},
		{name: "one device-plugin key and mig-parted's file", data: map[string]string{"ts": nvTimeSlice4, "config.yaml": operatorMigParted},
			configs: "all-1g.10gb, all-balanced, all-disabled, all-enabled, ts", migs: "all-1g.10gb, all-balanced, all-disabled, all-enabled",
			defaultIs: "ts", format: FormatGPUAgent},
		{name: "mig-parted's file alone", data: map[string]string{"config.yaml": operatorMigParted},
			configs: "all-1g.10gb, all-balanced, all-disabled, all-enabled", migs: "all-1g.10gb, all-balanced, all-disabled, all-enabled",
			format:   FormatMigParted,
			warnings: []string{`configs: no "default" config: a node without a nodes: entry or a gpu-agent.io/config or nvidia.com/device-plugin.config label gets the implicit default (whole GPUs, existing MIG devices)`}},
		{name: "names cross keys", data: combinedMap(), defaultKey: "plain",
			configs: "a100-timeslice, all-1g.10gb, all-balanced, all-disabled, all-enabled, big, plain", migs: "all-1g.10gb, all-balanced, all-disabled, all-enabled",
			nodes: map[string]string{"gpu-3": "a100-timeslice"}, defaultIs: "plain", format: FormatGPUAgent},
		// A config a mig-parted key implies yields to one a key defines.
		{name: "a written config wins over an implied one", data: map[string]string{"config.yaml": operatorMigParted,
			"own": gpuAgent("configs:\n  all-balanced:\n    sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")},
			configs: "all-1g.10gb, all-balanced, all-disabled, all-enabled", migs: "all-1g.10gb, all-balanced, all-disabled, all-enabled", format: FormatGPUAgent,
			warnings: []string{`configs: no "default" config: a node without a nodes: entry or a gpu-agent.io/config or nvidia.com/device-plugin.config label gets the implicit default (whole GPUs, existing MIG devices)`}},
		{name: "warnings name their key", data: map[string]string{"a": "version: v1\nflags:\n  gfd: {oneshot: true}\n", "_b": nvPlain}, defaultKey: "a",
			configs: "_b, a", migs: "none", defaultIs: "a", format: FormatNVIDIADevicePlugin,
			warnings: []string{"key a: flags.gfd: ignored: gpu-agent does not include GPU feature discovery (line 3)",
				"key _b: not a valid label value, so the nvidia.com/device-plugin.config label cannot select this config"}},

		// Clashes name both keys; the error is at the second key's line.
		{name: "a config defined by two keys", data: map[string]string{"a.yaml": gpuAgent("configs:\n  x: {}\n"), "b.yaml": gpuAgent("configs:\n  y: {}\n  x: {}\n")},
			errs: []wantKeyErr{{"b.yaml", "configs.x", 4, `config "x" is also defined by key a.yaml`}}},
		{name: "a device-plugin key named like another key's config", data: map[string]string{"a.yaml": gpuAgent("configs:\n  ts: {}\n"), "ts": nvTimeSlice4},
			errs: []wantKeyErr{{"ts", "", 0, `config "ts" is also defined by key a.yaml`}}},
		{name: "a mig-configs entry defined by two keys", data: map[string]string{"m1": operatorMigParted, "m2": "version: v1\nmig-configs:\n  all-disabled:\n  - {devices: all, mig-enabled: false}\n"},
			errs: []wantKeyErr{{"m2", "mig-configs.all-disabled", 3, `mig-configs entry "all-disabled" is also defined by key m1`}}},
		{name: "a node listed by two keys", data: map[string]string{"a": gpuAgent("nodes: {n1: x}\nconfigs: {x: {}}\n"), "b": gpuAgent("nodes: {n1: y}\nconfigs: {y: {}}\n")},
			errs: []wantKeyErr{{"b", "nodes.n1", 2, `nodes: entry for node "n1" is also defined by key a`}}},

		// Errors in a key name it, with the path and line in its content.
		{name: "an error in one key", data: map[string]string{"good": nvPlain, "time-slicing": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 100000\n"},
			errs: []wantKeyErr{{"time-slicing", "sharing.timeSlicing.resources[0].replicas", 6, "100000 exceeds the maximum of 1024"}}},
		{name: "errors in two keys, and a syntax error", data: map[string]string{"b": "version: v1\nconfigs:\n  x: {allocation: {policy: random}}\n", "a": "version: v1\nsharing: [\n", "c": nvPlain},
			errs: []wantKeyErr{{"a", "", 2, "invalid YAML"}, {"b", "configs.x.allocation.policy", 3, `unknown policy "random"`}}},
		{name: "a key of no known format", data: map[string]string{"README": "hello: world\n", "c": nvPlain},
			errs: []wantKeyErr{{"README", "", 1, "unrecognised config file"}}},
		{name: "a reference to a name no key defines", data: map[string]string{"config.yaml": operatorMigParted,
			"own": gpuAgent("nodes:\n  n1: nope\nconfigs:\n  big:\n    mig: {strategy: mixed, migPartedConfig: all-halved}\n")},
			errs: []wantKeyErr{{"own", "nodes.n1", 3, `config "nope" is not defined`}, {"own", "configs.big.mig.migPartedConfig", 6, `"all-halved" is not defined under mig-configs`}}},
		{name: "another key's layout against this key's strategy", data: map[string]string{"config.yaml": operatorMigParted,
			"own": gpuAgent("configs:\n  big:\n    mig:\n      strategy: single\n      migPartedConfig: all-balanced\n  none:\n    mig:\n      migPartedConfig: all-enabled\n")},
			errs: []wantKeyErr{
				{"own", "configs.big.mig.migPartedConfig", 6, "strategy single needs one MIG profile on every GPU, the layout has 1g.10gb, 1g.5gb, 2g.10gb, 2g.20gb, 3g.20gb, 3g.40gb"},
				{"own", "configs.none.mig.strategy", 8, "is none, which exposes no MIG devices"}}},
		{name: "default key naming nothing", data: map[string]string{"a": nvPlain, "b": nvPlain}, defaultKey: "c",
			errs: []wantKeyErr{{"", "", 0, `default key "c" names no config (configs: a, b)`}}},
		{name: "a key that defines nothing", data: map[string]string{"a": gpuAgent("configs: {}\n")},
			errs: []wantKeyErr{{"", "configs", 0, "at least one config is required"}}},
		{name: "too large in all", data: map[string]string{"a": nvPlain + "#" + strings.Repeat("x", MaxBytes/2), "b": nvPlain + "#" + strings.Repeat("x", MaxBytes/2)},
			errs: []wantKeyErr{{"", "", 0, fmt.Sprintf("ConfigMap of %d bytes (keys and values) exceeds the maximum of %d bytes", 2*(len(nvPlain)+2+MaxBytes/2), MaxBytes)}}},
		{name: "the structure bound is per key", data: map[string]string{"a": nvPlain, "big": "version: v1\nsharing: {}\n#" + strings.Repeat(",", MaxStructure)},
			errs: []wantKeyErr{{"big", "", 0, fmt.Sprintf("config has %d YAML indicators", MaxStructure+3)}}},
		{name: "empty", data: map[string]string{}, errs: []wantKeyErr{{"", "", 0, "ConfigMap has no keys"}}},
		{name: "an empty key", data: map[string]string{"": nvPlain, "a": nvPlain}, errs: []wantKeyErr{{"", "", 0, "empty key"}}},
		{name: "a key Kubernetes would refuse", data: map[string]string{"a b": nvPlain, "\xff": nvPlain, "..x": nvPlain},
			errs: []wantKeyErr{{"..x", "", 0, `not a valid ConfigMap key: "." or starting with ".."`},
				{"a b", "", 0, "only letters, digits, '-', '_' and '.' are allowed"}, {"\xff", "", 0, "only letters"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, warnings, err := ParseConfigMap(tt.data, tt.defaultKey)
			if tt.errs != nil {
				checkKeyErrors(t, err, tt.errs)
				if f != nil {
					t.Error("a File returned with the errors")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := listNames(f.Configs); got != tt.configs {
				t.Errorf("configs %s, want %s", got, tt.configs)
			}
			if got := listNames(f.MigConfigs); got != tt.migs {
				t.Errorf("mig-configs %s, want %s", got, tt.migs)
			}
			if !reflect.DeepEqual(f.Nodes, tt.nodes) {
				t.Errorf("nodes %v, want %v", f.Nodes, tt.nodes)
			}
			if f.DefaultKey != tt.defaultIs || f.Format != tt.format {
				t.Errorf("default key %q, format %s; want %q, %s", f.DefaultKey, f.Format, tt.defaultIs, tt.format)
			}
			if !reflect.DeepEqual(warnings, tt.warnings) {
				t.Errorf("warnings\n%q\nwant\n%q", warnings, tt.warnings)
			}
			if _, err := f.Validate(); err != nil {
				t.Errorf("the merged file does not validate: %v", err)
			}
		})
	}
}

// The ErrorList's text is what the agent logs and shows on /status.
func TestParseConfigMapErrorText(t *testing.T) {
	_, _, err := ParseConfigMap(map[string]string{
		"time-slicing": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
		"plain":        nvPlain,
	}, "")
	want := "key time-slicing: sharing.timeSlicing.resources[0].replicas: must be >= 2, got 1 (line 6)"
	if err == nil || err.Error() != want {
		t.Errorf("err = %v, want %q", err, want)
	}
}

// One key holding a gpu-agent file is that file.
func TestParseConfigMapOneKeyIsParse(t *testing.T) {
	for _, name := range []string{"testdata/gpu-agent.yaml", "testdata/mig-parted.yaml"} {
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		want, _, err := Parse(data)
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := ParseConfigMap(map[string]string{"config.yaml": string(data)}, "")
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(normalize(got.Configs), normalize(want.Configs)) || !reflect.DeepEqual(got.Nodes, want.Nodes) ||
			!reflect.DeepEqual(got.MigConfigs, want.MigConfigs) || got.Format != want.Format {
			t.Errorf("%s: ParseConfigMap of one key differs from Parse", name)
		}
	}
}

// Defect: the decoder's budget for aliases was per key, so a ConfigMap of
// many small keys, each expanding to the whole budget, took the budget
// times the number of keys (600 MiB for 72 KiB of input).
func TestParseConfigMapAliasBudgetIsShared(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: v1\nlaughs:\n  l0: &l0 {passDeviceSpecs: true}\n")
	for i := 1; i < 5; i++ {
		fmt.Fprintf(&b, "  l%d: &l%d {<<: [*l%d, *l%d, *l%d, *l%d, *l%d, *l%d, *l%d, *l%d, *l%d, *l%d]}\n", i, i, i-1, i-1, i-1, i-1, i-1, i-1, i-1, i-1, i-1, i-1)
	}
	b.WriteString("configs:\n  default: {devicePlugin: *l4}\n")
	one := b.String()
	if _, _, err := Parse([]byte(one)); err == nil || strings.Contains(err.Error(), "too large") {
		t.Fatalf("one key alone must be within the budget (and wrong): %v", err)
	}
	data := map[string]string{}
	total := 0
	for i := 0; total < 64<<10; i++ {
		k := fmt.Sprintf("k%04d", i)
		data[k] = one
		total += len(k) + len(one)
	}
	var err error
	got := allocated(func() { _, _, err = ParseConfigMap(data, "") })
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("ConfigMap too large (more than %d nodes in all keys after expanding aliases)", maxNodes)) {
		t.Errorf("err = %.300v, want the shared budget named", err)
	}
	if limit := hostileAllocLimit(total); got > limit {
		t.Errorf("a %d-byte ConfigMap of %d keys allocated %d MiB, more than %d MiB", total, len(data), got>>20, limit>>20)
	}
}

// kubeletVolume lays dir out as the kubelet mounts a ConfigMap of keys.
func kubeletVolume(t *testing.T, dir string, keys map[string]string) {
	t.Helper()
	ts := "..2026_11_23_21_00_00.123"
	must(t, os.MkdirAll(filepath.Join(dir, ts), 0o755))
	for k, v := range keys {
		must(t, os.WriteFile(filepath.Join(dir, ts, k), []byte(v), 0o644))
		must(t, os.Symlink(filepath.Join("..data", k), filepath.Join(dir, k)))
	}
	must(t, os.Symlink(ts, filepath.Join(dir, "..data")))
}

func TestLoadDir(t *testing.T) {
	t.Run("ConfigMap volume", func(t *testing.T) {
		dir := t.TempDir()
		kubeletVolume(t, dir, combinedMap())
		f, _, err := LoadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		want := mustConfigMap(t, combinedMap(), "")
		if !reflect.DeepEqual(normalize(f.Configs), normalize(want.Configs)) || !reflect.DeepEqual(f.MigConfigs, want.MigConfigs) ||
			!reflect.DeepEqual(f.Nodes, want.Nodes) {
			t.Error("LoadDir differs from ParseConfigMap of the same keys")
		}
	})
	t.Run("keys come from ..data only", func(t *testing.T) {
		// A key symlink the kubelet has not yet removed, pointing at a key
		// the current version lacks, is not a key.
		dir := t.TempDir()
		kubeletVolume(t, dir, map[string]string{"a": nvPlain})
		must(t, os.Symlink(filepath.Join("..data", "gone"), filepath.Join(dir, "gone")))
		must(t, os.Mkdir(filepath.Join(dir, "..data", "sub"), 0o755))
		got, err := ReadDir(dir)
		if err != nil || !reflect.DeepEqual(got, map[string]string{"a": nvPlain}) {
			t.Errorf("ReadDir = %v, %v; want key a only", got, err)
		}
	})
	t.Run("a key may start with one dot", func(t *testing.T) {
		// Defect: every name starting with "." was skipped, but only ".."
		// is the kubelet's; ".a100" is a valid ConfigMap key.
		dir := t.TempDir()
		kubeletVolume(t, dir, map[string]string{".a100": nvTimeSlice4, "plain": nvPlain})
		f, _, err := LoadDir(dir)
		if err != nil || listNames(f.Configs) != ".a100, plain" {
			t.Fatalf("LoadDir = %v, %v; want both keys", f, err)
		}
	})
	t.Run("a plain directory", func(t *testing.T) {
		dir := t.TempDir()
		must(t, os.WriteFile(filepath.Join(dir, "a100-timeslice"), []byte(nvTimeSlice4), 0o644))
		f, _, err := LoadDir(dir)
		if err != nil || f.DefaultKey != "a100-timeslice" {
			t.Fatalf("LoadDir = %+v, %v", f, err)
		}
	})
	t.Run("errors name the directory and key", func(t *testing.T) {
		dir := t.TempDir()
		kubeletVolume(t, dir, map[string]string{"time-slicing": strings.Replace(nvTimeSlice4, "4", "1", 1), "plain": nvPlain})
		_, _, err := LoadDir(dir)
		want := "config dir " + dir + ": key time-slicing: sharing.timeSlicing.resources[0].replicas: must be >= 2, got 1 (line 6)"
		if err == nil || err.Error() != want {
			t.Fatalf("err = %v, want %q", err, want)
		}
		errorsOf(t, err) // still an ErrorList underneath
	})
	t.Run("a key that is not a regular file", func(t *testing.T) {
		dir := t.TempDir()
		kubeletVolume(t, dir, map[string]string{"plain": nvPlain})
		must(t, syscall.Mkfifo(filepath.Join(dir, "..data", "fifo"), 0o644))
		_, _, err := LoadDir(dir)
		if err == nil || !strings.Contains(err.Error(), "not a regular file (a named pipe)") {
			t.Fatalf("err = %v, want the FIFO refused unread", err)
		}
	})
	t.Run("too large in all", func(t *testing.T) {
		dir := t.TempDir()
		pad := nvPlain + "#" + strings.Repeat("x", MaxBytes/2) + "\n"
		kubeletVolume(t, dir, map[string]string{"a": pad, "b": pad})
		_, _, err := LoadDir(dir)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("more than %d bytes in all", MaxBytes)) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("empty", func(t *testing.T) {
		if _, _, err := LoadDir(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no key files") {
			t.Fatalf("err = %v", err)
		}
	})
}

// Defect: Update.Parse ignored the default key (--default-config) for a
// single file, so nodes silently got "default" or the implicit default.
func TestUpdateParseDefaultKey(t *testing.T) {
	data := []byte("version: v1\nconfigs:\n  whole: {}\n  shared:\n    sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")
	f, warnings, err := Update{Data: data}.Parse("shared")
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Errorf("warnings %q: with a default key no default config is missing", warnings)
	}
	sel, err := f.Select("n", nil)
	if err != nil || sel.Name != "shared" || sel.Reason != ReasonDefaultKey {
		t.Errorf("Select = %s by %s, %v; want shared by the default key", sel.Name, sel.Reason, err)
	}
	if _, _, err := (Update{Data: data}).Parse("nope"); err == nil || !strings.Contains(err.Error(), `default key "nope" names no config (configs: shared, whole)`) {
		t.Errorf("err = %v", err)
	}
	if f, _, err := (Update{Data: data}).Parse(""); err != nil || f.DefaultKey != "" {
		t.Errorf("no default key: %+v, %v", f, err)
	}
	f, _, err = Update{Files: map[string]string{"a": nvPlain, "b": nvTimeSlice4}}.Parse("b")
	if err != nil || f.DefaultKey != "b" {
		t.Errorf("Files with a default key: %+v, %v", f, err)
	}
}

// FuzzParseConfigMap parses any ConfigMap of up to two keys, with any
// default key. An error is an ErrorList whose errors have messages and name
// only keys of the map; the same map gives the same answer every time; a
// File it gives validates as one file, selects a config for the labels tried
// (or names the config they ask for that it lacks), and marshals to one
// gpu-agent file with the same configs.
func FuzzParseConfigMap(f *testing.F) {
	f.Add("a", nvPlain, "b", operatorMigParted, "")
	f.Add("config.yaml", ownWithNodes, "x", nvTimeSlice4, "x")
	f.Add("nodes.yaml", combinedNodes, "config.yaml", operatorMigParted, "")
	f.Add("a100-timeslice", nvTimeSlice4, "b", "version: v1\nconfigs:\n  a100-timeslice: {}\n", "")
	for _, data := range exampleConfigs(f) {
		keys := sortedKeys(data)
		k2 := keys[len(keys)-1]
		f.Add(keys[0], data[keys[0]], k2, data[k2], "")
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2, def string) {
		data := map[string]string{k1: v1, k2: v2}
		file, warnings, err := ParseConfigMap(data, def)
		file2, warnings2, err2 := ParseConfigMap(data, def)
		if !reflect.DeepEqual(ordered(file), ordered(file2)) || !slices.Equal(warnings, warnings2) || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("two parses of the same map differ:\n%v\n%q\n---\n%v\n%q", err, warnings, err2, warnings2)
		}
		if err != nil {
			if file != nil {
				t.Fatal("a File returned with an error")
			}
			list := errorsOf(t, err)
			if len(list) == 0 {
				t.Fatal("an empty ErrorList")
			}
			for _, e := range list {
				if _, ok := data[e.Key]; e.Key != "" && !ok {
					t.Fatalf("error names key %q, which the map lacks: %v", e.Key, e)
				}
				if e.Msg == "" {
					t.Fatalf("an error without a message: %+v", e)
				}
			}
			return
		}
		if _, err := file.Validate(); err != nil {
			t.Fatalf("accepted map does not validate as one file: %v", err)
		}
		for _, labels := range []map[string]string{nil, {DevicePluginConfigLabel: k1}, {ConfigLabel: k2, MIGConfigLabel: k1}} {
			sel, err := file.Select("node", labels)
			if err != nil {
				if !strings.Contains(err.Error(), "names no") {
					t.Fatalf("Select(%v): %v", labels, err)
				}
				continue
			}
			if sel.Config == nil {
				t.Fatalf("Select(%v) gave no config", labels)
			}
		}
		// The merged File is one gpu-agent file.
		out, err := file.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		g, _, err := Parse(out)
		if err != nil {
			t.Fatalf("the merged file does not parse back: %v\n%s", err, out)
		}
		if !reflect.DeepEqual(normalize(file.Configs), normalize(g.Configs)) {
			t.Fatalf("configs changed in the round trip:\n%s", out)
		}
	})
}
