package mig

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

func TestQueryProfiles(t *testing.T) {
	// The names the MIG User Guide's "Supported MIG Profiles" tables give
	// each model, as NVIDIA's tools derive them from NVML's sizes.
	for _, tc := range []struct {
		node   string
		want   []string
		slices int
	}{
		{"dgx-a100", []string{"1g.10gb", "1g.5gb", "1g.5gb+me", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}, 8},
		{"dgx-a100-80gb", []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}, 8},
		{"dgx-h100", []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}, 8},
		{"pcie-h100nvl-x2", []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"}, 8},
		{"gh200", []string{"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"}, 8},
		{"dgx-h200", []string{"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}, 8},
		{"dgx-b200", []string{"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"}, 8},
		{"pcie-a30x4", []string{"1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"}, 4},
	} {
		t.Run(tc.node, func(t *testing.T) {
			r := newRig(t, tc.node, sim.WithMIGEnabled())
			ps := r.profiles(0)
			if got := ps.names(); !slices.Equal(got, tc.want) {
				t.Fatalf("names = %v, want %v", got, tc.want)
			}
			if ps.memorySlices() != tc.slices {
				t.Errorf("memory slices = %d, want %d", ps.memorySlices(), tc.slices)
			}
			if p := ps["3g.20gb"]; tc.node == "dgx-a100" && (len(p.Placements) != 2 || p.Placements[1].Start != 4) {
				t.Errorf("3g.20gb placements = %v", p.Placements)
			}
		})
	}
}

func TestPlanKeepsWhatFits(t *testing.T) {
	for _, tc := range []struct {
		name         string
		from, to     string
		wantDestroys int
		wantCreates  int
	}{
		{"same layout twice", "7x1g.5gb", "7x1g.5gb", 0, 0},
		{"shrink", "7x1g.5gb", "5x1g.5gb", 2, 0},
		{"grow into free space", "1x3g.20gb", "1x3g.20gb 2x1g.5gb", 0, 2},
		{"one 2g needs an aligned pair", "7x1g.5gb", "5x1g.5gb 1x2g.10gb", 2, 1},
		{"3g keeps its half", "2x3g.20gb", "1x3g.20gb 2x2g.10gb", 1, 2},
		{"all change", "7x1g.5gb", "1x7g.40gb", 7, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			r.converge(0, want(tc.from), nil)
			before := r.gpu(0)
			p, st, err := MakePlan(before, r.profiles(0), want(tc.to), nil)
			if err != nil {
				t.Fatal(err)
			}
			creates := len(p.Steps) - p.Destroys()
			if p.Destroys() != tc.wantDestroys || creates != tc.wantCreates {
				t.Fatalf("destroys %d creates %d, want %d and %d: %v", p.Destroys(), creates, tc.wantDestroys, tc.wantCreates, p.Steps)
			}
			if len(p.Steps) == 0 && st.Phase != PhaseApplied {
				t.Fatalf("empty plan in phase %s", st.Phase)
			}
			if _, st = r.converge(0, want(tc.to), nil); st.Phase != PhaseApplied {
				t.Fatalf("state %+v", st)
			}
			after := r.gpu(0)
			if got := counts(after); !maps.Equal(got, want(tc.to).Counts) {
				t.Fatalf("end layout %v, want %v", got, want(tc.to).Counts)
			}
			// Sim UUIDs derive from GI/CI ids, which are reused, so
			// survivors are told by profile and placement instead.
			for _, in := range before.Instances {
				destroyed := slices.ContainsFunc(p.Steps, func(s Step) bool {
					return s.Op == OpDestroy && s.Placement == in.Placement
				})
				at := in.Profile + "@" + strconv.Itoa(in.Placement.Start)
				if !destroyed && !slices.Contains(layout(after), at) {
					t.Errorf("%s was not to be destroyed but is gone: %v", at, layout(after))
				}
			}
			// Idempotence: planning again finds nothing to do.
			p, st, _ = MakePlan(after, r.profiles(0), want(tc.to), nil)
			if len(p.Steps) != 0 || st.Phase != PhaseApplied {
				t.Errorf("second plan %v (%s), want none", p.Steps, st.Phase)
			}
		})
	}
}

func TestImpossibleLayouts(t *testing.T) {
	for _, tc := range []struct{ node, layout, msg string }{
		{"dgx-a100", "1x8g.80gb", "profile 8g.80gb not offered"},
		{"dgx-a100", "2x1g.5gb+me", "exceeds the profile's limit of 1"},
		{"dgx-a100", "2x3g.20gb 1x1g.5gb", "needs 9 memory slices, the GPU has 8"},
		{"dgx-a100", "1x4g.20gb 2x2g.10gb", "no placement"},
		// Memory slices and placements allow it; the A30's one OFA does not.
		{"pcie-a30x4", "1x1g.6gb+me 1x2g.12gb+me", "needs 2 optical flow accelerators (1× 1g.6gb+me, 1× 2g.12gb+me), the GPU has 1"},
	} {
		t.Run(tc.node+"/"+tc.layout, func(t *testing.T) {
			r := newRig(t, tc.node, sim.WithMIGEnabled())
			g, ps := r.gpu(2), r.profiles(2)
			p, st, err := MakePlan(g, ps, want(tc.layout), nil)
			if err == nil || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), "gpu 2 (GPU-") {
				t.Fatalf("err = %v, want one naming gpu 2 and %q", err, tc.msg)
			}
			if st.Phase != PhaseFailed || len(p.Steps) != 0 {
				t.Fatalf("state %+v, steps %v", st, p.Steps)
			}
		})
	}
}

func TestHeldInstancesNeverDestroyed(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	r.converge(0, want("7x1g.5gb"), nil)
	g := r.gpu(0)
	ps := r.profiles(0)
	// Instance at slice 4 blocks a 3g at 4; the other free half holds one.
	var heldUUID string
	for _, in := range g.Instances {
		if in.Placement.Start == 4 {
			heldUUID = in.UUID
		}
	}
	held := map[string]string{heldUUID: "default/train-0"}

	t.Run("kept when the layout can keep it", func(t *testing.T) {
		p, st, err := MakePlan(g, ps, want("1x3g.20gb 3x1g.5gb"), held)
		if err != nil || st.Phase != PhasePlanned {
			t.Fatalf("%v %+v", err, st)
		}
		for _, s := range p.Steps {
			if slices.Contains(s.UUIDs, heldUUID) {
				t.Fatalf("plan destroys held %s: %v", heldUUID, s)
			}
		}
	})
	t.Run("pending when it must go", func(t *testing.T) {
		p, st, err := MakePlan(g, ps, want("2x3g.20gb"), held)
		if err != nil {
			t.Fatal(err)
		}
		if st.Phase != PhasePending || !strings.Contains(st.Reason, "default/train-0") || !strings.Contains(st.Reason, heldUUID) {
			t.Fatalf("state %+v, want pending naming the holder", st)
		}
		if len(p.Steps) != 0 {
			t.Fatalf("pending plan has steps %v", p.Steps)
		}
		if _, st := r.converge(0, want("2x3g.20gb"), held); st.Phase != PhasePending {
			t.Fatalf("converge while held: %+v", st)
		}
		if !slices.Contains(uuids(r.gpu(0)), heldUUID) {
			t.Fatal("held instance destroyed")
		}
		// Released: the GPU converges by itself on the next pass.
		if _, st := r.converge(0, want("2x3g.20gb"), nil); st.Phase != PhaseApplied {
			t.Fatalf("after release: %+v", st)
		}
		if got := layout(r.gpu(0)); !slices.Equal(got, []string{"3g.20gb@0", "3g.20gb@4"}) {
			t.Fatalf("layout %v", got)
		}
	})
	t.Run("mig disable waits too", func(t *testing.T) {
		g := r.gpu(0)
		held := map[string]string{g.Instances[0].UUID: "ns/p"}
		_, st, err := MakePlan(g, ps, Want{}, held)
		if err != nil || st.Phase != PhasePending || !strings.Contains(st.Reason, "ns/p") {
			t.Fatalf("%v %+v", err, st)
		}
	})
}

func TestMIGModeChanges(t *testing.T) {
	t.Run("enable needs a reset", func(t *testing.T) {
		r := newRig(t, "dgx-a100")
		p, st := r.converge(1, want("2x3g.20gb"), nil)
		if st.Phase != PhaseResetRequired || p.Steps[0].Op != OpSetMode {
			t.Fatalf("state %+v plan %v", st, p.Steps)
		}
		// Until the reset, planning again reports the same without steps.
		if p, st, _ := MakePlan(r.gpu(1), r.profiles(1), want("2x3g.20gb"), nil); st.Phase != PhaseResetRequired || len(p.Steps) != 0 {
			t.Fatalf("replan %+v %v", st, p.Steps)
		}
		if err := r.node.Reset(1); err != nil {
			t.Fatal(err)
		}
		if _, st := r.converge(1, want("2x3g.20gb"), nil); st.Phase != PhaseApplied {
			t.Fatalf("after reset %+v", st)
		}
		if got := layout(r.gpu(1)); len(got) != 2 {
			t.Fatalf("layout %v", got)
		}
	})
	t.Run("immediate enable then disable", func(t *testing.T) {
		r := newRig(t, "dgx-h100", sim.WithImmediateMIGModeChange())
		if _, st := r.converge(0, want("1x4g.40gb 1x3g.40gb"), nil); st.Phase != PhaseApplied {
			t.Fatalf("enable %+v", st)
		}
		if !r.gpu(0).MIG.Current || len(r.gpu(0).Instances) != 2 {
			t.Fatalf("gpu %+v", r.gpu(0))
		}
		if _, st := r.converge(0, Want{}, nil); st.Phase != PhaseApplied {
			t.Fatalf("disable %+v", st)
		}
		if g := r.gpu(0); g.MIG.Current || len(g.Instances) != 0 {
			t.Fatalf("gpu after disable %+v", g.MIG)
		}
	})
	t.Run("processes block the mode change", func(t *testing.T) {
		r := newRig(t, "dgx-h100", sim.WithImmediateMIGModeChange())
		if err := r.node.SetProcesses(3, []nvml.ProcessInfo{{Pid: 42, GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}}); err != nil {
			t.Fatal(err)
		}
		_, st := r.converge(3, want("7x1g.10gb"), nil)
		if st.Phase != PhasePending || !strings.Contains(st.Reason, "processes") {
			t.Fatalf("state %+v", st)
		}
	})
}
