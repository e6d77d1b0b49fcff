//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// A fatal XID, then a gpu-agent restart on the same (simulated) GPUs: the GPU stays out of what the kubelet
// can allocate, because the agent checkpointed the cause and NVML still shows its trace.
func TestRestartAfterXIDKeepsGPUUnhealthy(t *testing.T) {
	bad := gpuUUIDAt(t, 3)
	e := start(t, healthConfig)
	waitAllocatable(t, e, nodeGPUs)
	if _, err := e.WaitAgentStatus(stepCtx(t), "health events registered", func(st *harness.AgentStatus) bool {
		return len(st.HealthEvents) == nodeGPUs
	}); err != nil {
		t.Fatal(err)
	}
	simPost(t, e, "/sim/xid", `{"gpu":3,"xid":48}`)
	if left := waitAllocatable(t, e, nodeGPUs-1); slices.Contains(left, bad) {
		t.Fatalf("GPU 3 still offered after XID 48: %v", left)
	}

	if err := e.StopAgent(); err != nil {
		t.Fatal(err)
	}
	waitAllocatable(t, e, 0)
	if err := e.StartAgent(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	left := waitAllocatable(t, e, nodeGPUs-1)
	if slices.Contains(left, bad) {
		t.Fatalf("after the restart the kubelet offers GPU 3 (%s) again: %v", bad, left)
	}
	st, err := e.AgentStatus(stepCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.HealthCauses) == 0 || st.HealthCauses[0].GPU != bad || !strings.Contains(st.HealthCauses[0].Reason, "XID 48") {
		t.Errorf("/status health causes after the restart %+v, want XID 48 on %s", st.HealthCauses, bad)
	}
	// It stays out for good reason only: a reset brings it back.
	simPost(t, e, "/sim/reset", `{"gpu":3}`)
	if back := waitAllocatable(t, e, nodeGPUs); !slices.Contains(back, bad) {
		t.Fatalf("after the reset: %v", back)
	}
}

// gpu-agent is killed (SIGKILL, by the simulated node itself) right after the Nth change it makes to the
// GPUs while repartitioning, and the layout is edited before it comes back. The new agent converges to the
// new layout with no GPU instance left behind without its compute instance.
func TestRestartMidRepartitionConverges(t *testing.T) {
	const res3g, res1g, res7g = "nvidia.com/mig-3g.20gb", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-7g.40gb"
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend + ",mig-enabled", NodeName: nodeName, AgentConfig: migLayoutConfig(`{"3g.20gb": 2}`),
	})
	if _, err := e.WaitAllocatable(stepCtx(t), res3g, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	// 3g×2 → 1g×7 is 2 destroys (each a compute then a GPU instance) and 7 creates (each a GPU then a
	// compute instance) per GPU; die in the middle of the third GPU's destroys.
	if err := e.StopAgent(); err != nil {
		t.Fatal(err)
	}
	if err := e.UpdateAgentConfig(migLayoutConfig(`{"1g.5gb": 7}`)); err != nil {
		t.Fatal(err)
	}
	e.SetBackendOptions(",crash-after=" + strconv.Itoa(2*(4+14)+3))
	if err := e.StartAgentExpectingCrash(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	e.SetBackendOptions("")
	if err := e.UpdateAgentConfig(migLayoutConfig(`{"7g.40gb": 1}`)); err != nil {
		t.Fatal(err)
	}
	if err := e.StartAgent(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), res7g, nodeGPUs); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitAgentStatus(stepCtx(t), "every GPU applied", func(st *harness.AgentStatus) bool {
		for _, m := range st.MIG {
			if m.Phase != "applied" {
				return false
			}
		}
		return len(st.MIG) == nodeGPUs
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range st.GPUs {
		if len(g.GIsWithoutCI) > 0 || len(g.Instances) != 1 || g.Instances[0].Profile != "7g.40gb" {
			t.Errorf("GPU %d after recovery: instances %+v, GPU instances without a compute instance %+v", g.Index, g.Instances, g.GIsWithoutCI)
		}
	}
	for _, res := range []string{res1g, res3g} {
		if _, err := e.WaitAllocatable(stepCtx(t), res, 0); err != nil {
			t.Fatal(err)
		}
	}
}

// With the kubelet's pod-resources API unreachable, a layout edit destroys nothing: the instance a pod
// holds, and every other one, stays; the GPUs wait, saying why.
func TestPodResourcesUnreachableDestroysNothing(t *testing.T) {
	const res3g = "nvidia.com/mig-3g.20gb"
	t.Setenv("GPU_AGENT_RESYNC", "2s")
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend + ",mig-enabled", NodeName: nodeName, AgentConfig: migLayoutConfig(`{"3g.20gb": 2}`),
		AgentArgs: []string{"--pod-resources-socket=" + filepath.Join(t.TempDir(), "missing", "kubelet.sock")},
	})
	ctx := stepCtx(t)
	before, err := e.WaitAllocatable(ctx, res3g, 2*nodeGPUs)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.AddPod(harness.PodSpec{Name: "mig-user", Limits: map[string]int64{res3g: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitRunning(ctx, "mig-user"); err != nil {
		t.Fatal(err)
	}
	id := runningContainer(t, e, "mig-user")
	if err := e.UpdateAgentConfig(migLayoutConfig(`{"1g.5gb": 7}`)); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitAgentStatus(stepCtx(t), "every GPU waiting for pod-resources", func(st *harness.AgentStatus) bool {
		n := 0
		for _, m := range st.MIG {
			if m.Phase == "pending" && (strings.Contains(m.Reason, "pod-resources") || strings.Contains(m.Reason, "not yet listed")) {
				n++
			}
		}
		return n == nodeGPUs && st.Config.Generation == 2
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("MIG states: %+v", st.MIG)
	// Three turns of the loop later (resyncs, every 2 s) nothing has changed.
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
	var left []string
	for _, g := range st.GPUs {
		for _, m := range g.Instances {
			if m.Profile == "3g.20gb" {
				left = append(left, m.UUID)
			}
		}
	}
	slices.Sort(left)
	if !slices.Equal(left, before) {
		t.Fatalf("instances destroyed without the kubelet's word: %d of %d 3g.20gb left", len(left), len(before))
	}
	// The layout waits on the holder's GPU, so both instances there are
	// drained: the other one, and the held one too, since pod-resources
	// never lists it (an allocation not yet listed is drained, as the
	// kubelet may hand it out again once its container ends). Every other
	// GPU keeps offering its two.
	after, err := e.Allocatable(stepCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(after[res3g]) != len(before)-2 {
		t.Errorf("offered %d 3g.20gb, want %d (the two of the held instance's GPU drained): %v", len(after[res3g]), len(before)-2, after[res3g])
	}
	assertTaskRunning(t, e, id)
}

// MPS daemons outlive a gpu-agent restart (an upgrade): the pod using a replica keeps running, the daemon
// keeps its pid, and the new agent adopts it and serves the replicas healthy.
func TestMPSDaemonsSurviveAgentRestart(t *testing.T) {
	const resMPS = "nvidia.com/gpu.mps"
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend, NodeName: nodeName,
		AgentArgs:   []string{"--mps-binary=" + mpsStandIn, "--mps-shm-dir=" + t.TempDir()},
		AgentConfig: mpsConfig,
	})
	if _, err := e.WaitAllocatable(stepCtx(t), resMPS, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if err := e.AddPod(harness.PodSpec{Name: "mps-client", Limits: map[string]int64{resMPS: 1}}); err != nil {
		t.Fatal(err)
	}
	ctx := stepCtx(t)
	if _, err := e.WaitRunning(ctx, "mps-client"); err != nil {
		t.Fatal(err)
	}
	id := runningContainer(t, e, "mps-client")
	env, err := e.ContainerEnv(ctx, "mps-client")
	if err != nil {
		t.Fatal(err)
	}
	pidFile := filepath.Join(env["CUDA_MPS_PIPE_DIRECTORY"], "nvidia-cuda-mps-control.pid")
	pid := readPID(t, pidFile)

	if err := e.StopAgent(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("the MPS daemon (pid %d) died with the agent: %v", pid, err)
	}
	if err := e.StartAgent(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), resMPS, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if got := readPID(t, pidFile); got != pid {
		t.Errorf("the daemon was restarted: pid %d, then %d", pid, got)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Errorf("the adopted daemon (pid %d) is gone: %v", pid, err)
	}
	assertTaskRunning(t, e, id)
	if got := runningContainer(t, e, "mps-client"); got != id {
		t.Fatalf("pod mps-client: container %s replaced by %s", id, got)
	}
}

const mpsConfig = `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          rename: nvidia.com/gpu.mps
          replicas: 2
          pinnedDeviceMemoryLimit: 10Gi
`

func readPID(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return pid
}
