package agent

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// PCI device ids of the simulated MIG models, as the GPU Operator's default
// mig-parted config filters them.
const (
	pciA100     = "0x20B010DE"
	pciA100_80  = "0x20B210DE"
	pciH100     = "0x233010DE"
	pciH100NVL  = "0x232110DE"
	pciH200     = "0x233510DE"
	pciGH200    = "0x234210DE"
	pciB200     = "0x290110DE"
	pciA30      = "0x20B710DE"
	noFilter    = ""
	migDisabled = "disabled"
)

// operatorLayout is one named layout of the GPU Operator's default
// mig-parted config (default-mig-parted-config), restricted to the models the
// simulated node has: per device-filter (noFilter: every GPU), the MIG
// devices of each GPU (nil with migDisabled: MIG off).
type operatorLayout struct {
	name    string
	entries map[string]map[string]int
}

// operatorLayouts are written from the GPU Operator's documented default
// layouts: all-disabled, all-enabled, one all-<profile> per profile of each
// model (the count that fills a GPU), and all-balanced with a mix per model.
func operatorLayouts() []operatorLayout {
	one := func(profile string, n int) map[string]map[string]int {
		return map[string]map[string]int{noFilter: {profile: n}}
	}
	out := []operatorLayout{
		{"all-disabled", map[string]map[string]int{migDisabled: nil}},
		{"all-enabled", map[string]map[string]int{noFilter: {}}},
		// all-1g.10gb fills an 80 GB A100 or H100 with 7, and takes 4 of the
		// 40 GB A100's 1g.10gb (its 2-memory-slice profile).
		{"all-1g.10gb", map[string]map[string]int{
			pciH100: {"1g.10gb": 7}, pciA100_80: {"1g.10gb": 7}, pciA100: {"1g.10gb": 4},
		}},
		{"all-balanced", map[string]map[string]int{
			pciB200:    {"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1},
			pciH200:    {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
			pciH100NVL: {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1},
			pciH100:    {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
			pciA100_80: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
			pciA100:    {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
			pciA30:     {"1g.6gb": 2, "2g.12gb": 1},
			pciGH200:   {"1g.12gb": 2, "2g.24gb": 1, "3g.48gb": 1},
		}},
	}
	for _, p := range []struct {
		profile string
		n       int
	}{
		{"1g.5gb", 7}, {"1g.5gb+me", 1}, {"2g.10gb", 3}, {"3g.20gb", 2}, {"4g.20gb", 1}, {"7g.40gb", 1},
		{"1g.10gb+me", 1}, {"1g.20gb", 4}, {"2g.20gb", 3}, {"3g.40gb", 2}, {"4g.40gb", 1}, {"7g.80gb", 1},
		{"1g.6gb", 4}, {"1g.6gb+me", 1}, {"2g.12gb", 2}, {"2g.12gb+me", 1}, {"4g.24gb", 1},
		{"1g.12gb", 7}, {"1g.12gb+me", 1}, {"1g.24gb", 4}, {"2g.24gb", 3}, {"3g.47gb", 2}, {"4g.47gb", 1}, {"7g.94gb", 1},
		{"3g.48gb", 2}, {"4g.48gb", 1}, {"7g.96gb", 1},
		{"1g.18gb", 7}, {"1g.18gb+me", 1}, {"1g.35gb", 4}, {"2g.35gb", 3}, {"3g.71gb", 2}, {"4g.71gb", 1}, {"7g.141gb", 1},
		{"1g.23gb", 7}, {"1g.23gb+me", 1}, {"1g.45gb", 4}, {"2g.45gb", 3}, {"3g.90gb", 2}, {"4g.90gb", 1}, {"7g.180gb", 1},
	} {
		// mig-parted's entry names write "+me" as ".me".
		out = append(out, operatorLayout{"all-" + strings.ReplaceAll(p.profile, "+me", ".me"), one(p.profile, p.n)})
	}
	return out
}

// migPartedYAML renders the layouts as a mig-parted file.
func migPartedYAML(ls []operatorLayout) string {
	var b strings.Builder
	b.WriteString("version: v1\nmig-configs:\n")
	for _, l := range ls {
		fmt.Fprintf(&b, "  %s:\n", l.name)
		for _, filter := range slices.Sorted(maps.Keys(l.entries)) {
			devs := l.entries[filter]
			b.WriteString("  - devices: all\n")
			if filter != noFilter && filter != migDisabled {
				fmt.Fprintf(&b, "    device-filter: [%q]\n", filter)
			}
			if filter == migDisabled {
				b.WriteString("    mig-enabled: false\n")
				continue
			}
			b.WriteString("    mig-enabled: true\n    mig-devices: {")
			for i, p := range slices.Sorted(maps.Keys(devs)) {
				if i > 0 {
					b.WriteString(", ")
				}
				fmt.Fprintf(&b, "%q: %d", p, devs[p])
			}
			b.WriteString("}\n")
		}
	}
	return b.String()
}

// Every layout of the GPU Operator's default mig-parted config that names a
// simulated model (by its device-filter, or, without one, by profiles only
// that model has) plans and applies on it, through the whole loop: the file
// as the ConfigMap's key, the layout picked by nvidia.com/mig.config, every
// GPU repartitioned to exactly the layout's MIG devices.
func TestGPUOperatorDefaultLayoutsApply(t *testing.T) {
	models := []struct {
		node, pci string
		profiles  []string
	}{
		{"dgx-a100", pciA100, []string{"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}},
		{"dgx-a100-80gb", pciA100_80, []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}},
		{"dgx-h100", pciH100, []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}},
		{"pcie-h100nvl-x2", pciH100NVL, []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"}},
		{"gh200", pciGH200, []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"}},
		{"dgx-h200", pciH200, []string{"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}},
		{"dgx-b200", pciB200, []string{"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"}},
		{"pcie-a30x4", pciA30, []string{"1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"}},
	}
	layouts := operatorLayouts()
	file := migPartedYAML(layouts)
	applied := 0
	for _, m := range models {
		for _, l := range layouts {
			want, ok := l.entries[m.pci]
			if !ok {
				want, ok = l.entries[noFilter]
				// Without a filter a layout names the models that have all its profiles.
				for p := range want {
					ok = ok && slices.Contains(m.profiles, p)
				}
			}
			_, off := l.entries[migDisabled]
			if !ok && !off {
				continue
			}
			applied++
			t.Run(m.node+"/"+l.name, func(t *testing.T) {
				c := &cluster{}
				h := newHarness(t, simNode(t, m.node, sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange()), withMIG(), withCluster(c), withQuietLog())
				h.config(file)
				if st := h.a.Status().Config; st.Error != "" {
					t.Fatalf("the file: %s", st.Error)
				}
				h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": l.name}})
				if st := h.a.Status().Config; st.Error != "" {
					t.Fatalf("layout %s: %s", l.name, st.Error)
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
					if g.MIG.Current == off || !maps.Equal(got, want) && !(off && len(got) == 0) {
						t.Errorf("GPU %d: MIG %v, devices %v; want MIG %v, %v", g.Index, g.MIG.Current, got, !off, want)
					}
				}
			})
		}
	}
	// Each model gets all-disabled, all-enabled, all-balanced and one layout per
	// profile; a smaller count means a layout stopped naming its model.
	if applied < 8*3+7*7+5 {
		t.Errorf("%d layout and model pairs applied, want every model's", applied)
	}
}
