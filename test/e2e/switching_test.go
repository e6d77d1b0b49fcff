//go:build e2e

package e2e

import (
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// Switching a node from the GPU Operator (issue 32): the MIG reset an A100 needs, and NVIDIA's device plugin
// still running beside gpu-agent.

// An A100 turns MIG on only after a GPU reset. With mig.resetPolicy whenIdle (the default) the agent resets
// every GPU nothing holds at once and lays them out; the GPU a pod holds is not touched (its mode change is not
// even tried: pending), and /status names the pod as what the reset waits for; once the pod ends, the mode
// change, the reset and the layout happen.
func TestMIGResetWaitsForPod(t *testing.T) {
	const res3g = "nvidia.com/mig-3g.20gb"
	// The pod's end reaches the agent through pod-resources, polled at each resync: pass it sooner than the
	// default 30 s.
	t.Setenv("GPU_AGENT_RESYNC", "2s")
	// sim:dgx-a100 without immediate-mig-mode: MIG off, and turning it on waits for a reset, as on an A100.
	e := start(t, healthConfig) // whole GPUs
	waitAllocatable(t, e, nodeGPUs)
	ctx := stepCtx(t)
	if err := e.AddPod(harness.PodSpec{Name: "holder", Limits: map[string]int64{gpuResource: 1}}); err != nil {
		t.Fatal(err)
	}
	id := runningContainer(t, e, "holder")
	held, err := e.PodDevices(ctx, "holder", gpuResource)
	if err != nil || len(held) != 1 {
		t.Fatalf("pod holder holds %v (%v), want one GPU", held, err)
	}

	if err := e.UpdateAgentConfig(migLayoutConfig(`{"3g.20gb": 2}`)); err != nil {
		t.Fatal(err)
	}
	// The seven free GPUs are reset and laid out without waiting for the eighth.
	if _, err := e.WaitAllocatable(stepCtx(t), res3g, 2*(nodeGPUs-1)); err != nil {
		t.Fatal(err)
	}
	pod := "pod " + harness.PodNamespace + "/" + e.PodName("holder") + " (main)"
	st, err := e.WaitAgentStatus(stepCtx(t), "the held GPU waiting for its reset, naming the pod", func(st *harness.AgentStatus) bool {
		applied, blocked := 0, 0
		for _, m := range st.MIG {
			switch {
			case m.UUID == held[0] && m.Phase == "pending" && slices.Contains(m.ResetBlockers, pod):
				blocked++
			case m.UUID != held[0] && m.Phase == "applied":
				applied++
			}
		}
		return blocked == 1 && applied == nodeGPUs-1
	})
	if err != nil {
		t.Fatalf("%v: MIG %+v", err, st.MIG)
	}
	for _, g := range st.GPUs {
		if g.UUID == held[0] && len(g.Instances) != 0 {
			t.Errorf("the held GPU %s was partitioned under its pod: %+v", held[0], g.Instances)
		}
	}
	for _, m := range st.MIG {
		if m.UUID == held[0] {
			t.Logf("held GPU %d: %s; resetBlockers %q", m.GPU, m.Reason, m.ResetBlockers)
		}
	}
	assertTaskRunning(t, e, id)

	if err := e.DeletePod("holder"); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitGone(stepCtx(t), "holder"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), res3g, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAgentStatus(stepCtx(t), "every GPU applied", migSettledAll); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), gpuResource, 0); err != nil {
		t.Fatal(err)
	}
	if log := agentLog(t, e); !strings.Contains(log, "GPU reset: its pending MIG mode is current") {
		t.Errorf("the agent's log does not record the resets (%s)", e.Agent().LogPath)
	}
}

// migSettledAll reports whether every GPU's MIG plan is applied.
func migSettledAll(st *harness.AgentStatus) bool {
	for _, m := range st.MIG {
		if m.Phase != "applied" {
			return false
		}
	}
	return len(st.MIG) == nodeGPUs
}

func agentLog(t *testing.T, e *harness.Env) string {
	t.Helper()
	b, err := os.ReadFile(e.Agent().LogPath)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
