package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// wantErr is one expected FieldError: exact path and line, message substring.
type wantErr struct {
	path string
	line int
	msg  string
}

// errorsOf returns the FieldErrors in err, failing if err is not an ErrorList.
func errorsOf(t *testing.T, err error) ErrorList {
	t.Helper()
	if err == nil {
		return nil
	}
	var list ErrorList
	if !errors.As(err, &list) {
		t.Fatalf("error is %T, not an ErrorList: %v", err, err)
	}
	return list
}

func checkErrors(t *testing.T, err error, want []wantErr) {
	t.Helper()
	got := errorsOf(t, err)
	if len(got) != len(want) {
		t.Fatalf("got %d errors, want %d:\n%v", len(got), len(want), err)
	}
	for i, w := range want {
		g := got[i]
		if g.Path != w.path || g.Line != w.line || !strings.Contains(g.Msg, w.msg) {
			t.Errorf("error %d = %q (path %q, line %d), want path %q line %d containing %q",
				i, g.Error(), g.Path, g.Line, w.path, w.line, w.msg)
		}
	}
}

type parseErrorTest struct {
	name string
	in   string
	want []wantErr
}

// parseErrorTests are shared with FuzzParse as seeds.
func parseErrorTests() []parseErrorTest {
	return []parseErrorTest{
		{
			name: "unknown field with path and line",
			in: `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replica: 4
`,
			want: []wantErr{
				// replicas is then missing; reported where the resource starts.
				{"configs.default.sharing.timeSlicing.resources[0].replicas", 7, "required"},
				{"configs.default.sharing.timeSlicing.resources[0].replica", 8, "unknown field"},
			},
		},
		{
			name: "several decode errors sorted by line",
			in: `version: v1
configs:
  default:
    allocation:
      polcy: packed
    mig:
      strategy: [mixed]
    health:
      probeInterval: 10
      ignoredXids: [13, x]
    devicePlugin:
      passDeviceSpecs: "yes"
`,
			want: []wantErr{
				{"configs.default.allocation.polcy", 5, "unknown field"},
				{"configs.default.mig.strategy", 7, "expected a string, got a list"},
				{"configs.default.health.probeInterval", 9, "duration string"},
				{"configs.default.health.ignoredXids[1]", 10, `expected an integer, got "x"`},
				{"configs.default.devicePlugin.passDeviceSpecs", 12, "expected true or false"},
			},
		},
		{
			name: "type error on a struct",
			in: `version: v1
configs:
  default:
    sharing: timeSlicing
`,
			want: []wantErr{{"configs.default.sharing", 4, "expected a mapping"}},
		},
		{
			name: "duplicate key",
			in: `version: v1
configs:
  default: {}
  default: {}
`,
			want: []wantErr{{"configs.default", 4, "duplicate key (first at line 3)"}},
		},
		{
			name: "invalid yaml",
			in:   "version: v1\nconfigs:\n  default: [\n",
			want: []wantErr{{"", 3, "invalid YAML"}},
		},
		{
			name: "tab indenting a line",
			in:   "version: v1\nconfigs:\n  default:\n\t mig: {}\n",
			want: []wantErr{{"", 4, "a tab (column 1, indenting the line): YAML indents with spaces, never tabs"}},
		},
		{
			name: "tab after a list's dash",
			in:   "version: v1\nconfigs:\n  default:\n    mig:\n      devices:\n      -\tdevices: all\n",
			want: []wantErr{{"", 6, `a tab (column 8, before "devices: all")`}},
		},
		{
			// yaml.v3 names the line before the tab.
			name: "tab where an indentation space is expected",
			in:   "version: v1\nconfigs:\n  - a\n\t- b\n",
			want: []wantErr{{"", 4, "a tab (column 1, indenting the line)"}},
		},
		{
			name: "unknown format",
			in:   "version: v1\nfoo: bar\n",
			want: []wantErr{{"", 1, "unrecognised config file"}},
		},
		{
			name: "two documents",
			in:   "version: v1\nconfigs: {default: {}}\n---\nversion: v1\n",
			want: []wantErr{{"", 3, "more than one YAML document"}},
		},
		{
			name: "empty",
			in:   "# nothing\n",
			want: []wantErr{{"", 0, "empty config file"}},
		},
		{
			name: "version",
			in:   "version: v2\nconfigs: {default: {}}\n",
			want: []wantErr{{"version", 1, `unsupported version "v2"`}},
		},
		{
			name: "version missing",
			in:   "configs: {default: {}}\n",
			want: []wantErr{{"version", 0, "required"}},
		},
		{
			name: "no configs",
			in:   "version: v1\nconfigs: {}\n",
			want: []wantErr{{"configs", 2, "at least one config"}},
		},
		{
			name: "enums",
			in: `version: v1
configs:
  default:
    devicePlugin:
      deviceListStrategy: envvar,volume-mount
      cdiAnnotationPrefix: cdi.k8s.io
    allocation:
      policy: spread
    mig:
      strategy: mixd
`,
			want: []wantErr{
				{"configs.default.devicePlugin.deviceListStrategy", 5, `unknown strategy "volume-mount": must be one or more of envvar, volume-mounts, cdi-annotations, cdi-cri`},
				{"configs.default.devicePlugin.cdiAnnotationPrefix", 6, `must end with "/"`},
				{"configs.default.allocation.policy", 8, `unknown policy "spread"`},
				{"configs.default.mig.strategy", 10, `unknown strategy "mixd"`},
			},
		},
		{
			name: "MIG reset policy",
			in: `version: v1
configs:
  default:
    mig:
      strategy: mixed
      resetPolicy: always
`,
			want: []wantErr{{"configs.default.mig.resetPolicy", 6, `unknown policy "always": must be whenIdle or never`}},
		},
		{
			name: "replicas, names, limits",
			in: `version: v1
configs:
  default:
    mig:
      strategy: mixed
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 1
        - name: nvidia.com/gpu
          rename: Shared_GPU
          devices: [0]
          replicas: 2
        - name: amd.com/gpu
          replicas: 2
      mps:
        resources:
        - name: nvidia.com/mig-1g.10gb
          rename: nvidia.com/gpu.shared
          replicas: 3
          activeThreadPercentage: 101
          pinnedDeviceMemoryLimit: 0
`,
			want: []wantErr{
				{"configs.default.sharing.timeSlicing.resources[0].replicas", 10, "must be >= 2, got 1"},
				{"configs.default.sharing.timeSlicing.resources[1].name", 11, "already listed at resources[0]"},
				{"configs.default.sharing.timeSlicing.resources[1].rename", 12, "must be <domain>/<name>"},
				{"configs.default.sharing.timeSlicing.resources[2].name", 15, "must be nvidia.com/gpu or nvidia.com/mig-<profile>"},
				{"configs.default.sharing.mps.resources[0].activeThreadPercentage", 22, "between 1 and 100"},
				{"configs.default.sharing.mps.resources[0].pinnedDeviceMemoryLimit", 23, "must be > 0"},
			},
		},
		{
			name: "device selections",
			in: `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          devices: 0
          replicas: 2
        - name: nvidia.com/mig-1g.10gb
          devices: [0, "0:1", "GPU-nope"]
          replicas: 2
        - name: nvidia.com/mig-2g.20gb
          devices: some
          replicas: 2
`,
			want: []wantErr{
				{"configs.default.sharing.timeSlicing.resources[0].devices", 8, "device count must be > 0"},
				{"configs.default.sharing.timeSlicing.resources[1].devices[2]", 11, `"GPU-nope" is not a GPU index`},
				{"configs.default.sharing.timeSlicing.resources[2].devices", 14, `got "some"`},
			},
		},
		{
			name: "same device in timeSlicing and mps",
			in: `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          rename: nvidia.com/gpu.ts
          devices: [0, 1]
          replicas: 2
      mps:
        resources:
        - name: nvidia.com/gpu
          devices: [1, 2]
          replicas: 2
`,
			want: []wantErr{{"configs.default.sharing.mps.resources[0].devices", 14,
				"also shared by configs.default.sharing.timeSlicing.resources[0]"}},
		},
		{
			name: "empty sharing policy",
			in: `version: v1
configs:
  default:
    sharing:
      mps: {}
`,
			want: []wantErr{{"configs.default.sharing.mps.resources", 5, "at least one resource"}},
		},
		{
			name: "mig layout",
			in: `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - devices: [0, 0]
        device-filter: 20B010DE
        mig-enabled: true
        mig-devices: {"1g.10gb": 0, "10gb": 1, "4c.2g.20gb": 1}
      - mig-enabled: false
        mig-devices: {"1g.10gb": 1}
      - devices: all
        mig-enabled: true
  two:
    mig:
      strategy: mixed
      devices:
      - devices: [1]
        mig-enabled: true
        mig-devices: {"7g.80gb": 1}
      migPartedConfig: x
  three:
    mig:
      migPartedConfig: missing
`,
			want: []wantErr{
				{"configs.default.mig.devices[0].devices[1]", 7, "GPU 0 listed twice"},
				{"configs.default.mig.devices[0].device-filter", 8, "not a PCI device id"},
				{"configs.default.mig.devices[0].mig-devices.10gb", 10, "is not a MIG profile"},
				{`configs.default.mig.devices[0].mig-devices["1g.10gb"]`, 10, "count must be > 0"},
				{`configs.default.mig.devices[0].mig-devices["4c.2g.20gb"]`, 10, "compute slices"},
				{"configs.default.mig.devices[1].devices", 11, "required"},
				{"configs.default.mig.devices[1].mig-devices", 12, "set but mig-enabled is false"},
				{"configs.default.mig.devices[2].mig-devices", 13, "required when mig-enabled is true"},
				{"configs.two.mig.migPartedConfig", 22, "set together with mig.devices"},
				{"configs.three.mig.migPartedConfig", 25, `"missing" is not defined under mig-configs`},
			},
		},
		{
			name: "mig strategy vs layout",
			in: `version: v1
configs:
  default:
    mig:
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: {"1g.10gb": 7}
  single:
    mig:
      strategy: single
      migPartedConfig: mixed-layout
mig-configs:
  mixed-layout:
  - devices: [0]
    mig-enabled: true
    mig-devices: {"1g.10gb": 7}
  - devices: [1]
    mig-enabled: true
    mig-devices: {"7g.80gb": 1}
  empty: []
`,
			want: []wantErr{
				{"configs.default.mig.strategy", 4, "is none, which exposes no MIG devices"},
				{"mig-configs.mixed-layout", 14, "strategy single needs one MIG profile"},
				{"mig-configs.empty", 21, "at least one entry"},
			},
		},
		{
			name: "nodes naming missing config",
			in: `version: v1
nodes:
  node-a: nope
configs:
  default: {}
`,
			want: []wantErr{{"nodes.node-a", 3, `config "nope" is not defined`}},
		},
		{
			name: "health",
			in: `version: v1
configs:
  default:
    health:
      ignoredXids: [0, 79]
      fatalXids: [79]
      recoveryQuietPeriod: -1s
      probeInterval: soon
`,
			want: []wantErr{
				{"configs.default.health.ignoredXids[0]", 5, "XID must be > 0"},
				{"configs.default.health.fatalXids[0]", 6, "also in ignoredXids"},
				{"configs.default.health.recoveryQuietPeriod", 7, "must be > 0"},
				{"configs.default.health.probeInterval", 8, `invalid duration "soon"`},
			},
		},
		{
			name: "usage",
			in: `version: v1
configs:
  default:
    usage:
      idleEventAfter: 30s
  negative:
    usage:
      idleEventAfter: -2h
  bare:
    usage:
      idleEventAfter: 7200
`,
			want: []wantErr{
				{"configs.default.usage.idleEventAfter", 5, "30s is shorter than 1m0s"},
				{"configs.negative.usage.idleEventAfter", 8, "-2h0m0s: must not be negative"},
				{"configs.bare.usage.idleEventAfter", 11, "duration string"},
			},
		},
		{
			name: "quantity",
			in: `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
          pinnedDeviceMemoryLimit: 1.5
`,
			want: []wantErr{{"configs.default.sharing.mps.resources[0].pinnedDeviceMemoryLimit", 9, "not a whole number of bytes"}},
		},
		{
			name: "timeSlicing has no MPS limits",
			in: `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
          activeThreadPercentage: 50
`,
			want: []wantErr{{"configs.default.sharing.timeSlicing.resources[0].activeThreadPercentage", 9, "unknown field"}},
		},
		{
			name: "nvidia file: their paths in errors",
			in: `version: v1
flags:
  migStrategy: mixd
  plugin:
    deviceListStrategy: [envvar, cdi-annotation]
sharing:
  timeSlicing:
    resources:
    - name: gpu
      replicas: 1
`,
			want: []wantErr{
				{"flags.migStrategy", 3, `unknown strategy "mixd"`},
				{"flags.plugin.deviceListStrategy", 5, `unknown strategy "cdi-annotation"`},
				{"sharing.timeSlicing.resources[0].replicas", 10, "must be >= 2"},
			},
		},
		{
			name: "mig-parted file",
			in: `version: v1
mig-configs:
  all-1g.10gb:
  - devices: all
    mig-enabled: true
    mig-devices: {"1g.10gb": 7, "bogus": 1}
  typo:
  - devices: all
    mig-enable: true
`,
			want: []wantErr{
				{`mig-configs["all-1g.10gb"][0].mig-devices.bogus`, 6, "is not a MIG profile"},
				{"mig-configs.typo[0].mig-enable", 9, "unknown field"},
			},
		},
		{
			name: "spare layout",
			in: `version: v1
configs:
  a:
    dra:
      migOnDemand:
        enabled: true
        profiles: [1g.10gb]
        spareLayout: {"1g.10gb": 9, "3g.40gb": 1, "x": 1, "9g": 1, "3g": 1}
  b:
    dra:
      migOnDemand: {enabled: true, spareLayout: {}}
`,
			want: []wantErr{
				{"configs.a.dra.migOnDemand.spareLayout", 8, "needs spareGPUs of 1 or more"},
				{`configs.a.dra.migOnDemand.spareLayout.9g`, 8, "or compute slices alone, like 1g"},
				{`configs.a.dra.migOnDemand.spareLayout.x`, 8, "not a MIG profile"},
				{`configs.a.dra.migOnDemand.spareLayout["1g.10gb"]`, 8, "count must be 1 to 8, got 9"},
				{`configs.a.dra.migOnDemand.spareLayout["3g.40gb"]`, 8, "not among migOnDemand.profiles [1g.10gb]"},
				{"configs.b.dra.migOnDemand.spareLayout", 11, "lists no profile"},
				{"configs.b.dra.migOnDemand.spareLayout", 11, "needs spareGPUs of 1 or more"},
			},
		},
		{
			name: "MIG device attributes",
			in: `version: v1
configs:
  a:
    dra:
      migDeviceAttributes: [uuid, pcieRoot, uuid, resource.kubernetes.io/numaNode]
  b:
    dra:
      migDeviceAttributes: []
`,
			want: []wantErr{
				{"configs.a.dra.migDeviceAttributes[1]", 5, `"pcieRoot" is not an attribute of a MIG device; one of uuid, index,`},
				{"configs.a.dra.migDeviceAttributes[2]", 5, `"uuid" is listed twice`},
				{"configs.b.dra.migDeviceAttributes", 8, "lists no attribute"},
			},
		},
		{
			name: "alias expansion is bounded",
			in: `version: v1
a: &a [x, x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
configs: {}
`,
			want: []wantErr{
				{"a", 2, "unknown field"},
				{"b", 3, "unknown field"},
				{"c", 4, "unknown field"},
				{"configs", 5, "at least one config"},
			},
		},
	}
}

func TestParseErrors(t *testing.T) {
	for _, tt := range parseErrorTests() {
		t.Run(tt.name, func(t *testing.T) {
			f, _, err := Parse([]byte(tt.in))
			if err == nil {
				t.Fatalf("Parse succeeded, want errors; got %+v", f)
			}
			if f != nil {
				t.Errorf("Parse returned a File with an error")
			}
			checkErrors(t, err, tt.want)
		})
	}
}

func TestAliasBomb(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: v1\nconfigs:\n  default: &c\n    sharing:\n      timeSlicing:\n        resources:\n")
	b.WriteString("        - &one {name: nvidia.com/gpu, replicas: 2}\n")
	for range 200 {
		b.WriteString("        - *one\n")
	}
	for i := range 1000 {
		fmt.Fprintf(&b, "  c%d: *c\n", i)
	}
	start := time.Now()
	_, _, err := Parse([]byte(b.String()))
	if err == nil || !strings.Contains(err.Error(), "document too large") {
		t.Fatalf("err = %v, want document too large", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestErrorFormat(t *testing.T) {
	_, _, err := Parse([]byte(`version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
          replica: 4
`))
	want := "configs.default.sharing.timeSlicing.resources[0].replica: unknown field; did you mean replicas? (line 9)"
	if err == nil || err.Error() != want {
		t.Fatalf("error = %v, want %q", err, want)
	}
}

func TestParseTestdata(t *testing.T) {
	tests := []struct {
		file       string
		format     Format
		configs    []string
		wantWarn   []string // substrings, one per warning, in order
		wantNoWarn bool
	}{
		{file: "gpu-agent.yaml", format: FormatGPUAgent, configs: []string{"a100-all-1g", "default", "mig-mixed", "shared"}, wantNoWarn: true},
		{file: "nvidia-device-plugin.yaml", format: FormatNVIDIADevicePlugin, configs: []string{"default"},
			wantWarn: []string{"flags.failOnInitError: ignored", "flags.gfd: ignored"}},
		{file: "mig-parted.yaml", format: FormatMigParted, configs: []string{"all-1g.10gb", "all-disabled", "all-enabled", "custom-config"},
			wantWarn: []string{`configs: no "default" config`}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			f, warnings, err := Load(filepath.Join("testdata", tt.file))
			if err != nil {
				t.Fatal(err)
			}
			if f.Format != tt.format {
				t.Errorf("format = %s, want %s", f.Format, tt.format)
			}
			if got := sortedKeys(f.Configs); !reflect.DeepEqual(got, tt.configs) {
				t.Errorf("configs = %v, want %v", got, tt.configs)
			}
			if tt.wantNoWarn && len(warnings) > 0 {
				t.Errorf("unexpected warnings: %q", warnings)
			}
			if tt.wantWarn != nil {
				if len(warnings) != len(tt.wantWarn) {
					t.Fatalf("warnings = %q, want %d", warnings, len(tt.wantWarn))
				}
				for i, w := range tt.wantWarn {
					if !strings.Contains(warnings[i], w) {
						t.Errorf("warning %d = %q, want it to contain %q", i, warnings[i], w)
					}
				}
			}
		})
	}
}

func TestGPUAgentFileValues(t *testing.T) {
	f, _, err := Load("testdata/gpu-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	shared := f.Configs["shared"]
	ts := shared.Sharing.TimeSlicing
	if got := ts.Resources[0]; got.Rename != "nvidia.com/gpu.shared" || !reflect.DeepEqual(got.Devices.List, []string{"0", "1"}) || got.Replicas != 4 {
		t.Errorf("timeSlicing resource = %+v", got)
	}
	if !ts.FailsRequestsGreaterThanOne() {
		t.Error("timeSlicing failRequestsGreaterThanOne lost")
	}
	m := shared.Sharing.MPS.Resources[0]
	if m.Rename != "nvidia.com/gpu.mps" || *m.ActiveThreadPercentage != 50 || *m.PinnedDeviceMemoryLimit != 10<<30 {
		t.Errorf("mps resource = %+v", m)
	}
	if !reflect.DeepEqual(m.Devices.List, []string{"2", "GPU-8f4a2c5e-1b3d-4e6f-9a0b-1c2d3e4f5a6b"}) {
		t.Errorf("mps devices = %v", m.Devices.List)
	}
	if !shared.Sharing.MPS.FailsRequestsGreaterThanOne() {
		t.Error("mps failRequestsGreaterThanOne should default to true")
	}
	if shared.Allocation.Policy != PolicyPacked {
		t.Errorf("policy = %s", shared.Allocation.Policy)
	}
	mixed := f.Configs["mig-mixed"].MIG
	if mixed.Strategy != MIGStrategyMixed || len(mixed.Devices) != 2 ||
		!reflect.DeepEqual(mixed.Devices[0].Devices.Indices, []int{0, 1, 2, 3}) ||
		!reflect.DeepEqual([]string(mixed.Devices[0].DeviceFilter), []string{"0x20B010DE"}) ||
		!reflect.DeepEqual(mixed.Devices[0].MigDevices, map[string]int{"1g.10gb": 2, "3g.40gb": 1}) ||
		!mixed.Devices[1].Devices.All {
		t.Errorf("mig-mixed layout = %+v", mixed)
	}
	h := f.Configs["default"].Health
	for xid, fatal := range map[int]bool{13: true, 31: false, 79: true, 94: false, 48: true} {
		if got := h.IsFatal(xid); got != fatal {
			t.Errorf("IsFatal(%d) = %v, want %v", xid, got, fatal)
		}
	}
}

func TestDefaults(t *testing.T) {
	f, warnings, err := Parse([]byte("version: v1\nconfigs:\n  default:\n"))
	if err != nil || len(warnings) > 0 {
		t.Fatalf("Parse: %v, warnings %q", err, warnings)
	}
	want := Default()
	if !reflect.DeepEqual(f.Configs, want.Configs) {
		t.Errorf("empty default config = %+v, want %+v", f.Configs["default"], want.Configs["default"])
	}
	c := f.Configs["default"]
	if c.DevicePlugin.DeviceListStrategy != "envvar" || c.DevicePlugin.PassDeviceSpecs ||
		c.Allocation.Policy != PolicyTopology || c.MIG.Strategy != MIGStrategyNone ||
		c.Health.RecoveryQuietPeriod.D() != 5*time.Minute || c.Health.ProbeInterval.D() != 10*time.Second {
		t.Errorf("defaults = %+v", c)
	}
	if _, err := want.Validate(); err != nil {
		t.Errorf("Default() does not validate: %v", err)
	}
	// Defaults fill a resource's devices and renameByDefault, and leave
	// what the user set alone.
	f, _, err = Parse([]byte(`version: v1
configs:
  default:
    sharing:
      timeSlicing:
        renameByDefault: true
        resources:
        - name: nvidia.com/gpu
          replicas: 2
      mps:
        renameByDefault: true
        failRequestsGreaterThanOne: false
        resources:
        - name: nvidia.com/mig-1g.10gb
          rename: example.com/small
          devices: 2
          replicas: 2
    mig: {strategy: mixed}
`))
	if err != nil {
		t.Fatal(err)
	}
	s := f.Configs["default"].Sharing
	if r := s.TimeSlicing.Resources[0]; !r.Devices.All || r.Rename != "nvidia.com/gpu.shared" {
		t.Errorf("timeSlicing resource defaults = %+v", r)
	}
	if s.TimeSlicing.FailsRequestsGreaterThanOne() {
		t.Error("timeSlicing failRequestsGreaterThanOne should default to false")
	}
	if r := s.MPS.Resources[0]; r.Devices.Count != 2 || r.Rename != "example.com/small" || r.ActiveThreadPercentage != nil {
		t.Errorf("mps resource = %+v", r)
	}
	if s.MPS.FailsRequestsGreaterThanOne() {
		t.Error("explicit failRequestsGreaterThanOne: false was overridden")
	}
}

func TestNVIDIAConversion(t *testing.T) {
	f, _, err := Load("testdata/nvidia-device-plugin.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c := f.Configs["default"]
	if c.MIG.Strategy != MIGStrategyMixed || !c.DevicePlugin.PassDeviceSpecs || c.DevicePlugin.DeviceListStrategy != "envvar" {
		t.Errorf("flags not mapped: %+v", c)
	}
	rs := c.Sharing.TimeSlicing.Resources
	if rs[0].Name != "nvidia.com/gpu" || rs[0].Rename != "nvidia.com/gpu.shared" || rs[0].Replicas != 10 || !rs[0].Devices.All {
		t.Errorf("resource 0 = %+v", rs[0])
	}
	if rs[1].Name != "nvidia.com/mig-1g.10gb" || rs[1].Rename != "nvidia.com/mig-1g.10gb.shared" {
		t.Errorf("bare name not qualified as NVIDIA does: %+v", rs[1])
	}
	sel, err := f.Select("any-node", nil)
	if err != nil || sel.Name != "default" || sel.Reason != ReasonDefaultConfig {
		t.Errorf("Select = %+v, %v", sel, err)
	}

	// Their health section maps onto ours; a field they have and we ignore
	// is a warning, with its line.
	f, warnings, err := Parse([]byte(`version: v1
flags:
  plugin:
    deviceIDStrategy: index
health:
  ignoredXIDs: [94]
  criticalXIDs: [48]
imex:
  channelIDs: [0]
`))
	if err != nil {
		t.Fatal(err)
	}
	h := f.Configs["default"].Health
	if !reflect.DeepEqual(h.IgnoredXids, []int{94}) || !reflect.DeepEqual(h.FatalXids, []int{48}) {
		t.Errorf("health = %+v", h)
	}
	if got := f.Configs["default"].DevicePlugin.DeviceIDStrategy; got != DeviceIDStrategyIndex {
		t.Errorf("deviceIDStrategy = %q, want index", got)
	}
	wantWarn := []string{
		"health.ignoredXIDs: added to the default ignored list [13 31 43 45 68 109] (line 6)",
		"imex: ignored: IMEX channels are not supported by gpu-agent (line 8)",
	}
	if !reflect.DeepEqual(warnings, wantWarn) {
		t.Errorf("warnings =\n%q\nwant\n%q", warnings, wantWarn)
	}
}

func TestMigPartedConversion(t *testing.T) {
	f, _, err := Load("testdata/mig-parted.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range f.Configs {
		if c.MIG.Strategy != MIGStrategyMixed || c.MIG.MigPartedConfig != name {
			t.Errorf("config %s: mig = %+v", name, c.MIG)
		}
	}
	sel, err := f.Select("n1", map[string]string{ConfigLabel: "custom-config"})
	if err != nil {
		t.Fatal(err)
	}
	if sel.Reason != ReasonGPUAgentLabel || len(sel.MIGLayout) != 3 ||
		!reflect.DeepEqual(sel.MIGLayout[2].MigDevices, map[string]int{"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}) {
		t.Errorf("Select = %+v", sel)
	}
	// Defect: a bare mig-parted file (the GPU Operator's
	// default-mig-parted-config) served nothing without a label.
	if sel, err := f.Select("n1", nil); err != nil || sel.Reason != ReasonImplicit || sel.MIGLayout != nil ||
		sel.Config.MIG.Strategy != MIGStrategyMixed {
		t.Errorf("Select without label or default: %+v, %v; want the implicit whole-GPU default, MIG left alone", sel, err)
	}
}

func TestSelect(t *testing.T) {
	f, _, err := Load("testdata/gpu-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		node      string
		labels    map[string]string
		want      string
		reason    SelectReason
		layoutLen int
		wantErr   string
	}{
		{name: "node entry", node: "gpu-node-7", want: "mig-mixed", reason: ReasonNodeEntry, layoutLen: 2},
		{name: "node entry beats label", node: "gpu-node-8.example.com", labels: map[string]string{ConfigLabel: "a100-all-1g"},
			want: "shared", reason: ReasonNodeEntry},
		{name: "label", node: "gpu-node-9", labels: map[string]string{ConfigLabel: "a100-all-1g"},
			want: "a100-all-1g", reason: ReasonGPUAgentLabel, layoutLen: 1},
		{name: "empty label is no label", node: "gpu-node-9", labels: map[string]string{ConfigLabel: ""},
			want: "default", reason: ReasonDefaultConfig},
		{name: "default", node: "gpu-node-9", labels: map[string]string{"other": "x"}, want: "default", reason: ReasonDefaultConfig},
		{name: "label naming a missing config", node: "gpu-node-9", labels: map[string]string{ConfigLabel: "nope"},
			wantErr: "node gpu-node-9: label gpu-agent.io/config=nope names no config (configs: a100-all-1g, default, mig-mixed, shared)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel, err := f.Select(tt.node, tt.labels)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if sel.Name != tt.want || sel.Reason != tt.reason || sel.Config != f.Configs[tt.want] || len(sel.MIGLayout) != tt.layoutLen {
				t.Errorf("Select = {%s %s layout %d}, want {%s %s layout %d}",
					sel.Name, sel.Reason, len(sel.MIGLayout), tt.want, tt.reason, tt.layoutLen)
			}
		})
	}
}

// MIG device attributes listed that change nothing, or too many to save
// the scheduler memory, are warnings, with the field.
func TestMIGDeviceAttributesWarnings(t *testing.T) {
	f, warnings, err := Parse([]byte(`version: v1
configs:
  default:
    dra:
      migDeviceAttributes: [type, uuid, index, productName, brand, architecture, parentUUID, driverVersion]
`))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`configs.default.dra.migDeviceAttributes[0]: "type" is always published on MIG devices: listing it changes nothing (line 5)`,
		"configs.default.dra.migDeviceAttributes: 9 attributes per MIG device (with type and profile): above 8 the scheduler's decoded map of each doubles, so this saves little of what leaving attributes out is for (line 5)",
	}
	if len(warnings) != len(want) {
		t.Fatalf("warnings = %q, want %d", warnings, len(want))
	}
	for i, w := range want {
		if warnings[i] != w {
			t.Errorf("warning %d = %q, want %q", i, warnings[i], w)
		}
	}
	if got := f.Configs["default"].DRA.MIGDeviceAttributes; len(got) != 8 || got[7] != "driverVersion" {
		t.Errorf("MIGDeviceAttributes = %q", got)
	}
}

func TestNoDefaultIsAWarning(t *testing.T) {
	f, warnings, err := Parse([]byte("version: v1\nnodes: {a: x}\nconfigs:\n  x: {}\n  bad+name: {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`configs: no "default" config: a node without a nodes: entry or a gpu-agent.io/config or nvidia.com/device-plugin.config label gets the implicit default (whole GPUs, existing MIG devices) (line 3)`,
		`configs["bad+name"]: config name is not a valid label value, so the gpu-agent.io/config label cannot select it (line 5)`,
	}
	if !reflect.DeepEqual(warnings, want) {
		t.Errorf("warnings = %q, want %q", warnings, want)
	}
	if sel, err := f.Select("b", nil); err != nil || sel.Reason != ReasonImplicit {
		t.Errorf("Select for an unlisted node without a default: %+v, %v; want the implicit default", sel, err)
	}
	if sel, err := f.Select("a", nil); err != nil || sel.Name != "x" {
		t.Errorf("Select(a) = %+v, %v", sel, err)
	}
}

func TestMergeKeysAndAliases(t *testing.T) {
	f, _, err := Parse([]byte(`version: v1
configs:
  base: &base
    allocation: {policy: packed}
    mig: {strategy: single}
  default:
    <<: *base
    mig: {strategy: mixed}
  other: *base
`))
	if err != nil {
		t.Fatal(err)
	}
	d := f.Configs["default"]
	if d.Allocation.Policy != PolicyPacked || d.MIG.Strategy != MIGStrategyMixed {
		t.Errorf("merged config = %+v", d)
	}
	if f.Configs["other"].MIG.Strategy != MIGStrategySingle {
		t.Errorf("aliased config = %+v", f.Configs["other"])
	}
}

func TestQuantity(t *testing.T) {
	tests := []struct {
		in   string
		want Quantity
		str  string
		err  bool
	}{
		{in: "1024", want: 1024, str: "1Ki"},
		{in: "10Gi", want: 10 << 30, str: "10Gi"},
		{in: "512M", want: 512e6, str: "500000Ki"},
		{in: "1.5Gi", want: 3 << 29, str: "1536Mi"},
		{in: "2k", want: 2000, str: "2000"},
		{in: "1T", want: 1e12, str: "976562500Ki"},
		{in: "1000", want: 1000, str: "1000"},
		{in: "0.5", err: true},
		{in: "10GB", err: true},
		{in: "-1Gi", err: true},
		{in: "99999999999Pi", err: true},
	}
	for _, tt := range tests {
		got, err := ParseQuantity(tt.in)
		if (err != nil) != tt.err {
			t.Errorf("ParseQuantity(%q) error = %v, want error %v", tt.in, err, tt.err)
			continue
		}
		if tt.err {
			continue
		}
		if got != tt.want || got.String() != tt.str {
			t.Errorf("ParseQuantity(%q) = %d (%s), want %d (%s)", tt.in, got, got, tt.want, tt.str)
		}
		if back, err := ParseQuantity(got.String()); err != nil || back != got {
			t.Errorf("String() of %q does not parse back: %v, %v", tt.in, back, err)
		}
	}
}

func TestNamesAndRefs(t *testing.T) {
	for s, want := range map[string]bool{
		"nvidia.com/gpu": true, "nvidia.com/mig-1g.10gb": true, "nvidia.com/mig-1c.2g.20gb": true,
		"nvidia.com/mig-1g.10gb.me": true, "nvidia.com/gpu.shared": false, "nvidia.com/mig-1g": false,
		"gpu": false, "example.com/gpu": false,
	} {
		if got := isSharableName(s); got != want {
			t.Errorf("isSharableName(%q) = %v", s, got)
		}
	}
	for s, ok := range map[string]bool{
		"nvidia.com/gpu.shared": true, "example.com/a_b-c.d": true, "gpu": false, "Nvidia.com/gpu": false,
		"kubernetes.io/gpu": false, "a.kubernetes.io/gpu": false, "nvidia.com/": false, "nvidia.com/-x": false,
		"nvidia.com/a/b": false, "nvidia.com/" + strings.Repeat("a", 64): false,
	} {
		if err := checkExtendedResourceName(s); (err == nil) != ok {
			t.Errorf("checkExtendedResourceName(%q) = %v, want ok=%v", s, err, ok)
		}
	}
	for s, ok := range map[string]bool{
		"0": true, "12": true, "0:3": true, "GPU-8f4a2c5e-1b3d-4e6f-9a0b-1c2d3e4f5a6b": true,
		"MIG-8f4a2c5e-1b3d-4e6f-9a0b-1c2d3e4f5a6b": true, "MIG-GPU-8f4a2c5e-1b3d-4e6f-9a0b-1c2d3e4f5a6b/1/0": true,
		"GPU-123": false, "0:": false, "-1": false, "MIG-GPU-8f4a2c5e-1b3d-4e6f-9a0b-1c2d3e4f5a6b/1": false, "": false,
	} {
		if got := IsDeviceRef(s); got != ok {
			t.Errorf("IsDeviceRef(%q) = %v", s, got)
		}
	}
	for s, ok := range map[string]bool{
		"1g.10gb": true, "7g.80gb": true, "1c.3g.40gb": true, "1g.10gb+me": true, "1g.24gb+gfx": true,
		"1g.24gb+me.all": true, "1g.24gb-me": true, "0g.10gb": false, "9g.80gb": false, "1g.0gb": false,
		"1g": false, "1g.10GB": false, "1g.10gb+": false, "4c.3g.40gb": false,
	} {
		if err := checkProfile(s); (err == nil) != ok {
			t.Errorf("checkProfile(%q) = %v, want ok=%v", s, err, ok)
		}
	}
}

// TestMarshalRoundTrip checks that every accepted example survives being
// written in the gpu-agent format and read back.
func TestMarshalRoundTrip(t *testing.T) {
	files, err := filepath.Glob("testdata/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for _, name := range files {
		t.Run(filepath.Base(name), func(t *testing.T) {
			data, err := os.ReadFile(name)
			if err != nil {
				t.Fatal(err)
			}
			checkRoundTrip(t, data)
		})
	}
}

// checkRoundTrip parses data; when accepted, its marshalled form must parse
// to the same configs and marshal to the same bytes.
func checkRoundTrip(t *testing.T, data []byte) {
	t.Helper()
	f, _, err := Parse(data)
	if err != nil {
		return
	}
	if _, err := f.Validate(); err != nil {
		t.Fatalf("accepted file does not re-validate: %v", err)
	}
	out, err := f.Marshal()
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	g, _, err := Parse(out)
	if err != nil {
		t.Fatalf("marshalled file does not parse: %v\n%s", err, out)
	}
	if g.Format != FormatGPUAgent {
		t.Errorf("marshalled format = %s", g.Format)
	}
	if !reflect.DeepEqual(normalize(f.Configs), normalize(g.Configs)) {
		t.Errorf("configs changed in the round trip:\n%s", out)
	}
	out2, err := g.Marshal()
	if err != nil || string(out2) != string(out) {
		t.Errorf("second marshal differs: %v\n%s\n---\n%s", err, out, out2)
	}
}

// normalize maps configs to their marshalled form, where nil and empty
// collections are the same thing.
func normalize(cs map[string]*Config) map[string]string {
	out := map[string]string{}
	for name, c := range cs {
		b, _ := (&File{Configs: map[string]*Config{name: c}}).Marshal()
		out[name] = string(b)
	}
	return out
}

func BenchmarkParse(b *testing.B) {
	data, err := os.ReadFile("testdata/gpu-agent.yaml")
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := Parse(data); err != nil {
			b.Fatal(err)
		}
	}
}
