package agent

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/timeslice"
)

// The fixtures below are written for these tests after the examples NVIDIA
// ships (the k8s-device-plugin README and Helm values, the GPU Operator's
// time-slicing, MPS and MIG pages), and the expectations are what NVIDIA's
// device plugin advertises for them: for each, the resource counts, the
// warnings it logs and the errors it refuses with.

// NVIDIA's fine-grained time-slicing example: one ConfigMap for whole-GPU and
// MIG nodes alike, naming resources some nodes lack.
const tsFineGrained = `# whole GPUs x8, each MIG profile by its size
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources:
    - {name: nvidia.com/gpu, replicas: 8}
    - {name: nvidia.com/mig-1g.10gb, replicas: 2}
    - {name: nvidia.com/mig-3g.40gb, replicas: 3}
`

// The README's plain time-slicing example: whole GPUs only.
const tsGPUsOnly = `version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 10
`

// The Helm chart's three example configs: only the MIG strategy.
func helmStrategy(s string) string { return "version: v1\nflags:\n  migStrategy: " + s + "\n" }

// The GPU Operator's MPS example: no MIG strategy of its own, so the
// device plugin's (MIG_STRATEGY, single under the Operator) applies.
const mpsAny = `version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
`

// MPS of MIG devices in gpu-agent's own format, which allows it.
const mpsOfMIGOwnFormat = `version: v1
configs:
  default:
    mig: {strategy: mixed}
    sharing:
      mps:
        resources:
        - {name: nvidia.com/mig-1g.10gb, replicas: 2}
`

// A mig-parted file alone, as the GPU Operator mounts for mig-manager.
const migPartedOnly = `version: v1
mig-configs:
  all-disabled:
  - {devices: all, mig-enabled: false}
  all-1g.10gb:
  - {devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 7}}
  all-balanced:
  - devices: all
    mig-enabled: true
    mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
`

// fakeMPS runs no daemon and reports every one healthy.
type fakeMPS struct {
	mu      sync.Mutex
	daemons []mps.Daemon
}

func (f *fakeMPS) Set(d []mps.Daemon) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.daemons = slices.Clone(d)
	return nil
}

func (f *fakeMPS) Healthy(string) (bool, string) { return true, "" }

func withMIGStrategy(s config.MIGStrategy) harnessOption {
	return func(h *harness) { h.opts.MIGStrategy = s }
}

func withMPS(f *fakeMPS) harnessOption {
	return func(h *harness) { h.opts.MPS = f }
}

// TestNVIDIACompatibility is item by item what NVIDIA's device plugin
// advertises for its own examples on unlike nodes, through the whole loop:
// config content in, catalog and /status out.
// unfitDevice names a GPU no node in these tests has (gpu-agent's format:
// NVIDIA's ignores devices, as NVIDIA's plugin does).
const unfitDevice = "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - {name: nvidia.com/gpu, replicas: 2, devices: [9]}\n"

func TestNVIDIACompatibility(t *testing.T) {
	tests := []struct {
		name     string
		profile  string
		simOpts  []sim.Option
		strategy config.MIGStrategy // --mig-strategy
		labels   map[string]string
		cfg      string
		want     map[string]int // resource -> devices advertised
		// Each warning (on /status) contains one of these, in order.
		warnings []string
		// The config error on /status, and what is served instead.
		err, serving string
		daemons      int
	}{
		{
			name: "fine-grained time-slicing on a whole-GPU A100 node: MIG entries skipped", profile: "dgx-a100", cfg: tsFineGrained,
			want: map[string]int{ResourceGPU: 64},
			warnings: []string{
				"sharing.timeSlicing.resources[1].name: this node offers no nvidia.com/mig-1g.10gb (it offers nvidia.com/gpu); the entry is skipped",
				"sharing.timeSlicing.resources[2].name: this node offers no nvidia.com/mig-3g.40gb",
			},
		},
		{
			name: "fine-grained time-slicing on a mixed MIG node: 7x 1g.10gb per H100, 2 replicas each", profile: "dgx-h100-mig", cfg: tsFineGrained,
			want: map[string]int{"nvidia.com/mig-1g.10gb": 112},
			warnings: []string{
				"sharing.timeSlicing.resources[0].name: this node offers no nvidia.com/gpu",
				"sharing.timeSlicing.resources[2].name: this node offers no nvidia.com/mig-3g.40gb",
			},
		},
		{
			name: "only entry names a resource the node lacks: skipped, the node still serves", profile: "dgx-h100-mig",
			cfg:  helmStrategy("mixed") + "sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 10}\n",
			want: map[string]int{"nvidia.com/mig-1g.10gb": 56}, warnings: []string{"this node offers no nvidia.com/gpu"},
		},
		{
			name: "time-slicing of whole GPUs on a whole-GPU node", profile: "pcie-4gpu", cfg: tsGPUsOnly,
			want: map[string]int{ResourceGPU: 40},
		},
		{
			// A user switching with an old file keeps what NVIDIA's plugin
			// served: pods asking for nvidia.com/gpu still schedule.
			name: "rename and devices are ignored in NVIDIA's format, as NVIDIA's plugin ignores them", profile: "pcie-4gpu",
			cfg:  "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, devices: [0], replicas: 4}\n",
			want: map[string]int{ResourceGPU: 16},
			warnings: []string{
				"sharing.timeSlicing.resources[0].devices: ignored, as NVIDIA's device plugin ignores it in its format: every device of nvidia.com/gpu is shared (line 5); gpu-agent's own format",
				"sharing.timeSlicing.resources[0].rename: nvidia.com/gpu-ts ignored, as NVIDIA's device plugin ignores it in its format: the replicas are served as nvidia.com/gpu (line 5); gpu-agent's own format",
			},
		},
		{
			name: "rename and devices are honoured in gpu-agent's format", profile: "pcie-4gpu",
			cfg:  "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, devices: [0], replicas: 4}\n",
			want: map[string]int{ResourceGPU: 3, "nvidia.com/gpu-ts": 4},
		},
		{
			name: "migStrategy none: MIG-enabled GPUs are whole nvidia.com/gpu, as NVIDIA's", profile: "dgx-h100-mig", cfg: helmStrategy("none"),
			want:     map[string]int{ResourceGPU: 8},
			warnings: []string{"mig.strategy: none offers MIG-enabled GPU(s) 0, 1, 2, 3, 4, 5, 6, 7 whole as nvidia.com/gpu"},
		},
		{
			name: "migStrategy none on MIG-enabled GPUs without instances", profile: "dgx-a100", simOpts: []sim.Option{sim.WithMIGEnabled()},
			cfg: helmStrategy("none"), want: map[string]int{ResourceGPU: 8}, warnings: []string{"whole as nvidia.com/gpu"},
		},
		{
			name: "migStrategy single: MIG devices are nvidia.com/gpu", profile: "dgx-h100-mig", cfg: helmStrategy("single"),
			want: map[string]int{ResourceGPU: 56},
		},
		{
			name: "migStrategy mixed: one resource per profile", profile: "dgx-h100-mig", cfg: helmStrategy("mixed"),
			want: map[string]int{"nvidia.com/mig-1g.10gb": 56},
		},
		{
			name: "no migStrategy in the file: the agent's --mig-strategy, as NVIDIA's MIG_STRATEGY", profile: "dgx-h100-mig",
			strategy: config.MIGStrategySingle, cfg: tsGPUsOnly,
			want: map[string]int{ResourceGPU: 560},
		},
		{
			name: "the file's migStrategy wins over --mig-strategy", profile: "dgx-h100-mig",
			strategy: config.MIGStrategySingle, cfg: helmStrategy("mixed"),
			want: map[string]int{"nvidia.com/mig-1g.10gb": 56},
		},
		{
			name: "GPU Operator MPS example under --mig-strategy single on whole GPUs", profile: "dgx-h100",
			strategy: config.MIGStrategySingle, cfg: mpsAny,
			want: map[string]int{ResourceGPU: 32}, daemons: 8,
		},
		{
			name: "the same on MIG devices: refused as NVIDIA refuses it; the built-in default serves meanwhile", profile: "dgx-h100-mig",
			strategy: config.MIGStrategySingle, cfg: mpsAny,
			want:    map[string]int{ResourceGPU: 56},
			err:     "NVIDIA's device plugin refuses MPS sharing of MIG devices",
			serving: BuiltInConfigName,
		},
		{
			name: "NVIDIA-format MPS with migStrategy mixed: rejected as NVIDIA rejects it", profile: "dgx-h100-mig",
			cfg:     helmStrategy("mixed") + strings.TrimPrefix(mpsAny, "version: v1\n"),
			want:    map[string]int{"nvidia.com/mig-1g.10gb": 56},
			err:     "flags.migStrategy: mixed is not supported with sharing.mps",
			serving: BuiltInConfigName,
		},
		{
			name: "gpu-agent format: MPS of MIG devices, one daemon each", profile: "dgx-h100-mig", cfg: mpsOfMIGOwnFormat,
			want: map[string]int{"nvidia.com/mig-1g.10gb": 112}, daemons: 56,
		},
		{
			name: "mig-parted file alone: the implicit default takes --mig-strategy", profile: "dgx-h100-mig",
			strategy: config.MIGStrategySingle, cfg: migPartedOnly,
			want: map[string]int{ResourceGPU: 56}, warnings: []string{`no "default" config`},
		},
		{
			name: "mig-parted file alone, no --mig-strategy: mixed", profile: "dgx-h100-mig", cfg: migPartedOnly,
			want: map[string]int{"nvidia.com/mig-1g.10gb": 56}, warnings: []string{`no "default" config`},
		},
		{
			name: "first config does not fit: the built-in default, not nothing", profile: "dgx-a100",
			cfg:  unfitDevice,
			want: map[string]int{ResourceGPU: 8}, err: `"9" names no device`, serving: BuiltInConfigName,
		},
		{
			name: "first config rejected: the built-in default, not nothing", profile: "dgx-h100-mig",
			strategy: config.MIGStrategySingle, cfg: "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
			want: map[string]int{ResourceGPU: 56}, err: "replicas: must be >= 2, got 1 (line 5)", serving: BuiltInConfigName,
		},
		{
			name: "first config selects nothing: the built-in default, not nothing", profile: "pcie-4gpu",
			labels: map[string]string{config.ConfigLabel: "nope"}, cfg: mpsOfMIGOwnFormat,
			want: map[string]int{ResourceGPU: 4}, err: "names no config", serving: BuiltInConfigName,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			daemons := &fakeMPS{}
			h := newHarness(t, simNode(t, tt.profile, tt.simOpts...), withMIGStrategy(tt.strategy), withMPS(daemons))
			if tt.labels != nil {
				h.step(LabelsChanged{Labels: tt.labels})
			}
			h.config(tt.cfg)
			got := map[string]int{}
			for name, r := range h.pub.last().Resources {
				got[name] = len(r.Devices)
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("advertised %v, want %v", got, tt.want)
			}
			st := h.a.Status().Config
			if len(st.Warnings) != len(tt.warnings) {
				t.Errorf("warnings %q, want %d", st.Warnings, len(tt.warnings))
			}
			for i, w := range tt.warnings {
				if i < len(st.Warnings) && !strings.Contains(st.Warnings[i], w) {
					t.Errorf("warning %d = %q, want it to contain %q", i, st.Warnings[i], w)
				}
			}
			if got := testutil.ToFloat64(h.a.metrics.configWarnings); got != float64(len(st.Warnings)) {
				t.Errorf("gpu_agent_config_warnings = %v, want %d", got, len(st.Warnings))
			}
			if (st.Error == "") != (tt.err == "") || !strings.Contains(st.Error, tt.err) {
				t.Errorf("config error %q, want %q", st.Error, tt.err)
			}
			if st.Serving != tt.serving {
				t.Errorf("serving %q, want %q", st.Serving, tt.serving)
			}
			fallback := 0.0
			if tt.serving == BuiltInConfigName {
				fallback = 1
			}
			if got := testutil.ToFloat64(h.a.metrics.configFallback); got != fallback {
				t.Errorf("gpu_agent_config_fallback = %v, want %v", got, fallback)
			}
			if len(daemons.daemons) != tt.daemons {
				t.Errorf("%d MPS daemons, want %d", len(daemons.daemons), tt.daemons)
			}
		})
	}
}

// A config that applies after the built-in default was served takes over,
// and the fallback is no longer reported.
func TestBuiltInDefaultGivesWay(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-a100"))
	h.config(unfitDevice)
	if h.a.Status().Config.Serving != BuiltInConfigName || h.count(ResourceGPU) != 8 {
		t.Fatalf("status %+v, %d GPUs: want the built-in default", h.a.Status().Config, h.count(ResourceGPU))
	}
	h.config(tsGPUsOnly)
	st := h.a.Status().Config
	if st.Serving != "" || st.Error != "" || h.count(ResourceGPU) != 80 || testutil.ToFloat64(h.a.metrics.configFallback) != 0 {
		t.Errorf("after a config that fits: status %+v, %d devices; want it in force", st, h.count(ResourceGPU))
	}
	// An edit that does not fit now keeps the config that did.
	h.config(unfitDevice)
	if st := h.a.Status().Config; st.Serving != "default" || h.count(ResourceGPU) != 80 {
		t.Errorf("unfit edit: status %+v, %d devices; want the last config that fitted", st, h.count(ResourceGPU))
	}
}

// deviceIDStrategy index names devices by index in NVIDIA_VISIBLE_DEVICES
// ("0", and "<gpu>:<mig>" for MIG devices, the MIG device's NVML index),
// while the IDs the kubelet sees stay UUIDs, as in NVIDIA's plugin.
func TestDeviceIDStrategyIndex(t *testing.T) {
	for _, tt := range []struct {
		profile, cfg, resource string
		want                   []string
	}{
		{"dgx-a100", "version: v1\nflags:\n  plugin:\n    deviceIDStrategy: index\n", ResourceGPU, []string{"0", "1", "2", "3", "4", "5", "6", "7"}},
		{"dgx-h100-mig", "version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceIDStrategy: index\n", "nvidia.com/mig-1g.10gb",
			[]string{"0:0", "0:1", "0:2", "0:3", "0:4", "0:5", "0:6"}},
		{"dgx-a100", "version: v1\nconfigs:\n  default:\n    devicePlugin: {deviceIDStrategy: index}\n    sharing:\n      timeSlicing:\n        resources:\n        - {name: nvidia.com/gpu, replicas: 2, devices: [3]}\n",
			ResourceGPU, []string{"0", "1", "2", "3", "3", "4", "5", "6", "7"}},
	} {
		t.Run(tt.profile+" "+tt.resource, func(t *testing.T) {
			h := newHarness(t, simNode(t, tt.profile))
			h.config(tt.cfg)
			r := h.pub.last().Resources[tt.resource]
			if r == nil {
				t.Fatalf("no %s in %v", tt.resource, h.pub.last().Names())
			}
			var got []string
			for _, d := range r.Devices {
				if !strings.HasPrefix(d.ID, "GPU-") && !strings.HasPrefix(d.ID, "MIG-") {
					t.Errorf("device ID %q: want the UUID the kubelet sees", d.ID)
				}
				if d.Spec.RuntimeName() != d.Spec.RuntimeID || !strings.HasPrefix(d.Spec.VisibleID, d.ID[:4]) {
					t.Errorf("%s: spec %+v, want the index as runtime name and the UUID kept", d.ID, d.Spec)
				}
				got = append(got, d.Spec.RuntimeID)
			}
			slices.Sort(got)
			if len(got) > len(tt.want) {
				got = got[:len(tt.want)] // the first GPU's MIG devices
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("runtime names %v, want %v", got, tt.want)
			}
		})
	}
	// The default (and uuid) leaves the runtime name the UUID.
	h := newHarness(t, simNode(t, "dgx-a100"))
	h.config("version: v1\nflags:\n  plugin:\n    deviceIDStrategy: uuid\n")
	for _, d := range h.pub.last().Resources[ResourceGPU].Devices {
		if d.Spec.RuntimeID != "" || d.Spec.RuntimeName() != d.ID {
			t.Errorf("uuid strategy: %s has runtime name %q", d.ID, d.Spec.RuntimeName())
		}
	}
}

// gdsEnabled, mofedEnabled and gdrcopyEnabled reach every resource's
// containers, replicas and MIG devices included.
func TestGDSMOFEDGDRCopyEnv(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-h100-mig"))
	h.config("version: v1\nflags:\n  migStrategy: mixed\n  gdsEnabled: true\n  mofedEnabled: true\n  gdrcopyEnabled: true\n" +
		"sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n")
	want := map[string]string{"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled", "NVIDIA_GDRCOPY": "enabled"}
	for name, r := range h.pub.last().Resources {
		if fmt.Sprint(r.Common.Env) != fmt.Sprint(want) {
			t.Errorf("%s: common env %v, want %v", name, r.Common.Env, want)
		}
	}
	h.config(helmStrategy("mixed") + "  gdsEnabled: false\n")
	for name, r := range h.pub.last().Resources {
		if len(r.Common.Env) != 0 {
			t.Errorf("%s: env %v with every flag off", name, r.Common.Env)
		}
	}
}

// sharedDevicesAllocationPolicy decides which replica GetPreferredAllocation
// offers: distributed (NVIDIA's default) the least used GPU's, packed the
// most used one's.
func TestSharedDevicesAllocationPolicy(t *testing.T) {
	const ts = "sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
	for _, tt := range []struct {
		name, flags string
		sameGPU     bool
	}{
		{"absent: NVIDIA's default, distributed", "", false},
		{"distributed", "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: distributed\n", false},
		{"packed", "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, simNode(t, "dgx-a100"))
			h.config("version: v1\n" + tt.flags + ts)
			r := h.pub.last().Resources[ResourceGPU]
			if r == nil || r.Preferred == nil {
				t.Fatal("no preferrer on the shared resource")
			}
			// One replica of the first GPU is taken: the kubelet offers the rest.
			taken := r.Devices[0].ID
			busy, _, _ := timeslice.Parent(taken)
			var avail []string
			for _, d := range r.Devices {
				if d.ID != taken {
					avail = append(avail, d.ID)
				}
			}
			got, err := r.Preferred.Preferred(avail, nil, 1)
			if err != nil {
				t.Fatal(err)
			}
			parent, _, _ := timeslice.Parent(got[0])
			if (parent == busy) != tt.sameGPU {
				t.Errorf("preferred %v with %s half used; want the same GPU: %v", got, busy, tt.sameGPU)
			}
		})
	}
}
