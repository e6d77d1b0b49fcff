package mig

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// rig is one simulated node with an applier journaling in a temp dir.
type rig struct {
	t    *testing.T
	node *sim.Node
	dir  string
	ap   *Applier
}

func newRig(t *testing.T, profile string, opts ...sim.Option) *rig {
	t.Helper()
	n, err := sim.New(profile, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	t.Cleanup(func() { n.Shutdown() })
	dir := t.TempDir()
	return &rig{t: t, node: n, dir: dir, ap: NewApplier(n, dir, slog.New(slog.DiscardHandler))}
}

func (r *rig) gpu(i int) gpu.GPU {
	r.t.Helper()
	inv, err := gpu.New(r.node, gpu.Options{})
	if err != nil {
		r.t.Fatal(err)
	}
	if len(inv.Errors) > 0 {
		r.t.Fatalf("inventory errors: %v", inv.Errors)
	}
	return inv.GPUs[i]
}

func (r *rig) profiles(i int) Profiles {
	r.t.Helper()
	dev, ret := r.node.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		r.t.Fatal(ret)
	}
	g := r.gpu(i)
	ps, err := QueryProfiles(dev, g.MemoryBytes)
	if err != nil {
		r.t.Fatal(err)
	}
	return ps
}

// converge plans and applies until the GPU settles, returning the last plan
// with steps and the state.
func (r *rig) converge(i int, want Want, held map[string]string) (Plan, State) {
	r.t.Helper()
	ps := r.profiles(i)
	var last Plan
	for range 3 {
		p, st, err := MakePlan(r.gpu(i), ps, want, held)
		if err != nil {
			r.t.Fatalf("plan: %v", err)
		}
		if st.Phase != PhasePlanned && st.Phase != PhaseApplied {
			return last, st
		}
		if len(p.Steps) > 0 {
			last = p
		}
		// Apply runs for empty plans too: it finishes a journaled plan a
		// crash interrupted after its last NVML call.
		if st, err = r.ap.Apply(context.Background(), p, nil); err != nil {
			r.t.Fatalf("apply %v: %v", p.Steps, err)
		}
		if st.Phase != PhaseApplied || len(p.Steps) == 0 {
			return last, st
		}
	}
	r.t.Fatalf("gpu %d did not settle on %s", i, want)
	return last, State{}
}

// layout is the GPU's instances as "profile@start", sorted: what must be
// equal for two runs to have reached the same end.
func layout(g gpu.GPU) []string {
	var out []string
	for _, in := range g.Instances {
		out = append(out, fmt.Sprintf("%s@%d", in.Profile, in.Placement.Start))
	}
	slices.Sort(out)
	return out
}

func uuids(g gpu.GPU) []string {
	var out []string
	for _, in := range g.Instances {
		out = append(out, in.UUID)
	}
	return out
}

func counts(g gpu.GPU) map[string]int {
	out := map[string]int{}
	for _, in := range g.Instances {
		out[in.Profile]++
	}
	return out
}

func want(spec string) Want {
	w := Want{MIGEnabled: true, Counts: map[string]int{}}
	for _, f := range strings.Fields(spec) {
		var n int
		var name string
		if _, err := fmt.Sscanf(strings.Replace(f, "x", " ", 1), "%d %s", &n, &name); err != nil {
			panic(f)
		}
		w.Counts[name] += n
	}
	return w
}
