package agent

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/podresources"
)

const (
	decideWhole = `version: v1
configs:
  default: {}
`
	decideMPS = `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
`
	decideCDI = `version: v1
configs:
  default:
    devicePlugin:
      deviceListStrategy: cdi-cri
`
	// decideUnfit shares a GPU the node does not have.
	decideUnfit = `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - {name: nvidia.com/gpu, replicas: 2, devices: [9]}
`
	decide3g = `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: {"3g.40gb": 2}
`
)

// selectYAML is the selection a config file makes for node-a.
func selectYAML(t *testing.T, yaml string) config.Selected {
	t.Helper()
	f, _, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("config: %v", err)
	}
	sel, err := f.Select("node-a", nil)
	if err != nil {
		t.Fatalf("select: %v", err)
	}
	return sel
}

// nodeSnapshot is what the planner reads of a simulated node as it is
// (its GPUs and MIG profiles), with the kubelet's answer fresh and empty.
// Reading the sim is the test's input; decide itself reads nothing.
func nodeSnapshot(t *testing.T, profile string, opts ...sim.Option) Snapshot {
	t.Helper()
	obs := mig.NewObserver(simNode(t, profile, opts...), gpu.Options{})
	inv, err := obs.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	s := Snapshot{Inventory: inv, Profiles: map[string]mig.Profiles{}, ProfileErrs: map[string]error{},
		Holdings: Holdings{Attribution: &podresources.Attribution{}, Fresh: true}}
	for _, g := range inv.GPUs {
		if _, done := s.Profiles[g.Name]; done || !g.MIGCapable {
			continue
		}
		if s.Profiles[g.Name], err = obs.MIGProfiles(g); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// TestDecide asserts what a pass decides, with no actuator run: which
// effects it asks for, and which it leaves out because they are in force.
func TestDecide(t *testing.T) {
	whole := selectYAML(t, decideWhole)
	tests := []struct {
		name  string
		node  string
		sim   []sim.Option
		input func(in *decideInput)
		check func(t *testing.T, e Effects)
	}{
		{
			name:  "first pass: the policy to the health watcher, the config to its observers, nothing else",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected, in.Health = whole, true },
			check: func(t *testing.T, e Effects) {
				if e.Catalog == nil || len(e.Catalog.Resources[ResourceGPU].Devices) != 8 {
					t.Fatalf("catalog %v, want 8 whole GPUs", e.Catalog)
				}
				if e.HealthPolicy == nil || e.NewConfig != whole.Config || e.Serving.Config != whole.Config {
					t.Errorf("policy %v, new config %p, serving %p; want the policy and config %p", e.HealthPolicy, e.NewConfig, e.Serving.Config, whole.Config)
				}
				if e.SetMPS || e.CDIPlugin || e.DRA != nil || e.MIG != nil || e.AskHoldings || e.FitErr != nil {
					t.Errorf("effects %+v, want no MPS, CDI, DRA, MIG or question to the kubelet", e)
				}
			},
		},
		{
			name: "config already in force: the policy and observers are left alone",
			node: "dgx-a100",
			input: func(in *decideInput) {
				in.Selected, in.Health, in.PolicyOf, in.Observed = whole, true, whole.Config, whole.Config
			},
			check: func(t *testing.T, e Effects) {
				if e.HealthPolicy != nil || e.NewConfig != nil || e.Catalog == nil {
					t.Errorf("policy %v, new config %p, catalog %v; want only the catalog", e.HealthPolicy, e.NewConfig, e.Catalog)
				}
			},
		},
		{
			name:  "no health watcher: no policy to set",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected = whole },
			check: func(t *testing.T, e Effects) {
				if e.HealthPolicy != nil {
					t.Errorf("policy %v without a health watcher", e.HealthPolicy)
				}
			},
		},
		{
			name: "MPS supervised: its daemons are set, one per shared GPU",
			node: "dgx-a100",
			input: func(in *decideInput) {
				in.Selected, in.MPSSupervised, in.MPS = selectYAML(t, decideMPS), true, MPSInput{Root: "/run/mps", ShmDir: "/dev/shm"}
			},
			check: func(t *testing.T, e Effects) {
				if !e.SetMPS || len(e.MPSDaemons) != 8 {
					t.Errorf("set %v, %d daemons; want 8 set", e.SetMPS, len(e.MPSDaemons))
				}
			},
		},
		{
			name:  "no MPS supervisor: none is set",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected = whole },
			check: func(t *testing.T, e Effects) {
				if e.SetMPS {
					t.Error("MPS daemons set without a supervisor")
				}
			},
		},
		{
			name:  "a CDI device list strategy: the device plugin hands out CDI names",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected = selectYAML(t, decideCDI) },
			check: func(t *testing.T, e Effects) {
				if !e.CDIPlugin {
					t.Error("CDIPlugin false under deviceListStrategy cdi-cri")
				}
			},
		},
		{
			name:  "DRA on: its pool is published",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected, in.DRA = whole, true },
			check: func(t *testing.T, e Effects) {
				if e.DRA == nil || len(e.DRA.Devices) < 8 {
					t.Errorf("DRA pool %v, want the 8 GPUs", e.DRA)
				}
			},
		},
		{
			name:  "allocations the kubelet had time to list: ask it",
			node:  "dgx-a100",
			input: func(in *decideInput) { in.Selected, in.Settleable = whole, true },
			check: func(t *testing.T, e Effects) {
				if !e.AskHoldings {
					t.Error("AskHoldings false with settleable allocations")
				}
			},
		},
		{
			name: "nothing fits and nothing did: no catalog, nothing set, the error kept",
			node: "dgx-a100",
			input: func(in *decideInput) {
				in.Selected, in.Health, in.MPSSupervised, in.DRA = selectYAML(t, decideUnfit), true, true, true
			},
			check: func(t *testing.T, e Effects) {
				if e.Catalog != nil || e.FitErr == nil {
					t.Fatalf("catalog %v, fit error %v; want none and an error", e.Catalog, e.FitErr)
				}
				if e.HealthPolicy != nil || e.NewConfig != nil || e.SetMPS || e.DRA != nil {
					t.Errorf("effects %+v, want nothing set while nothing fits", e)
				}
			},
		},
		{
			name: "the selected config does not fit: the last good one is served, its policy set",
			node: "dgx-a100",
			input: func(in *decideInput) {
				in.Selected, in.LastGood, in.Health = selectYAML(t, decideUnfit), whole, true
			},
			check: func(t *testing.T, e Effects) {
				if e.Catalog == nil || e.FitErr == nil || e.Serving.Config != whole.Config {
					t.Fatalf("catalog %v, fit error %v, serving %q; want the last good config served, the error kept", e.Catalog, e.FitErr, e.Serving.Name)
				}
				if e.HealthPolicy == nil || e.NewConfig != whole.Config {
					t.Errorf("policy %v, new config %p; want the last good config's", e.HealthPolicy, e.NewConfig)
				}
			},
		},
		{
			name: "a layout on GPUs with MIG off: every GPU's plan turns MIG on first",
			node: "dgx-h100",
			sim:  []sim.Option{sim.WithImmediateMIGModeChange()},
			input: func(in *decideInput) {
				in.Selected, in.MIGApplies = selectYAML(t, decide3g), true
			},
			check: func(t *testing.T, e Effects) {
				if len(e.MIG) != 8 || len(e.Laid) != 8 || e.MIGLayout.MIGLayout == nil {
					t.Fatalf("%d plans, %d GPUs laid, layout %v; want 8 of the selected layout", len(e.MIG), len(e.Laid), e.MIGLayout.MIGLayout)
				}
				for _, gm := range e.MIG {
					if !gm.Apply() || len(gm.Plan.Steps) == 0 || gm.Plan.Steps[0].Op != mig.OpSetMode {
						t.Errorf("GPU %d: %+v, want a plan that sets MIG mode first", gm.GPU, gm)
					}
				}
			},
		},
		{
			name: "a layout that destroys without an answer asked for: ask the kubelet, destroy nothing",
			node: "dgx-h100-mig",
			input: func(in *decideInput) {
				in.Selected, in.MIGApplies, in.Holdings.Fresh = selectYAML(t, decide3g), true, false
			},
			check: func(t *testing.T, e Effects) {
				if !e.AskHoldings || len(e.MIG) != 8 {
					t.Fatalf("ask %v, %d plans; want the kubelet asked, 8 plans", e.AskHoldings, len(e.MIG))
				}
				for _, gm := range e.MIG {
					if gm.Waiting == "" || slices.ContainsFunc(gm.Plan.Steps, func(s mig.Step) bool { return s.Op == mig.OpDestroy }) {
						t.Errorf("GPU %d: %+v, want waiting, no destroy", gm.GPU, gm)
					}
				}
			},
		},
		{
			name: "the same layout with a fresh answer: the plans destroy",
			node: "dgx-h100-mig",
			input: func(in *decideInput) {
				in.Selected, in.MIGApplies = selectYAML(t, decide3g), true
			},
			check: func(t *testing.T, e Effects) {
				if e.AskHoldings || len(e.MIG) != 8 {
					t.Fatalf("ask %v, %d plans; want no question, 8 plans", e.AskHoldings, len(e.MIG))
				}
				for _, gm := range e.MIG {
					if !slices.ContainsFunc(gm.Plan.Steps, func(s mig.Step) bool { return s.Op == mig.OpDestroy }) {
						t.Errorf("GPU %d: steps %v, want destroys", gm.GPU, gm.Plan.Steps)
					}
				}
			},
		},
		{
			name: "MIG not managed: no plan",
			node: "dgx-h100-mig",
			input: func(in *decideInput) {
				in.Selected = selectYAML(t, decide3g)
			},
			check: func(t *testing.T, e Effects) {
				if e.MIG != nil || len(e.Laid) != 0 {
					t.Errorf("plans %v, laid %v, want none without a MIG applier", e.MIG, e.Laid)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := decideInput{Snapshot: nodeSnapshot(t, tt.node, tt.sim...)}
			tt.input(&in)
			tt.check(t, decide(in))
		})
	}
}

// TestDecideIsPure: the same input gives the same effects, and deciding
// changes nothing it was given.
func TestDecideIsPure(t *testing.T) {
	in := decideInput{Snapshot: nodeSnapshot(t, "dgx-h100-mig"), Health: true}
	in.Selected, in.MIGApplies, in.DRA = selectYAML(t, decide3g), true, true
	a, b := decide(in), decide(in)
	if len(a.MIG) != len(b.MIG) || !sameCatalog(a.Catalog, b.Catalog) || a.AskHoldings != b.AskHoldings {
		t.Errorf("two decisions differ: %d/%d plans, ask %v/%v", len(a.MIG), len(b.MIG), a.AskHoldings, b.AskHoldings)
	}
	for i := range a.MIG {
		if !reflect.DeepEqual(a.MIG[i].Plan.Steps, b.MIG[i].Plan.Steps) {
			t.Errorf("GPU %d: steps %v then %v", a.MIG[i].GPU, a.MIG[i].Plan.Steps, b.MIG[i].Plan.Steps)
		}
	}
	if n := len(in.Inventory.GPUs[0].Instances); n != 7 {
		t.Errorf("GPU 0 has %d MIG devices after deciding, want the 7 it had", n)
	}
	if !strings.Contains(a.MIG[0].Want, "3g.40gb") {
		t.Errorf("GPU 0 wants %q, want the 3g.40gb layout", a.MIG[0].Want)
	}
}
