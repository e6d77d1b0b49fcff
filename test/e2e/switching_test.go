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

// standInIDs are the devices the second plugin offers: names no GPU of gpu-agent's has, so that the kubelet's
// list says whose devices it holds.
var standInIDs = []string{"other-plugin-0", "other-plugin-1"}

// NVIDIA's device plugin is still on the node when gpu-agent starts (docs/migrating.md, "Conflicts gpu-agent
// detects"): gpu-agent says so on /status and in its log, and does not serve nvidia.com/gpu, so the kubelet's
// devices are the other plugin's alone; once that plugin is gone, gpu-agent serves the GPUs.
func TestSecondDevicePluginFirst(t *testing.T) {
	// The other plugin's socket is looked for at each pass of the agent's loop: pass it sooner than the
	// default 30 s resync.
	t.Setenv("GPU_AGENT_RESYNC", "2s")
	e := start(t, "")
	waitAllocatable(t, e, nodeGPUs)
	// The kubelet wipes the device plugin directory when it starts, so the other plugin comes after it: take
	// gpu-agent off, put the other plugin on, then start gpu-agent again.
	if err := e.StopAgent(); err != nil {
		t.Fatal(err)
	}
	waitAllocatable(t, e, 0)
	other, err := harness.StartStandInPlugin(stepCtx(t), "nvidia-gpu.sock", gpuResource, standInIDs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Stop)
	if ids := waitAllocatable(t, e, len(standInIDs)); !slices.Equal(ids, standInIDs) {
		t.Fatalf("the kubelet offers %v, want the other plugin's %v", ids, standInIDs)
	}
	if err := e.StartAgent(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	checkConflictHeld(t, e)
	if log := agentLog(t, e); !strings.Contains(log, "conflict with another GPU component on this node") {
		t.Errorf("the agent's log does not report the conflict (%s)", e.Agent().LogPath)
	}

	other.Stop()
	if ids := waitAllocatable(t, e, nodeGPUs); !slices.Equal(ids, nodeUUIDs(t)) {
		t.Fatalf("after the other plugin left the kubelet offers %v, want the node's GPUs", ids)
	}
	if _, err := e.WaitAgentStatus(stepCtx(t), "no conflict", func(st *harness.AgentStatus) bool {
		return len(st.Conflicts) == 0
	}); err != nil {
		t.Fatal(err)
	}
	if log := agentLog(t, e); !strings.Contains(log, "conflict over") {
		t.Errorf("the agent's log does not say the conflict is over (%s)", e.Agent().LogPath)
	}
}

// NVIDIA's device plugin registers nvidia.com/gpu while gpu-agent serves it (someone installs it on a node
// gpu-agent already runs on). The kubelet takes the newer registration; gpu-agent reports the conflict and goes
// quiet on the resource without closing its stream (closing it would make the kubelet drop the other plugin
// too), leaving the kubelet the other plugin's devices alone; once that plugin is gone, gpu-agent serves the GPUs
// again.
func TestSecondDevicePluginAfter(t *testing.T) {
	t.Setenv("GPU_AGENT_RESYNC", "2s")
	e := start(t, "")
	waitAllocatable(t, e, nodeGPUs)
	other, err := harness.StartStandInPlugin(stepCtx(t), "nvidia-gpu.sock", gpuResource, standInIDs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Stop)
	checkConflictHeld(t, e)
	if log := agentLog(t, e); !strings.Contains(log, "it is left to that plugin") {
		t.Errorf("the agent's log does not say it left the resource to the other plugin (%s)", e.Agent().LogPath)
	}

	other.Stop()
	if ids := waitAllocatable(t, e, nodeGPUs); !slices.Equal(ids, nodeUUIDs(t)) {
		t.Fatalf("after the other plugin left the kubelet offers %v, want the node's GPUs", ids)
	}
	if _, err := e.WaitAgentStatus(stepCtx(t), "no conflict, nvidia.com/gpu registered", func(st *harness.AgentStatus) bool {
		for _, r := range st.Registrations {
			if r.Resource == gpuResource && r.Registered {
				return len(st.Conflicts) == 0
			}
		}
		return false
	}); err != nil {
		t.Fatal(err)
	}
}

// checkConflictHeld waits for gpu-agent to report the other plugin's nvidia.com/gpu on /status, then checks,
// over three more turns of its loop, that it serves no nvidia.com/gpu and that the kubelet offers the other
// plugin's devices alone.
func checkConflictHeld(t *testing.T, e *harness.Env) {
	t.Helper()
	st, err := e.WaitAgentStatus(stepCtx(t), "the other plugin reported", func(st *harness.AgentStatus) bool {
		return slices.ContainsFunc(st.Conflicts, func(c string) bool {
			return strings.Contains(c, "another device plugin serves "+gpuResource)
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("conflicts: %q", st.Conflicts)
	turns, last := 0, st.LastLoop
	st, err = e.WaitAgentStatus(stepCtx(t), "three more turns of the agent's loop", func(st *harness.AgentStatus) bool {
		if st.LastLoop.After(last) {
			turns, last = turns+1, st.LastLoop
		}
		return turns >= 3
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range st.Registrations {
		if r.Resource == gpuResource {
			t.Errorf("gpu-agent still lists %s among its registrations: %+v", gpuResource, r)
		}
	}
	all, err := e.Allocatable(stepCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if got := all[gpuResource]; !slices.Equal(got, standInIDs) {
		t.Fatalf("the kubelet offers %s %v, want the other plugin's alone %v", gpuResource, got, standInIDs)
	}
}

func agentLog(t *testing.T, e *harness.Env) string {
	t.Helper()
	b, err := os.ReadFile(e.Agent().LogPath)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
