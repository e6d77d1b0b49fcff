package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/config"
)

// validateConfig runs `gpu-agent config validate` on data, as a user would
// before applying a ConfigMap, and returns its output.
func validateConfig(t *testing.T, name string, data []byte, backend, node string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"config", "validate", file, "--backend", backend}
	if node != "" {
		args = append(args, "--node-name", node)
	}
	out, err := exec.Command(agentBin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: gpu-agent %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	if strings.Contains(string(out), "warning:") {
		t.Errorf("%s: validation warns:\n%s", name, out)
	}
	return string(out)
}

// loadExample decodes an example ConfigMap strictly and returns its config.
func loadExample(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	o := &objects{}
	if err := decodeStrict(path, data, o); err != nil {
		t.Fatal(err)
	}
	if len(o.ConfigMaps) != 1 || len(o.ConfigMaps[0].Data) != 1 || o.ConfigMaps[0].Data["config.yaml"] == "" {
		t.Fatalf("%s: want one ConfigMap with exactly the key config.yaml", path)
	}
	if cm := o.ConfigMaps[0]; cm.Name != "gpu-agent-config" || cm.Namespace != "gpu-agent" {
		t.Errorf("%s: ConfigMap %s/%s, want gpu-agent/gpu-agent-config (what the base DaemonSet mounts)", path, cm.Namespace, cm.Name)
	}
	return []byte(o.ConfigMaps[0].Data["config.yaml"])
}

// migModels are the MIG geometry facts the examples must respect (nvidia-smi
// mig -lgip): memory per slice in GB, and the PCI device id the examples'
// device-filter names. `config validate` checks profile names only for form, so
// this test checks that each layout fits the GPU.
var migModels = map[string]struct {
	deviceFilter string
	sliceGB      int
}{
	"sim:dgx-a100": {"0x20B010DE", 5},  // A100-SXM4-40GB: 8 memory slices of 5 GB
	"sim:dgx-h100": {"0x233010DE", 10}, // H100 80GB HBM3: 8 memory slices of 10 GB
}

var reProfile = regexp.MustCompile(`^([1-7])g\.([0-9]+)gb$`)

func TestExamples(t *testing.T) {
	tests := []struct {
		file, backend, node string
		// wantUses is the config the node should pick; wantOffer a line the
		// plan must print (a resource and its device count).
		wantUses  string
		wantOffer string
	}{
		{"whole-gpus.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/gpu  8"},
		{"time-slicing-x4.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/gpu  32"},
		{"node-override.yaml", "sim:dgx-a100", "gpu-node-17", `uses config "notebooks"`, "nvidia.com/gpu.shared  32"},
		{"node-override.yaml", "sim:dgx-a100", "gpu-node-3", `uses config "default"`, "nvidia.com/gpu  8"},
		// A layout is tried on a copy of the node: what it offers once
		// the GPUs are repartitioned.
		{"mig-a100-balanced.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/mig-1g.5gb  16"},
		{"mig-a100-all-1g.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/mig-1g.5gb  56"},
		{"mig-a100-half-3g.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/mig-3g.20gb  8"},
		{"mig-h100-balanced.yaml", "sim:dgx-h100", "", `uses config "default"`, "nvidia.com/mig-2g.20gb  8"},
		{"mig-h100-balanced-lean.yaml", "sim:dgx-h100", "", `uses config "default"`, "nvidia.com/mig-2g.20gb  8"},
		{"mig-h100-all-1g.yaml", "sim:dgx-h100", "", `uses config "default"`, "nvidia.com/mig-1g.10gb  56"},
		{"mig-h100-half-3g.yaml", "sim:dgx-h100", "", `uses config "default"`, "nvidia.com/mig-3g.40gb  8"},
		{"mig-h100-all-1g.yaml", "sim:dgx-h100-mig", "", `uses config "default"`, "nvidia.com/mig-1g.10gb  56"},
		{"mps-x2.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/gpu.mps  16"},
		{"cdi.yaml", "sim:dgx-a100", "", `uses config "default"`, "nvidia.com/gpu  8"},
		{"dra-mig-on-demand-every-placement.yaml", "sim:dgx-h100", "", `uses config "default"`, "nvidia.com/gpu  8"},
		// One spare offering the balanced layout beside 7 whole GPUs, and no counters.
		{"dra-mig-on-demand.yaml", "sim:dgx-h100", "", `uses config "default"`, "11 devices (4 of them MIG devices made on demand) and no counters,"},
	}
	seen := map[string]bool{}
	for _, tt := range tests {
		seen[tt.file] = true
		t.Run(tt.file+"/"+tt.backend+"/"+tt.node, func(t *testing.T) {
			data := loadExample(t, repoPath("deploy", "examples", tt.file))
			out := validateConfig(t, tt.file, data, tt.backend, tt.node)
			if !strings.Contains(out, tt.wantUses) {
				t.Errorf("output does not say %q:\n%s", tt.wantUses, out)
			}
			if tt.wantOffer != "" && !regexp.MustCompile(strings.ReplaceAll(regexp.QuoteMeta(tt.wantOffer), " ", `\s+`)+`\s`).MatchString(out) {
				t.Errorf("output does not offer %q:\n%s", tt.wantOffer, out)
			}
			if strings.HasPrefix(tt.file, "mig-") {
				checkMIGFits(t, data, tt.backend)
			}
		})
	}
	files, err := filepath.Glob(repoPath("deploy", "examples", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !seen[filepath.Base(f)] {
			t.Errorf("example %s is not validated by this test", filepath.Base(f))
		}
	}
}

// checkMIGFits asserts that each layout entry names the model's device filter
// (one disabling MIG too: without it, it would disable MIG on another model's
// GPUs) and that its instances fit in the GPU's 7 compute and 8 memory slices.
func checkMIGFits(t *testing.T, data []byte, backend string) {
	t.Helper()
	m, ok := migModels[strings.TrimSuffix(backend, "-mig")]
	if !ok {
		t.Fatalf("no MIG facts for %s", backend)
	}
	f, _, err := config.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range f.Configs {
		for i, e := range c.MIG.Devices {
			if len(e.DeviceFilter) != 1 || e.DeviceFilter[0] != m.deviceFilter {
				t.Errorf("%s.mig.devices[%d]: device-filter %v, want [%s] so other models skip it", name, i, e.DeviceFilter, m.deviceFilter)
			}
			if !e.MigEnabled {
				continue
			}
			compute, memory := 0, 0
			for prof, n := range e.MigDevices {
				sm := reProfile.FindStringSubmatch(prof)
				if sm == nil {
					t.Errorf("%s.mig.devices[%d]: profile %q is not <n>g.<m>gb", name, i, prof)
					continue
				}
				g, _ := strconv.Atoi(sm[1])
				gb, _ := strconv.Atoi(sm[2])
				if gb%m.sliceGB != 0 {
					t.Errorf("%s.mig.devices[%d]: %s is not a profile of this model (%d GB slices)", name, i, prof, m.sliceGB)
				}
				compute += g * n
				memory += gb / m.sliceGB * n
			}
			if compute > 7 || memory > 8 {
				t.Errorf("%s.mig.devices[%d]: %v needs %d compute and %d memory slices, the GPU has 7 and 8", name, i, e.MigDevices, compute, memory)
			}
		}
	}
}

// The MPS example's limits reach the plan as the config says.
func TestMPSExample(t *testing.T) {
	data := loadExample(t, repoPath("deploy", "examples", "mps-x2.yaml"))
	f, warnings, err := config.Parse(data)
	if err != nil {
		t.Fatalf("config.Parse: %v", err)
	}
	if len(warnings) > 0 {
		t.Errorf("config.Parse warns: %v", warnings)
	}
	r := f.Configs["default"].Sharing.MPS.Resources
	if len(r) != 1 || r[0].Replicas != 2 || r[0].ActiveThreadPercentage == nil || *r[0].ActiveThreadPercentage != 50 ||
		r[0].PinnedDeviceMemoryLimit == nil || r[0].PinnedDeviceMemoryLimit.String() != "20Gi" {
		t.Errorf("MPS resources = %+v, want 2 replicas at 50%% and 20Gi", r)
	}
}
