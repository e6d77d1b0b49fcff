package agent

import (
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// defaultMigParted is our rendition of the GPU Operator's default mig-parted
// config: every layout of it, entry for entry.
const defaultMigParted = "testdata/gpu-operator-default-mig-parted.yaml"

// migPartedModels are the simulated MIG models: a node of each, the PCI
// device id the Operator's device-filters name it by, and its profiles as
// the MIG User Guide names them.
var migPartedModels = []struct {
	node     string
	pci      uint32
	profiles []string
}{
	{"dgx-a100", 0x20B010DE, []string{"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}},
	{"dgx-a100-80gb", 0x20B210DE, []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}},
	{"pcie-a30x4", 0x20B710DE, []string{"1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"}},
	{"dgx-h100", 0x233010DE, []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}},
	{"pcie-h100nvl-x2", 0x232110DE, []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"}},
	{"gh200", 0x234210DE, []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"}},
	{"gh200-144g", 0x234810DE, []string{"1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"}},
	{"dgx-h200", 0x233510DE, []string{"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}},
	{"dgx-b200", 0x290110DE, []string{"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"}},
}

// partedEntry is one entry of a mig-parted layout as the test reads it on
// its own, apart from the config package, to know what each layout asks.
type partedEntry struct {
	Filter  yaml.Node      `yaml:"device-filter"`
	Enabled bool           `yaml:"mig-enabled"`
	Devices map[string]int `yaml:"mig-devices"`
}

// names says whether the entry applies to GPUs with PCI device id pci: no
// filter, or a filter (one id or a list) that has it.
func (e partedEntry) names(t *testing.T, pci uint32) bool {
	t.Helper()
	var ids []string
	switch e.Filter.Kind {
	case 0:
		return true
	case yaml.ScalarNode:
		ids = []string{e.Filter.Value}
	default:
		if err := e.Filter.Decode(&ids); err != nil {
			t.Fatalf("device-filter: %v", err)
		}
	}
	for _, id := range ids {
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(id), "0x"), 16, 32)
		if err != nil {
			t.Fatalf("device-filter %q: %v", id, err)
		}
		if uint32(v) == pci {
			return true
		}
	}
	return false
}

// The layouts of the default config that no simulated model takes, and why:
// they are for GPUs the simulator does not have.
var notSimulated = map[string]string{
	"all-1g.24gb.gfx": "RTX PRO 6000", "all-1g.24gb.me.all": "RTX PRO 6000", "all-1g.24gb-me": "RTX PRO 6000",
	"all-1g.24gb.me": "RTX PRO 6000", "all-2g.48gb": "RTX PRO 6000", "all-2g.48gb.gfx": "RTX PRO 6000",
	"all-2g.48gb.me.all": "RTX PRO 6000", "all-2g.48gb-me": "RTX PRO 6000", "all-4g.96gb": "RTX PRO 6000",
	"all-4g.96gb.gfx": "RTX PRO 6000",
	"all-1g.47gb":     "GB200", "all-2g.47gb": "GB200", "all-3g.93gb": "GB200", "all-4g.93gb": "GB200", "all-7g.186gb": "GB200",
	"all-3g.95gb": "a 189 GB Blackwell", "all-4g.95gb": "a 189 GB Blackwell", "all-7g.189gb": "a 189 GB Blackwell",
	"all-1g.34gb": "B300", "all-1g.34gb.me": "B300", "all-1g.67gb": "B300", "all-2g.67gb": "B300",
	"all-3g.135gb": "B300", "all-4g.135gb": "B300", "all-7g.269gb": "B300",
	"all-1g.35gb.me": "GB300", "all-1g.70gb": "GB300", "all-2g.70gb": "GB300", "all-3g.139gb": "GB300",
	"all-4g.139gb": "GB300", "all-7g.278gb": "GB300",
}

// Every layout of the GPU Operator's default mig-parted config that names a
// simulated model, by a device-filter with its PCI id or, without one, by
// profiles only that model has, is selected, planned and applied on a node
// of that model through the whole loop: the file as the ConfigMap's key,
// the layout picked by nvidia.com/mig.config, every GPU repartitioned to
// exactly the MIG devices the layout's first matching entry asks for.
func TestGPUOperatorDefaultLayoutsApply(t *testing.T) {
	data, err := os.ReadFile(defaultMigParted)
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Version string                   `yaml:"version"`
		Configs map[string][]partedEntry `yaml:"mig-configs"`
	}
	if err := yaml.Unmarshal(data, &file); err != nil || file.Version != "v1" || len(file.Configs) == 0 {
		t.Fatalf("%s: version %q, %d layouts, %v", defaultMigParted, file.Version, len(file.Configs), err)
	}
	applied := map[string][]string{} // layout -> nodes
	for _, m := range migPartedModels {
		for _, name := range slices.Sorted(maps.Keys(file.Configs)) {
			// The first entry naming the model's GPUs decides, as in mig-parted.
			i := slices.IndexFunc(file.Configs[name], func(e partedEntry) bool { return e.names(t, m.pci) })
			if i < 0 {
				continue
			}
			e := file.Configs[name][i]
			fits := true
			for p := range e.Devices {
				fits = fits && slices.Contains(m.profiles, p)
			}
			if !fits {
				if e.Filter.Kind != 0 {
					t.Errorf("%s names %s (%#x) by its filter but asks for %v", name, m.node, m.pci, e.Devices)
				}
				continue // an unfiltered layout for another model
			}
			applied[name] = append(applied[name], m.node)
			want := map[string]int{}
			for p, n := range e.Devices {
				if n > 0 {
					want[p] = n
				}
			}
			t.Run(m.node+"/"+name, func(t *testing.T) {
				c := &cluster{}
				h := newHarness(t, simNode(t, m.node, sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange()), withMIG(), withCluster(c), withQuietLog())
				h.config(string(data))
				if st := h.a.Status().Config; st.Error != "" {
					t.Fatalf("the file: %s", st.Error)
				}
				h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": name}})
				if st := h.a.Status().Config; st.Error != "" {
					t.Fatalf("layout %s: %s", name, st.Error)
				}
				if got := c.labels[LabelMIGConfigState]; got != MIGConfigSuccess {
					t.Errorf("mig.config.state=%q, want success (MIG: %+v)", got, h.a.Status().MIG)
				}
				inv, err := h.opts.Observer.Inventory()
				if err != nil {
					t.Fatal(err)
				}
				for _, g := range inv.GPUs {
					got := map[string]int{}
					for _, in := range g.Instances {
						got[in.Profile]++
					}
					if g.MIG.Current != e.Enabled || !maps.Equal(got, want) {
						t.Errorf("GPU %d: MIG %v, devices %v; want MIG %v, %v", g.Index, g.MIG.Current, got, e.Enabled, want)
					}
				}
			})
		}
	}

	// Each model takes all-disabled, all-enabled, all-balanced and one
	// all-<profile> per profile it has (the 40 GB A100's 1g.10gb by its
	// filter in all-1g.10gb): a smaller count means a layout stopped
	// naming its model.
	pairs := 0
	for _, nodes := range applied {
		pairs += len(nodes)
	}
	want := 3 * len(migPartedModels)
	for _, m := range migPartedModels {
		want += len(m.profiles)
	}
	if pairs != want {
		t.Errorf("%d layout and model pairs applied, want %d: %v", pairs, want, applied)
	}
	for _, name := range slices.Sorted(maps.Keys(file.Configs)) {
		why, skip := notSimulated[name]
		switch {
		case skip && len(applied[name]) > 0:
			t.Errorf("%s, for %s, applied to %v", name, why, applied[name])
		case !skip && len(applied[name]) == 0:
			t.Errorf("%s applies to no simulated model", name)
		}
	}
	for name := range notSimulated {
		if _, ok := file.Configs[name]; !ok {
			t.Errorf("notSimulated names %s, which the file lacks", name)
		}
	}
}
