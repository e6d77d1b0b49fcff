package mig

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// bareGIs lists GPU i's GPU instances without a compute instance, asking
// NVML directly rather than the inventory, whose view of them is under test.
func (r *rig) bareGIs(i int) []string {
	r.t.Helper()
	dev, ret := r.node.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		r.t.Fatal(ret)
	}
	var out []string
	for idx := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, ret := dev.GetGpuInstanceProfileInfo(idx)
		if ret != nvml.SUCCESS {
			continue
		}
		gis, ret := dev.GetGpuInstances(&info)
		if ret == nvml.ERROR_NOT_SUPPORTED {
			return nil // MIG is off: no GPU instances at all
		}
		if ret != nvml.SUCCESS {
			r.t.Fatalf("GetGpuInstances(profile %d): %v", idx, ret)
		}
		for _, gi := range gis {
			cis, err := computeInstances(gi)
			if err != nil {
				r.t.Fatal(err)
			}
			if len(cis) == 0 {
				gii, _ := gi.GetInfo()
				out = append(out, fmt.Sprintf("profile %d gi %d at %d+%d", idx, gii.Id, gii.Placement.Start, gii.Placement.Size))
			}
		}
	}
	return out
}

// TestCrashThenLayoutEditConverges kills the applier at every crash point of
// a repartition A→B, then edits the layout to C before the restart: the new
// plan is made from a fresh inventory and the journal of B is abandoned.
// Killed inside a destroy, between the compute instance and its GPU
// instance, the applier leaves a GPU instance that no MIG device shows; the
// GPU must still reach C, whole instances only.
func TestCrashThenLayoutEditConverges(t *testing.T) {
	for _, tc := range []struct {
		node    string
		a, b, c string
	}{
		{"dgx-a100", "7x1g.5gb", "1x3g.20gb 1x2g.10gb 2x1g.5gb", "1x4g.20gb 3x1g.5gb"},
		{"dgx-a100", "2x3g.20gb", "1x7g.40gb", "7x1g.5gb"},
		{"dgx-a100", "1x4g.20gb 1x3g.20gb", "3x2g.10gb 1x1g.5gb", "2x3g.20gb"},
		{"dgx-h100-mig", "7x1g.10gb", "2x3g.40gb", "1x4g.40gb 1x2g.20gb 1x1g.10gb"},
		{"dgx-h100", "1x4g.40gb 1x2g.20gb 1x1g.10gb", "7x1g.10gb", "1x7g.80gb"},
	} {
		from, to, edited := want(tc.a), want(tc.b), want(tc.c)
		t.Run(fmt.Sprintf("%s %s to %s then %s", tc.node, from, to, edited), func(t *testing.T) {
			// Every rig has its own node and state dir.
			t.Parallel()
			ref := newRig(t, tc.node, sim.WithMIGEnabled())
			ref.converge(0, from, nil)
			p, _, err := MakePlan(ref.gpu(0), ref.profiles(0), to, nil)
			if err != nil {
				t.Fatal(err)
			}
			leftBare := 0
			for k, s := range p.Steps {
				for _, point := range []string{"before", "mid", "after"} {
					if point == "mid" && s.Op == OpSetMode {
						continue
					}
					if crashThenEdit(t, tc.node, from, to, edited, point, k, s) {
						leftBare++
					}
				}
			}
			// Without a kill point that leaves one, this test would not
			// test what it is for.
			if leftBare == 0 {
				t.Errorf("no kill point of %v left a GPU instance without a compute instance", p.Steps)
			}
			t.Logf("%d of the kill points left a GPU instance without a compute instance", leftBare)
		})
	}
}

// crashThenEdit runs one kill point and reports whether the kill left a GPU
// instance without a compute instance.
func crashThenEdit(t *testing.T, node string, from, to, edited Want, point string, k int, s Step) (leftBare bool) {
	t.Helper()
	t.Run(fmt.Sprintf("%s step %d %s", point, k, s), func(t *testing.T) {
		r := newRig(t, node, sim.WithMIGEnabled())
		r.converge(0, from, nil)
		r.ap.crash = func(pt string, step int) bool { return pt == point && step == k }
		plan, _, err := MakePlan(r.gpu(0), r.profiles(0), to, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.ap.Apply(context.Background(), plan, nil); !errors.Is(err, errCrashed) {
			t.Fatalf("apply did not crash: %v", err)
		}
		leftBare = len(r.bareGIs(0)) > 0

		// Restart with the edited layout: a new applier over the same state
		// dir (it finds B's journal and abandons it), a fresh inventory.
		r.ap = NewApplier(r.node, r.dir, slog.New(slog.DiscardHandler))
		if _, st := r.converge(0, edited, nil); st.Phase != PhaseApplied {
			t.Fatalf("after the edit: %+v", st)
		}
		g := r.gpu(0)
		if got := counts(g); !maps.Equal(got, edited.Counts) {
			t.Errorf("end layout %v, want %v", got, edited.Counts)
		}
		for _, in := range g.Instances {
			if strings.Contains(in.Profile, "c.") {
				t.Errorf("instance %s is not whole: %s", in.UUID, in.Profile)
			}
		}
		if bare := r.bareGIs(0); len(bare) > 0 {
			t.Errorf("GPU instances without a compute instance left: %v", bare)
		}
		if len(g.GIsWithoutCI) > 0 {
			t.Errorf("inventory lists GPU instances without a compute instance: %+v", g.GIsWithoutCI)
		}
		if _, err := os.Stat(filepath.Join(r.dir, "mig", plan.UUID+".json")); !os.IsNotExist(err) {
			t.Errorf("journal left after convergence: %v", err)
		}
	})
	return leftBare
}

// TestPlanDestroysBareGI: an instance without a compute instance is removed
// whatever the layout, first among the destroys' reasons, and the applier
// removes it although it has nothing to destroy inside.
func TestPlanDestroysBareGI(t *testing.T) {
	for _, tc := range []struct {
		name string
		want Want
	}{
		// The layout keeps that profile at that placement: still destroyed,
		// then created whole.
		{"layout has it", want("2x3g.20gb")},
		{"layout lacks it", want("7x1g.5gb")},
		{"mig disabled", Want{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange())
			r.converge(0, want("1x3g.20gb"), nil)
			r.bareGI(0, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4-r.gpu(0).Instances[0].Placement.Start)
			g := r.gpu(0)
			if len(g.GIsWithoutCI) != 1 {
				t.Fatalf("inventory sees %+v, want the bare 3g at 4", g.GIsWithoutCI)
			}
			bare := g.GIsWithoutCI[0]
			p, st, err := MakePlan(g, r.profiles(0), tc.want, nil)
			if err != nil || st.Phase != PhasePlanned {
				t.Fatalf("plan: %+v %v", st, err)
			}
			destroys := 0
			for _, s := range p.Steps {
				if s.Op == OpDestroy && s.Placement == bare.Placement {
					destroys++
					if s.Reason != reasonBare || s.GI != bare.GI || len(s.UUIDs) != 0 {
						t.Errorf("step %+v", s)
					}
				}
			}
			if destroys != 1 {
				t.Fatalf("plan %v destroys the bare instance %d times", p.Steps, destroys)
			}
			if st, err := r.ap.Apply(context.Background(), p, nil); err != nil || st.Phase != PhaseApplied {
				t.Fatalf("apply: %+v %v", st, err)
			}
			if b := r.bareGIs(0); len(b) > 0 {
				t.Fatalf("left %v", b)
			}
			if tc.want.MIGEnabled {
				if got := counts(r.gpu(0)); !maps.Equal(got, tc.want.Counts) {
					t.Fatalf("end layout %v, want %v", got, tc.want.Counts)
				}
			} else if g := r.gpu(0); g.MIG.Current {
				t.Fatalf("MIG still on: %+v", g.MIG)
			}
		})
	}
}

// bareGI makes a GPU instance without a compute instance on GPU i.
func (r *rig) bareGI(i, profile, start int) {
	r.t.Helper()
	dev, ret := r.node.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		r.t.Fatal(ret)
	}
	info, ret := dev.GetGpuInstanceProfileInfo(profile)
	if ret != nvml.SUCCESS {
		r.t.Fatal(ret)
	}
	pl := nvml.GpuInstancePlacement{Start: uint32(start), Size: 4}
	if _, ret := dev.CreateGpuInstanceWithPlacement(&info, &pl); ret != nvml.SUCCESS {
		r.t.Fatal(ret)
	}
}

// TestPlanRefusesPartialGPU: a GPU whose MIG state was not read completely
// is not planned for: a missing instance may exist and be held.
func TestPlanRefusesPartialGPU(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	r.converge(0, want("7x1g.5gb"), nil)
	ps := r.profiles(0)
	for _, facts := range [][]gpu.Fact{
		{gpu.FactMIGMode, gpu.FactInstances, gpu.FactGIsWithoutCI},
		{gpu.FactInstances},
		{gpu.FactGIsWithoutCI},
	} {
		g := r.gpu(0)
		g.Instances = g.Instances[1:] // what a failed slot read leaves
		g.Unread = facts
		p, st, err := MakePlan(g, ps, want("1x7g.40gb"), nil)
		if err == nil || st.Phase != PhaseFailed || len(p.Steps) != 0 {
			t.Fatalf("unread %v: plan %v state %+v err %v, want a refusal", facts, p.Steps, st, err)
		}
		if !strings.Contains(err.Error(), g.UUID) || !strings.Contains(err.Error(), string(facts[0])) {
			t.Errorf("error %q does not name the GPU and what was not read", err)
		}
	}
	// Facts the planner does not use do not stop it.
	g := r.gpu(0)
	g.Unread = []gpu.Fact{gpu.FactNUMANode}
	if _, st, err := MakePlan(g, ps, want("1x7g.40gb"), nil); err != nil || st.Phase != PhasePlanned {
		t.Fatalf("numa node unread: %+v %v", st, err)
	}
}

// A Bare destroy step removes a GPU instance only while it has no compute
// instance: one made whole since it was seen bare (an admin's tool between
// its two calls) is a MIG device, and stays.
func TestBareDestroyLeavesWholeInstance(t *testing.T) {
	for _, tc := range []struct {
		name     string
		whole    bool // the instance has its compute instance by the time the step runs
		wantLeft int  // GPU instances left at the placement
	}{
		{"still bare", false, 0},
		{"made whole since", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			if tc.whole {
				r.converge(0, want("1x3g.20gb"), nil)
			} else {
				r.bareGI(0, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0)
			}
			g := r.gpu(0)
			pl := gpu.Placement{Start: 0, Size: 4}
			if tc.whole {
				pl = g.Instances[0].Placement
			}
			p := Plan{GPU: 0, UUID: g.UUID, Want: Want{MIGEnabled: true, Counts: map[string]int{}},
				Steps: []Step{{Op: OpDestroy, Profile: "3g.20gb", ProfileIndex: nvml.GPU_INSTANCE_PROFILE_3_SLICE, Placement: pl, Bare: true, Reason: "test"}}}
			if st, err := r.ap.Apply(context.Background(), p, nil); err != nil || st.Phase != PhaseApplied {
				t.Fatalf("apply: %+v %v", st, err)
			}
			g = r.gpu(0)
			if left := len(g.Instances) + len(g.GIsWithoutCI); left != tc.wantLeft {
				t.Errorf("%d GPU instances left (%+v, bare %+v), want %d", left, g.Instances, g.GIsWithoutCI, tc.wantLeft)
			}
		})
	}
}
