//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// The MPS daemons run in gpu-agent mps-host, a process of their own (its own DaemonSet in a cluster), and
// the agent only asks for them (--mps-host). An agent restart leaves the daemon and the pod using a replica
// as they are; an mps-host crash leaves them too, the agent offers the replicas unhealthy while mps-host is
// gone, and the next mps-host adopts the daemon.
func TestMPSHostKeepsDaemonsThroughRestarts(t *testing.T) {
	const resMPS = "nvidia.com/gpu.mps"
	// The agent is given no MPS control program: it must not need one.
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend, NodeName: nodeName,
		AgentArgs:   []string{"--mps-host", "--mps-binary=" + filepath.Join(t.TempDir(), "absent"), "--mps-shm-dir=" + t.TempDir()},
		AgentConfig: mpsConfig,
	})
	// Without mps-host no daemon runs, and the agent says so on every replica.
	if _, err := e.WaitAgentStatus(stepCtx(t), "MPS replicas unhealthy without mps-host", mpsReplicas(2*nodeGPUs, false, "mps-host not running")); err != nil {
		t.Fatal(err)
	}
	hostArgs := []string{"--mps-binary=" + mpsStandIn, "--interval=1s"}
	if err := e.StartMPSHost(stepCtx(t), hostArgs...); err != nil {
		t.Fatal(err)
	}
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
	if !logHas(t, e.MPSHost().LogPath, "started mps daemon") {
		t.Errorf("mps-host did not start the daemons (see %s)", e.MPSHost().LogPath)
	}

	// An agent restart (its upgrade): the daemon keeps its pid, the pod keeps running.
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
		t.Errorf("the daemon was restarted across the agent restart: pid %d, then %d", pid, got)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Errorf("the daemon (pid %d) is gone after the agent restart: %v", pid, err)
	}
	assertTaskRunning(t, e, id)

	// Nothing but mps-host restarts: it is killed (a crash, no last word), and the agent notices by
	// health.json going stale (3 × 1s) while the daemon and the pod run on.
	e.MPSHost().Kill()
	if _, err := e.WaitAgentStatus(stepCtx(t), "MPS replicas unhealthy with mps-host gone", mpsReplicas(2*nodeGPUs, false, "mps-host not running")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("the MPS daemon (pid %d) died with mps-host outside a container: %v", pid, err)
	}
	assertTaskRunning(t, e, id)
	if err := e.StartMPSHost(stepCtx(t), hostArgs...); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), resMPS, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if got := readPID(t, pidFile); got != pid {
		t.Errorf("the next mps-host replaced the daemon: pid %d, then %d", pid, got)
	}
	if !logHas(t, e.MPSHost().LogPath, "adopting running mps daemon") {
		t.Errorf("the next mps-host did not adopt the daemon (see %s)", e.MPSHost().LogPath)
	}
	assertTaskRunning(t, e, id)
	if got := runningContainer(t, e, "mps-client"); got != id {
		t.Fatalf("pod mps-client: container %s replaced by %s", id, got)
	}
}

// mpsReplicas is a WaitAgentStatus condition: the agent offers n MPS replicas, each healthy or not as want,
// with a reason containing reason.
func mpsReplicas(n int, want bool, reason string) func(*harness.AgentStatus) bool {
	return func(st *harness.AgentStatus) bool {
		for _, r := range st.Resources {
			if r.Name != "nvidia.com/gpu.mps" {
				continue
			}
			for _, d := range r.Devices {
				if d.Healthy != want || !strings.Contains(d.Reason, reason) {
					return false
				}
			}
			return len(r.Devices) == n
		}
		return false
	}
}

func logHas(t *testing.T, path, s string) bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), s)
}
