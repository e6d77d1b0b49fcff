package mig

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

func TestCrashAtEveryStepThenResume(t *testing.T) {
	from, to := want("7x1g.5gb"), want("1x3g.20gb 1x2g.10gb 2x1g.5gb")
	// Reference: the run nobody interrupts.
	ref := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	ref.converge(0, from, nil)
	p, _, err := MakePlan(ref.gpu(0), ref.profiles(0), to, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref.converge(0, to, nil)
	wantLayout := layout(ref.gpu(0))

	for k := range p.Steps {
		for _, point := range []string{"before", "mid", "after"} {
			if point == "mid" && p.Steps[k].Op == OpSetMode {
				continue
			}
			t.Run(fmt.Sprintf("%s step %d %s", point, k, p.Steps[k]), func(t *testing.T) {
				r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
				r.converge(0, from, nil)
				r.ap.crash = func(pt string, step int) bool { return pt == point && step == k }
				plan, _, _ := MakePlan(r.gpu(0), r.profiles(0), to, nil)
				if _, err := r.ap.Apply(context.Background(), plan, nil); !errors.Is(err, errCrashed) {
					t.Fatalf("apply did not crash: %v", err)
				}
				if _, err := os.Stat(filepath.Join(r.dir, "mig", plan.UUID+".json")); err != nil {
					t.Fatalf("no journal after crash: %v", err)
				}
				// Restart: a new applier over the same state dir, fresh snapshot.
				r.ap = NewApplier(r.node, r.dir, slog.New(slog.DiscardHandler))
				if _, st := r.converge(0, to, nil); st.Phase != PhaseApplied {
					t.Fatalf("resume: %+v", st)
				}
				if got := layout(r.gpu(0)); !slices.Equal(got, wantLayout) {
					t.Fatalf("end layout %v, uninterrupted run reached %v", got, wantLayout)
				}
				if _, err := os.Stat(filepath.Join(r.dir, "mig", plan.UUID+".json")); !os.IsNotExist(err) {
					t.Fatalf("journal left after success: %v", err)
				}
			})
		}
	}
}

func TestCrashThenNewLayoutRemovesHalfCreatedInstance(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	r.ap.crash = func(pt string, step int) bool { return pt == "mid" && step == 0 }
	plan, _, _ := MakePlan(r.gpu(0), r.profiles(0), want("1x7g.40gb"), nil)
	if _, err := r.ap.Apply(context.Background(), plan, nil); !errors.Is(err, errCrashed) {
		t.Fatalf("apply did not crash: %v", err)
	}
	r.ap = NewApplier(r.node, r.dir, slog.New(slog.DiscardHandler))
	// The half-made 7g (a GI without CI) is invisible to the inventory but
	// would block every create; the new layout must still fit.
	if _, st := r.converge(0, want("7x1g.5gb"), nil); st.Phase != PhaseApplied {
		t.Fatalf("%+v", st)
	}
	if got := len(r.gpu(0).Instances); got != 7 {
		t.Fatalf("%d instances, want 7", got)
	}
}

// An exact plan (the agent's own change for a claim: one device at one
// placement) resumes only a journal of the same change. Another with the
// same counts (a device of the same profile elsewhere) abandons it, the
// half-made GPU instance included, and makes its own device.
func TestExactPlanResumesOnlyItsOwnJournal(t *testing.T) {
	create := func(r *rig, start int) Plan {
		p := r.profiles(0)["3g.20gb"]
		return Plan{GPU: 0, UUID: r.gpu(0).UUID, Want: want("1x3g.20gb"), Exact: true, Steps: []Step{{
			Op: OpCreate, Profile: p.Name, ProfileIndex: p.Index, Placement: gpu.Placement{Start: start, Size: 4}, Reason: "claim"}}}
	}
	for _, tc := range []struct {
		point string // where the first plan is cut short
		next  int    // the placement the next plan makes its device at
		want  []string
	}{
		{"before", 4, []string{"3g.20gb@4"}},
		{"mid", 4, []string{"3g.20gb@4"}},
		{"before", 0, []string{"3g.20gb@0"}}, // the same change: resumed
		{"mid", 0, []string{"3g.20gb@0"}},
	} {
		t.Run(fmt.Sprintf("%s, then at %d", tc.point, tc.next), func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			r.ap.crash = func(pt string, step int) bool { return pt == tc.point && step == 0 }
			if _, err := r.ap.Apply(context.Background(), create(r, 0), nil); !errors.Is(err, errCrashed) {
				t.Fatalf("apply did not crash: %v", err)
			}
			r.ap = NewApplier(r.node, r.dir, slog.New(slog.DiscardHandler))
			if st, err := r.ap.Apply(context.Background(), create(r, tc.next), nil); err != nil || st.Phase != PhaseApplied {
				t.Fatalf("the next plan: %+v, %v", st, err)
			}
			g := r.gpu(0)
			if got := layout(g); !slices.Equal(got, tc.want) || len(g.GIsWithoutCI) > 0 {
				t.Errorf("GPU 0 has %v, GPU instances without a compute instance %v; want %v, none", got, g.GIsWithoutCI, tc.want)
			}
		})
	}
}

func TestFailedStepLeavesReportedValidState(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
	r.converge(0, want("2x3g.20gb"), nil)
	g := r.gpu(0)
	p, _, _ := MakePlan(g, r.profiles(0), want("1x3g.20gb 2x2g.10gb"), nil)
	// A process in the GI the plan destroys makes the destroy fail (IN_USE).
	var gi, ci int
	for _, in := range g.Instances {
		if in.Placement == p.Steps[0].Placement {
			gi, ci = in.GI, in.CI
		}
	}
	if err := r.node.SetProcesses(0, []nvml.ProcessInfo{{Pid: 7, GpuInstanceId: uint32(gi), ComputeInstanceId: uint32(ci)}}); err != nil {
		t.Fatal(err)
	}
	st, err := r.ap.Apply(context.Background(), p, nil)
	if err == nil || st.Phase != PhaseFailed || st.Reason == "" {
		t.Fatalf("state %+v err %v, want failed", st, err)
	}
	after := r.gpu(0) // reads cleanly: whole instances only
	if got := layout(after); !slices.Equal(got, []string{"3g.20gb@0", "3g.20gb@4"}) {
		t.Fatalf("layout after failure %v", got)
	}
	if _, err := os.Stat(filepath.Join(r.dir, "mig", p.UUID+".json")); !os.IsNotExist(err) {
		t.Fatalf("journal kept after a failed step: %v", err)
	}
}

// A MIG change NVML refuses for want of privileges (the chart's default
// mig.access=monitor) says which chart value allows it; other failures do
// not.
func TestFailedStepNamesChartValue(t *testing.T) {
	for _, tt := range []struct {
		name     string
		mig      bool // MIG mode on at start
		call     string
		ret      nvml.Return
		wantHint bool
	}{
		{"mode change refused", false, "SetMigMode", nvml.ERROR_NO_PERMISSION, true},
		{"instance creation refused", true, "CreateGpuInstanceWithPlacement", nvml.ERROR_NO_PERMISSION, true},
		{"another failure", true, "CreateGpuInstanceWithPlacement", nvml.ERROR_UNKNOWN, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var opts []sim.Option
			if tt.mig {
				opts = append(opts, sim.WithMIGEnabled())
			}
			r := newRig(t, "dgx-h100", append(opts, sim.WithImmediateMIGModeChange())...)
			p, _, err := MakePlan(r.gpu(0), r.profiles(0), want("1x3g.40gb"), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.node.FailCalls(0, tt.call, tt.ret, -1); err != nil {
				t.Fatal(err)
			}
			st, err := r.ap.Apply(context.Background(), p, nil)
			if err == nil || st.Phase != PhaseFailed || !errors.Is(err, tt.ret) {
				t.Fatalf("state %+v err %v, want failed with %v", st, err, tt.ret)
			}
			if got := strings.Contains(st.Reason, "mig.access=manage"); got != tt.wantHint {
				t.Errorf("reason %q: names mig.access=manage %v, want %v", st.Reason, got, tt.wantHint)
			}
		})
	}
}
