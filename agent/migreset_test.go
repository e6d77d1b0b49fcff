package agent

import (
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// a100Layout is every GPU of an A100 node as two 3g.20gb, under policy
// ("": the default).
func a100Layout(policy string) string {
	s := mixedLayout(`{"3g.20gb": 2}`)
	if policy != "" {
		s = strings.Replace(s, "      strategy: mixed\n", "      strategy: mixed\n      resetPolicy: "+policy+"\n", 1)
	}
	return s
}

// setPending makes GPU i's MIG enable pending, as an earlier SetMigMode
// (by this agent or a person) leaves it on an A100.
func setPending(t *testing.T, n *sim.Node, i int) {
	t.Helper()
	dev, r := n.DeviceGetHandleByIndex(i)
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	if act, r := dev.SetMigMode(nvml.DEVICE_MIG_ENABLE); r != nvml.SUCCESS || act != nvml.ERROR_RESET_REQUIRED {
		t.Fatalf("SetMigMode: %v, activation %v; want a change pending a reset", r, act)
	}
}

func migMode(t *testing.T, n *sim.Node, i int) (current, pending int) {
	t.Helper()
	dev, _ := n.DeviceGetHandleByIndex(i)
	c, p, r := dev.GetMigMode()
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	return c, p
}

// With nothing on them, the agent resets the GPUs whose MIG enable waits
// for a reset, as mig-manager does, and the layout lands in the same pass.
func TestMIGResetWhenIdle(t *testing.T) {
	c := &cluster{}
	h := newHarness(t, simNode(t, "dgx-a100"), withMIG(), withReset(), withCluster(c))
	h.config(a100Layout(""))
	for _, st := range h.a.Status().MIG {
		if st.Phase != mig.PhaseApplied {
			t.Errorf("GPU %d: %s (%s), want applied", st.GPU, st.Phase, st.Reason)
		}
	}
	if got := h.count("nvidia.com/mig-3g.20gb"); got != 16 {
		t.Errorf("%d 3g.20gb devices offered, want 16", got)
	}
	ev := strings.Join(c.took(), "\n")
	if n := strings.Count(ev, "Normal "+ReasonMIGGPUReset); n != 8 {
		t.Errorf("events:\n%s\nwant 8 %s", ev, ReasonMIGGPUReset)
	}
}

// A GPU a pod holds is not reset: /status names the pod; the GPU is
// reset once the pod ends, and the layout lands.
func TestMIGResetWaitsForHolder(t *testing.T) {
	node := simNode(t, "dgx-a100")
	setPending(t, node, 0)
	h := newHarness(t, node, withMIG(), withReset())
	h.config(wholeGPUs)
	held := findGPU(h, 0).ID
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, held)})
	h.config(a100Layout(""))
	st := h.migState(0)
	if st.Phase != mig.PhaseResetRequired || !slices.Contains(st.ResetBlockers, "pod ml/trainer (main)") || !strings.Contains(st.Reason, "the reset waits for pod ml/trainer (main)") {
		t.Fatalf("GPU 0 held: %+v, want reset-required naming pod ml/trainer", st)
	}
	if cur, _ := migMode(t, node, 0); cur != nvml.DEVICE_MIG_DISABLE {
		t.Fatal("GPU 0 was reset under its holder")
	}
	for i := 1; i < 8; i++ {
		if st := h.migState(i); st.Phase != mig.PhaseApplied {
			t.Errorf("GPU %d: %+v; only GPU 0 is held", i, st)
		}
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU)})
	if st := h.migState(0); st.Phase != mig.PhaseApplied || len(st.ResetBlockers) != 0 {
		t.Fatalf("released: %+v, want applied", st)
	}
	if got := h.count("nvidia.com/mig-3g.20gb"); got != 16 {
		t.Errorf("%d 3g.20gb devices, want 16", got)
	}
}

// A GPU a pod holds when the layout arrives, its MIG mode not yet pending
// (the A100 a user meets first): its mode change is not tried under the
// pod, /status names the pod as what the reset waits for, and once the
// pod ends the mode change, the reset and the layout happen in one pass.
func TestMIGModeChangeWaitsForHolder(t *testing.T) {
	node := simNode(t, "dgx-a100")
	h := newHarness(t, node, withMIG(), withReset())
	h.config(wholeGPUs)
	held := findGPU(h, 0).ID
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, held)})
	h.config(a100Layout(""))
	st := h.migState(0)
	if st.Phase != mig.PhasePending || !slices.Contains(st.ResetBlockers, "pod ml/trainer (main)") || !strings.Contains(st.Reason, "the MIG mode change waits") {
		t.Fatalf("GPU 0 held: %+v, want pending, its reset waiting for pod ml/trainer", st)
	}
	if cur, pending := migMode(t, node, 0); cur != nvml.DEVICE_MIG_DISABLE || pending != nvml.DEVICE_MIG_DISABLE {
		t.Fatalf("GPU 0 held: MIG mode %d, pending %d; want the change not tried", cur, pending)
	}
	for i := 1; i < 8; i++ {
		if st := h.migState(i); st.Phase != mig.PhaseApplied {
			t.Errorf("GPU %d: %+v; only GPU 0 is held", i, st)
		}
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU)})
	if st := h.migState(0); st.Phase != mig.PhaseApplied || len(st.ResetBlockers) != 0 {
		t.Fatalf("released: %+v, want applied", st)
	}
	if got := h.count("nvidia.com/mig-3g.20gb"); got != 16 {
		t.Errorf("%d 3g.20gb devices, want 16", got)
	}
}

// A process NVML lists on the GPU blocks the reset as a holder does, even
// with no pod known to hold it (a process outside Kubernetes).
func TestMIGResetWaitsForProcess(t *testing.T) {
	node := simNode(t, "dgx-a100")
	setPending(t, node, 2)
	if err := node.SetProcesses(2, []nvml.ProcessInfo{{Pid: 4242, GpuInstanceId: sim.NoInstance, ComputeInstanceId: sim.NoInstance}}); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, node, withMIG(), withReset())
	h.config(a100Layout(""))
	st := h.migState(2)
	if st.Phase != mig.PhaseResetRequired || len(st.ResetBlockers) != 1 || !strings.HasPrefix(st.ResetBlockers[0], "process 4242 on GPU-") {
		t.Fatalf("GPU 2 with a process: %+v, want reset-required naming process 4242", st)
	}
	if err := node.SetProcesses(2, nil); err != nil {
		t.Fatal(err)
	}
	h.step(Tick{})
	if st := h.migState(2); st.Phase != mig.PhaseApplied {
		t.Fatalf("process gone: %+v, want applied", st)
	}
}

// resetPolicy never leaves every GPU reset-required, saying so; and an
// agent that cannot reset says that.
func TestMIGResetNot(t *testing.T) {
	tests := []struct {
		name   string
		policy string
		opts   []harnessOption
		reason string
	}{
		{"policy never", "never", []harnessOption{withMIG(), withReset()}, "mig.resetPolicy is never"},
		{"no resetter", "whenIdle", []harnessOption{withMIG()}, "this agent cannot reset GPUs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := simNode(t, "dgx-a100")
			h := newHarness(t, node, tt.opts...)
			h.config(a100Layout(tt.policy))
			h.step(Tick{})
			for i := range 8 {
				st := h.migState(i)
				if st.Phase != mig.PhaseResetRequired || !strings.Contains(st.Reason, tt.reason) {
					t.Errorf("GPU %d: %+v, want reset-required saying %q", i, st, tt.reason)
				}
				if cur, pending := migMode(t, node, i); cur != nvml.DEVICE_MIG_DISABLE || pending != nvml.DEVICE_MIG_ENABLE {
					t.Errorf("GPU %d: MIG mode %d pending %d, want the enable still pending", i, cur, pending)
				}
			}
		})
	}
}
