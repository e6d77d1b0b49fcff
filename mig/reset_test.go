package mig

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// simReset is the ResetFunc of a simulated node.
func simReset(n *sim.Node) ResetFunc {
	return func(_ context.Context, g gpu.GPU) error { return n.Reset(g.Index) }
}

func TestResetterProcesses(t *testing.T) {
	r := newRig(t, "dgx-a100", sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange())
	if _, st := r.converge(0, want("2x3g.20gb"), nil); st.Phase != PhaseApplied {
		t.Fatalf("layout not applied: %+v", st)
	}
	g := r.gpu(0)
	if len(g.Instances) != 2 {
		t.Fatalf("instances %v, want 2", layout(g))
	}
	in := g.Instances[1]
	if err := r.node.SetProcesses(0, []nvml.ProcessInfo{
		{Pid: 100, GpuInstanceId: sim.NoInstance, ComputeInstanceId: sim.NoInstance},
		{Pid: 200, GpuInstanceId: uint32(in.GI), ComputeInstanceId: uint32(in.CI)},
	}); err != nil {
		t.Fatal(err)
	}
	rs := NewResetter(r.node, simReset(r.node))
	ps, err := rs.Processes(g.UUID)
	if err != nil {
		t.Fatal(err)
	}
	// The GPU's handle lists every process; the MIG device's only its own.
	if !slices.Contains(ps, Process{PID: 200, Device: in.UUID}) || !slices.Contains(ps, Process{PID: 100, Device: g.UUID}) {
		t.Errorf("processes %v: want 100 on the GPU and 200 on MIG device %s", ps, in.UUID)
	}
	err = rs.Reset(context.Background(), g)
	if err == nil || !strings.Contains(err.Error(), "process 100 on "+g.UUID) {
		t.Fatalf("Reset with processes running: %v, want a refusal naming process 100", err)
	}
	if len(r.gpu(0).Instances) != 2 {
		t.Fatal("a refused reset destroyed the MIG devices")
	}
	if err := r.node.SetProcesses(0, nil); err != nil {
		t.Fatal(err)
	}
	if err := rs.Reset(context.Background(), g); err != nil {
		t.Fatal(err)
	}
	if got := r.gpu(0).Instances; len(got) != 0 {
		t.Errorf("after the reset: %d MIG devices, want none (a reset destroys them)", len(got))
	}
}

func TestResetterAppliesPendingMode(t *testing.T) {
	r := newRig(t, "dgx-a100") // MIG off; a mode change waits for a reset
	_, st := r.converge(0, want("1x7g.40gb"), nil)
	if st.Phase != PhaseResetRequired {
		t.Fatalf("phase %q (%s), want %s", st.Phase, st.Reason, PhaseResetRequired)
	}
	if err := NewResetter(r.node, simReset(r.node)).Reset(context.Background(), r.gpu(0)); err != nil {
		t.Fatal(err)
	}
	if _, st := r.converge(0, want("1x7g.40gb"), nil); st.Phase != PhaseApplied {
		t.Fatalf("after the reset: %+v, want applied", st)
	}
	if got := layout(r.gpu(0)); !slices.Equal(got, []string{"7g.40gb@0"}) {
		t.Errorf("layout %v", got)
	}
}

func TestResetterWithoutResetFunc(t *testing.T) {
	r := newRig(t, "dgx-a100")
	err := NewResetter(r.node, nil).Reset(context.Background(), r.gpu(0))
	if err == nil || !strings.Contains(err.Error(), "no way to reset") {
		t.Fatalf("got %v", err)
	}
}
