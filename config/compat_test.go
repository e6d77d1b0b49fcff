package config

import (
	"fmt"
	"strings"
	"testing"
)

// nvidiaFormatTest is one NVIDIA-format file and how it reads.
type nvidiaFormatTest struct {
	name string
	opts ParseOptions
	in   string
	want nvidiaWant
}

type nvidiaWant struct {
	warnings []string // each warning contains one of these, in order
	errs     []string // each error contains one of these, in order
	check    func(c *Config) error
}

// nvidiaFormatTests are NVIDIA-format files read item by item as NVIDIA's
// device plugin reads them (api/config/v1 of k8s-device-plugin v0.20.0):
// what each field means, which values it refuses, and what it ignores. The
// fixtures are written here after the examples NVIDIA ships.
func nvidiaFormatTests() []nvidiaFormatTest {
	return []nvidiaFormatTest{
		{
			name: "unknown keys anywhere are ignored with a warning naming path and line",
			in: `version: v1
flags:
  migStrategy: single
  futureFlag: 3
  plugin:
    passDeviceSpec: true
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      weight: 5
newSection: {a: 1}
`,
			want: nvidiaWant{
				warnings: []string{
					"flags.futureFlag: unknown field, ignored as NVIDIA's device plugin ignores it (line 4)",
					"flags.plugin.passDeviceSpec: unknown field, ignored as NVIDIA's device plugin ignores it; did you mean passDeviceSpecs? (line 6)",
					"sharing.timeSlicing.resources[0].weight: unknown field, ignored as NVIDIA's device plugin ignores it (line 12)",
					"newSection: unknown field, ignored as NVIDIA's device plugin ignores it (line 13)",
				},
				check: func(c *Config) error {
					if c.MIG.Strategy != MIGStrategySingle || c.Sharing.TimeSlicing.Resources[0].Replicas != 2 || c.DevicePlugin.PassDeviceSpecs {
						return fmt.Errorf("known fields not read: %+v", c)
					}
					return nil
				},
			},
		},
		{
			name: "a key that names a field but for case is that field, as encoding/json reads it",
			in:   "version: v1\nflags:\n  MigStrategy: mixed\n  plugin:\n    PASSDEVICESPECS: true\n",
			want: nvidiaWant{
				warnings: []string{
					"flags.MigStrategy: read as migStrategy, as NVIDIA's parser matches field names regardless of case (line 3)",
					"flags.plugin.PASSDEVICESPECS: read as passDeviceSpecs",
				},
				check: func(c *Config) error {
					if c.MIG.Strategy != MIGStrategyMixed || !c.DevicePlugin.PassDeviceSpecs {
						return fmt.Errorf("mis-cased fields not read: %+v", c)
					}
					return nil
				},
			},
		},
		{
			name: "a wrong type is still an error, as NVIDIA's parser fails on it",
			in:   "version: v1\nflags:\n  migStrategy: none\n  gdsEnabled: maybe\n",
			want: nvidiaWant{errs: []string{"flags.gdsEnabled: expected true or false"}},
		},
		{
			name: "sharedDevicesAllocationPolicy packed",
			in:   "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n",
			want: nvidiaWant{check: policy(PolicyPacked)},
		},
		{
			name: "sharedDevicesAllocationPolicy distributed",
			in:   "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: distributed\n",
			want: nvidiaWant{check: policy(PolicyDistributed)},
		},
		{
			name: "no sharedDevicesAllocationPolicy: NVIDIA's default, distributed",
			in:   "version: v1\nflags:\n  migStrategy: none\n",
			want: nvidiaWant{check: policy(PolicyDistributed)},
		},
		{
			name: "sharedDevicesAllocationPolicy refuses what NVIDIA refuses, gpu-agent's topology included",
			in:   "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: topology\n",
			want: nvidiaWant{errs: []string{`flags.plugin.sharedDevicesAllocationPolicy: unknown value "topology": must be distributed or packed, as for NVIDIA's plugin (line 4)`}},
		},
		{
			name: "deviceIDStrategy index",
			in:   "version: v1\nflags:\n  plugin:\n    deviceIDStrategy: index\n",
			want: nvidiaWant{check: func(c *Config) error {
				if c.DevicePlugin.DeviceIDStrategy != DeviceIDStrategyIndex {
					return fmt.Errorf("deviceIDStrategy %q", c.DevicePlugin.DeviceIDStrategy)
				}
				return nil
			}},
		},
		{
			name: "deviceIDStrategy refuses other values",
			in:   "version: v1\nflags:\n  plugin:\n    deviceIDStrategy: serial\n",
			want: nvidiaWant{errs: []string{`flags.plugin.deviceIDStrategy: unknown value "serial": must be uuid or index (line 4)`}},
		},
		{
			name: "gdsEnabled, mofedEnabled and gdrcopyEnabled set NVIDIA's environment",
			in:   "version: v1\nflags:\n  gdsEnabled: true\n  mofedEnabled: true\n  gdrcopyEnabled: false\n",
			want: nvidiaWant{check: func(c *Config) error {
				env := c.DevicePlugin.ContainerEnv()
				if len(env) != 2 || env["NVIDIA_GDS"] != "enabled" || env["NVIDIA_MOFED"] != "enabled" {
					return fmt.Errorf("env %v, want NVIDIA_GDS and NVIDIA_MOFED enabled", env)
				}
				return nil
			}},
		},
		{
			name: "MPS with migStrategy mixed is refused, as NVIDIA's plugin refuses to start with it",
			in:   "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
			want: nvidiaWant{errs: []string{"flags.migStrategy: mixed is not supported with sharing.mps: NVIDIA's device plugin refuses the pair"}},
		},
		{
			name: "MPS with --mig-strategy mixed and no migStrategy: refused at sharing.mps",
			opts: ParseOptions{MIGStrategy: MIGStrategyMixed},
			in:   "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
			want: nvidiaWant{errs: []string{"sharing.mps: not supported with the agent's --mig-strategy mixed"}},
		},
		{
			name: "MPS with migStrategy single: accepted, MIG devices refused when planned",
			in:   "version: v1\nflags:\n  migStrategy: single\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
			want: nvidiaWant{check: func(c *Config) error {
				if !c.Sharing.MPS.RefuseMIGDevices {
					return fmt.Errorf("MPS of an NVIDIA-format file does not refuse MIG devices")
				}
				return nil
			}},
		},
		{
			name: "no migStrategy: --mig-strategy, as NVIDIA's MIG_STRATEGY",
			opts: ParseOptions{MIGStrategy: MIGStrategySingle},
			in:   "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
			want: nvidiaWant{check: strategy(MIGStrategySingle)},
		},
		{
			name: "migStrategy in the file wins over --mig-strategy",
			opts: ParseOptions{MIGStrategy: MIGStrategySingle},
			in:   "version: v1\nflags:\n  migStrategy: none\n",
			want: nvidiaWant{check: strategy(MIGStrategyNone)},
		},
		{
			name: "timeSlicing rename and devices are ignored with a warning, as NVIDIA's plugin ignores them",
			in: `version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu-ts
      devices: [0, 1]
      replicas: 4
`,
			want: nvidiaWant{
				warnings: []string{
					"sharing.timeSlicing.resources[0].devices: ignored, as NVIDIA's device plugin ignores it in its format: every device of nvidia.com/gpu is shared (line 7); gpu-agent's own format (version: v1 with configs:) honours devices",
					"sharing.timeSlicing.resources[0].rename: nvidia.com/gpu-ts ignored, as NVIDIA's device plugin ignores it in its format: the replicas are served as nvidia.com/gpu (line 6); gpu-agent's own format (version: v1 with configs:) honours rename",
				},
				check: replicated(func(c *Config) ReplicatedResource { return c.Sharing.TimeSlicing.Resources[0] }, "", true),
			},
		},
		{
			name: "a bare rename is ignored too, and a device count",
			in:   "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, rename: gpu-ts, devices: 2, replicas: 4}\n",
			want: nvidiaWant{
				warnings: []string{
					"sharing.timeSlicing.resources[0].devices: ignored",
					"sharing.timeSlicing.resources[0].rename: nvidia.com/gpu-ts ignored",
				},
				check: replicated(func(c *Config) ReplicatedResource { return c.Sharing.TimeSlicing.Resources[0] }, "", true),
			},
		},
		{
			name: "renameByDefault stays: a rename other than <name>.shared is ignored",
			in:   "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, replicas: 4}\n",
			want: nvidiaWant{
				warnings: []string{"sharing.timeSlicing.resources[0].rename: nvidia.com/gpu-ts ignored, as NVIDIA's device plugin ignores it in its format: the replicas are served as nvidia.com/gpu.shared (line 6)"},
				check:    replicated(func(c *Config) ReplicatedResource { return c.Sharing.TimeSlicing.Resources[0] }, "nvidia.com/gpu.shared", true),
			},
		},
		{
			name: "renameByDefault with the rename it gives anyway, and devices: all: no warning",
			in:   "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, rename: nvidia.com/gpu.shared, devices: all, replicas: 4}\n",
			want: nvidiaWant{check: replicated(func(c *Config) ReplicatedResource { return c.Sharing.TimeSlicing.Resources[0] }, "nvidia.com/gpu.shared", true)},
		},
		{
			name: "MPS rename and devices are ignored the same way",
			in:   "version: v1\nflags:\n  migStrategy: none\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, rename: nvidia.com/gpu.mps, devices: [\"0\"], replicas: 2}\n",
			want: nvidiaWant{
				warnings: []string{
					"sharing.mps.resources[0].devices: ignored",
					"sharing.mps.resources[0].rename: nvidia.com/gpu.mps ignored",
				},
				check: replicated(func(c *Config) ReplicatedResource { return c.Sharing.MPS.Resources[0].ReplicatedResource }, "", true),
			},
		},
		{
			name: "no migStrategy and no --mig-strategy: NVIDIA's default, none",
			in:   "version: v1\nflags:\n  failOnInitError: false\n",
			want: nvidiaWant{
				warnings: []string{"flags.failOnInitError: ignored"},
				check:    strategy(MIGStrategyNone),
			},
		},
	}
}

func TestNVIDIAFormatFields(t *testing.T) {
	for _, tt := range nvidiaFormatTests() {
		t.Run(tt.name, func(t *testing.T) {
			f, warnings, err := ParseWith([]byte(tt.in), tt.opts)
			containsEach(t, "warning", warnings, tt.want.warnings)
			var errs []string
			if err != nil {
				for _, e := range err.(ErrorList) {
					errs = append(errs, e.Error())
				}
			}
			containsEach(t, "error", errs, tt.want.errs)
			if err == nil && tt.want.check != nil {
				if err := tt.want.check(f.Configs[DefaultConfigName]); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

func containsEach(t *testing.T, what string, got, want []string) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%ss %q, want %d", what, got, len(want))
		return
	}
	for i := range want {
		if !strings.Contains(got[i], want[i]) {
			t.Errorf("%s %d = %q, want it to contain %q", what, i, got[i], want[i])
		}
	}
}

// replicated checks the rename and device selection of the sharing entry
// get returns.
func replicated(get func(*Config) ReplicatedResource, rename string, all bool) func(*Config) error {
	return func(c *Config) error {
		r := get(c)
		if r.Rename != rename || r.Devices.All != all {
			return fmt.Errorf("entry %+v: want rename %q, all devices %v", r, rename, all)
		}
		return nil
	}
}

// gpu-agent's own format honours what an NVIDIA-format file may not set: a
// sharing entry's rename and devices, without a warning.
func TestOwnFormatHonoursRenameAndDevices(t *testing.T) {
	for _, tt := range []struct {
		name, in string
		get      func(*Config) ReplicatedResource
	}{
		{"timeSlicing", "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, devices: [0, 1], replicas: 4}\n",
			func(c *Config) ReplicatedResource { return c.Sharing.TimeSlicing.Resources[0] }},
		{"mps", "version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, devices: [0, 1], replicas: 2}\n",
			func(c *Config) ReplicatedResource { return c.Sharing.MPS.Resources[0].ReplicatedResource }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f, warnings, err := Parse([]byte(tt.in))
			if err != nil || len(warnings) != 0 {
				t.Fatalf("err %v, warnings %q; want neither", err, warnings)
			}
			r := tt.get(f.Configs[DefaultConfigName])
			if r.Rename != "nvidia.com/gpu-ts" || strings.Join(r.Devices.List, ",") != "0,1" {
				t.Errorf("entry %+v: want rename nvidia.com/gpu-ts on devices 0 and 1", r)
			}
		})
	}
}

func policy(p AllocationPolicy) func(*Config) error {
	return func(c *Config) error {
		if c.Allocation.Policy != p {
			return fmt.Errorf("allocation policy %q, want %q", c.Allocation.Policy, p)
		}
		return nil
	}
}

func strategy(s MIGStrategy) func(*Config) error {
	return func(c *Config) error {
		if c.MIG.Strategy != s {
			return fmt.Errorf("MIG strategy %q, want %q", c.MIG.Strategy, s)
		}
		return nil
	}
}

// gpu-agent's own format and mig-parted's stay strict: NVIDIA's mig-parted
// refuses an unexpected field, and gpu-agent's format has no reason not to.
func TestOwnFormatsStayStrict(t *testing.T) {
	for name, in := range map[string]string{
		"gpu-agent":  "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      passDeviceSpec: true\n",
		"mig-parted": "version: v1\nmig-configs:\n  all-disabled:\n  - {devices: all, mig-enabled: false, mig-device: {}}\n",
	} {
		if _, _, err := Parse([]byte(in)); err == nil || !strings.Contains(err.Error(), "unknown field") {
			t.Errorf("%s: %v, want an unknown field error", name, err)
		}
	}
	// Nor is a mis-cased key read there.
	if _, _, err := Parse([]byte("version: v1\nconfigs:\n  default:\n    devicePlugin:\n      PassDeviceSpecs: true\n")); err == nil {
		t.Error("gpu-agent format: a mis-cased field was accepted")
	}
}

// A file of thousands of unknown keys gives a bounded list of warnings.
func TestUnknownKeyWarningsBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: v1\nflags:\n")
	for i := range 500 {
		fmt.Fprintf(&b, "  k%d: 1\n", i)
	}
	_, warnings, err := Parse([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != maxLenientWarnings+1 || !strings.Contains(warnings[maxLenientWarnings], "the rest are ignored") {
		t.Errorf("%d warnings, want %d and a summary; last %q", len(warnings), maxLenientWarnings+1, warnings[len(warnings)-1])
	}
}

// gpu-agent's format has the same fields as NVIDIA's, under devicePlugin.
func TestOwnFormatDevicePluginFields(t *testing.T) {
	f, _, err := Parse([]byte(`version: v1
configs:
  default:
    devicePlugin: {deviceIDStrategy: index, gdsEnabled: true, mofedEnabled: true, gdrcopyEnabled: true}
    allocation: {policy: packed}
    sharing:
      mps:
        resources:
        - {name: nvidia.com/mig-1g.10gb, replicas: 2}
    mig: {strategy: mixed}
`))
	if err != nil {
		t.Fatal(err)
	}
	c := f.Configs[DefaultConfigName]
	if c.DevicePlugin.DeviceIDStrategy != DeviceIDStrategyIndex || len(c.DevicePlugin.ContainerEnv()) != 3 || c.Allocation.Policy != PolicyPacked {
		t.Errorf("devicePlugin %+v, allocation %+v", c.DevicePlugin, c.Allocation)
	}
	if c.Sharing.MPS.RefuseMIGDevices {
		t.Error("gpu-agent format refuses MPS of MIG devices; it allows them")
	}
	if _, _, err := Parse([]byte("version: v1\nconfigs:\n  default:\n    devicePlugin: {deviceIDStrategy: serial}\n")); err == nil ||
		!strings.Contains(err.Error(), `configs.default.devicePlugin.deviceIDStrategy: unknown value "serial"`) {
		t.Errorf("bad deviceIDStrategy: %v", err)
	}
	// Written back and read again, nothing is lost.
	out, err := f.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	g, _, err := Parse(out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if g.Configs[DefaultConfigName].DevicePlugin != c.DevicePlugin {
		t.Errorf("round trip: %+v, want %+v", g.Configs[DefaultConfigName].DevicePlugin, c.DevicePlugin)
	}
}

// --mig-strategy reaches every config a file does not give a strategy:
// mig-parted's entries, the implicit default and a layout picked by
// mig-manager's label, in a single file and in a ConfigMap, and the
// GPU Operator's kind of mig-parted file (entries of several profiles)
// reads under every strategy.
func TestMIGStrategyOption(t *testing.T) {
	const migParted = `version: v1
mig-configs:
  all-disabled:
  - {devices: all, mig-enabled: false}
  all-balanced:
  - device-filter: ["0x233010DE"]
    devices: all
    mig-enabled: true
    mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
`
	const ownNoStrategy = "version: v1\nconfigs:\n  small:\n    health: {ignoredXids: [43]}\n"
	for _, tt := range []struct {
		opt  MIGStrategy
		want MIGStrategy // for the mig-parted entries, implicit default and label
		own  MIGStrategy // for a gpu-agent config without mig.strategy
	}{
		{"", MIGStrategyMixed, MIGStrategyNone},
		{MIGStrategySingle, MIGStrategySingle, MIGStrategySingle},
		{MIGStrategyNone, MIGStrategyNone, MIGStrategyNone},
		{MIGStrategyMixed, MIGStrategyMixed, MIGStrategyMixed},
	} {
		t.Run("mig-strategy="+string(tt.opt), func(t *testing.T) {
			o := ParseOptions{MIGStrategy: tt.opt}
			f, _, err := ParseWith([]byte(migParted), o)
			if err != nil {
				t.Fatal(err)
			}
			for name, c := range f.Configs {
				if c.MIG.Strategy != tt.want {
					t.Errorf("mig-parted entry %s: strategy %q, want %q", name, c.MIG.Strategy, tt.want)
				}
			}
			sel, err := f.Select("n", nil)
			if err != nil || sel.Reason != ReasonImplicit || sel.Config.MIG.Strategy != tt.want {
				t.Errorf("implicit default: %+v %v, want strategy %q", sel, err, tt.want)
			}

			// A ConfigMap: a gpu-agent key beside the mig-parted one, and
			// the label picking a layout for a config whose strategy is none.
			u := Update{Files: map[string]string{"mig": migParted, "own": ownNoStrategy + "  plain:\n    mig: {strategy: none}\n"}}
			f, _, err = u.ParseWith("", o)
			if err != nil {
				t.Fatal(err)
			}
			if got := f.Configs["small"].MIG.Strategy; got != tt.own {
				t.Errorf("gpu-agent config without a strategy: %q, want %q", got, tt.own)
			}
			sel, err = f.Select("n", map[string]string{ConfigLabel: "plain", MIGConfigLabel: "all-balanced"})
			if err != nil {
				t.Fatal(err)
			}
			wantLabel := tt.want
			if sel.MIGLayout == nil || sel.Config.MIG.Strategy != wantLabel {
				t.Errorf("label layout on a strategy-none config: strategy %q, want %q", sel.Config.MIG.Strategy, wantLabel)
			}
			// One file, through Update.ParseWith.
			f, _, err = Update{Data: []byte(ownNoStrategy)}.ParseWith("", o)
			if err != nil || f.Configs["small"].MIG.Strategy != tt.own {
				t.Errorf("single file: %v, %+v", err, f)
			}
		})
	}
	if err := (ParseOptions{MIGStrategy: "auto"}).Check(); err == nil || !strings.Contains(err.Error(), "none, single or mixed") {
		t.Errorf("Check(auto) = %v", err)
	}
	// The built-in default follows the option too.
	if s := BuiltIn(ParseOptions{MIGStrategy: MIGStrategySingle}).Configs[DefaultConfigName].MIG.Strategy; s != MIGStrategySingle {
		t.Errorf("built-in default strategy %q", s)
	}
	if s := BuiltIn(ParseOptions{}).Configs[DefaultConfigName].MIG.Strategy; s != MIGStrategyMixed {
		t.Errorf("built-in default strategy %q, want mixed", s)
	}
}
