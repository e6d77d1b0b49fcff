//go:build e2e

// The e2e suite: a real kubelet (standalone, built from k8s.io/kubernetes) with containerd and runc starts
// static pods that request gpu-agent's resources, and each test checks what the containers really received.
// Run it with ./run.sh (make e2e), which installs and builds what it needs and sets the E2E_* variables.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

const (
	gpuResource = "nvidia.com/gpu"
	backend     = "sim:dgx-a100"
	nodeName    = "e2e-node"
	nodeGPUs    = 8 // a DGX A100
	// How long one step (a pod starting, the kubelet coming back) may take on a busy 2-core machine.
	stepTimeout = 90 * time.Second
)

// suite holds what TestMain prepared for every test.
type suite struct {
	kubelet, agent, ledger string
	images                 []string
	// containerd2 is the directory of the containerd 2.x build the CDI scenarios run on.
	containerd2 string
}

// The suite's inputs are fixed once in TestMain and only read afterwards.
var inputs suite

func TestMain(m *testing.M) {
	code, err := setup()
	if err != nil {
		// Fail loudly: an e2e run that cannot run is a failure, never a skip.
		fmt.Fprintf(os.Stderr, "e2e: cannot run: %v\n", err)
		os.Exit(2)
	}
	os.Exit(code(m))
}

func setup() (func(*testing.M) int, error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("must run as root (the kubelet and containerd need it)")
	}
	need := func(env string) (string, error) {
		v := os.Getenv(env)
		if v == "" {
			return "", fmt.Errorf("%s is not set; run ./run.sh (make e2e)", env)
		}
		if _, err := os.Stat(v); err != nil {
			return "", fmt.Errorf("%s: %w", env, err)
		}
		return v, nil
	}
	var err error
	var pause, busybox string
	for _, v := range []struct {
		dst *string
		env string
	}{{&inputs.kubelet, "E2E_KUBELET"}, {&inputs.agent, "E2E_GPU_AGENT"}, {&pause, "E2E_PAUSE"}, {&busybox, "E2E_BUSYBOX"},
		{&inputs.containerd2, "E2E_CONTAINERD2"}} {
		if *v.dst, err = need(v.env); err != nil {
			return nil, err
		}
	}
	for _, bin := range []string{"containerd", "ctr", "runc", "containerd-shim-runc-v2"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("%s not installed (apt-get install containerd runc): %w", bin, err)
		}
	}
	cache := os.Getenv("E2E_CACHE")
	if cache == "" {
		return nil, fmt.Errorf("E2E_CACHE is not set; run ./run.sh (make e2e)")
	}
	inputs.ledger = filepath.Join(cache, "ledger.json")
	return func(m *testing.M) int {
		// One suite per machine: the kubelet's device plugin directory is global.
		lock, err := harness.Lock(filepath.Join(cache, "e2e.lock"))
		if err != nil {
			fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
			return 2
		}
		defer lock.Close()
		// Rebuilt each run (it takes well under a second) in a fixed place, so a killed run leaves nothing.
		dir := filepath.Join(cache, "images")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
			return 2
		}
		if inputs.images, err = harness.BuildImages(dir, pause, busybox); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
			return 2
		}
		return m.Run()
	}, nil
}

func start(t *testing.T, agentConfig string) *harness.Env {
	t.Helper()
	e := harness.Start(t, harness.Config{
		Kubelet:     inputs.kubelet,
		Agent:       inputs.agent,
		Images:      inputs.images,
		Backend:     backend,
		NodeName:    nodeName,
		LedgerPath:  inputs.ledger,
		AgentConfig: agentConfig,
	})
	t.Logf("e2e env in %s", e.RunDir())
	return e
}

func stepCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), stepTimeout)
	t.Cleanup(cancel)
	return ctx
}

var gpuUUID = regexp.MustCompile(`^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

// nodeUUIDs asks the gpu-agent binary for the simulated node's inventory, a source independent of the
// kubelet, and returns its GPU UUIDs sorted.
func nodeUUIDs(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command(inputs.agent, "inventory", "--backend", backend, "-o", "json").Output()
	if err != nil {
		t.Fatalf("gpu-agent inventory: %v", err)
	}
	var doc any
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("gpu-agent inventory: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for _, x := range v {
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		case string:
			if gpuUUID.MatchString(v) {
				seen[v] = true
			}
		}
	}
	walk(doc)
	var uuids []string
	for u := range seen {
		uuids = append(uuids, u)
	}
	slices.Sort(uuids)
	if len(uuids) != nodeGPUs {
		t.Fatalf("gpu-agent inventory of %s lists %d GPU UUIDs, want %d: %v", backend, len(uuids), nodeGPUs, uuids)
	}
	return uuids
}

// visibleDevices runs the pod and returns the sorted IDs in its container's NVIDIA_VISIBLE_DEVICES, after
// checking that pod-resources List reports the same devices for it.
func visibleDevices(t *testing.T, e *harness.Env, name string) []string {
	t.Helper()
	ctx := stepCtx(t)
	if _, err := e.WaitRunning(ctx, name); err != nil {
		t.Fatal(err)
	}
	env, err := e.ContainerEnv(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	v, ok := env["NVIDIA_VISIBLE_DEVICES"]
	if !ok {
		t.Fatalf("pod %s: container has no NVIDIA_VISIBLE_DEVICES; env: %v", name, env)
	}
	got := strings.Split(v, ",")
	slices.Sort(got)
	listed, err := e.PodDevices(ctx, name, gpuResource)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, listed) {
		t.Fatalf("pod %s: container got NVIDIA_VISIBLE_DEVICES=%v, pod-resources List says %v", name, got, listed)
	}
	t.Logf("pod %s: container got NVIDIA_VISIBLE_DEVICES=%s", name, v)
	return got
}

func addPod(t *testing.T, e *harness.Env, name string, gpus int64) {
	t.Helper()
	if err := e.AddPod(harness.PodSpec{Name: name, Limits: map[string]int64{gpuResource: gpus}}); err != nil {
		t.Fatal(err)
	}
}

func waitAllocatable(t *testing.T, e *harness.Env, n int) []string {
	t.Helper()
	ids, err := e.WaitAllocatable(stepCtx(t), gpuResource, n)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func subset(sub, of []string) bool {
	for _, s := range sub {
		if !slices.Contains(of, s) {
			return false
		}
	}
	return true
}

func overlap(a, b []string) []string {
	var out []string
	for _, s := range a {
		if slices.Contains(b, s) {
			out = append(out, s)
		}
	}
	return out
}

// runningContainer returns the pod's container ID and checks that containerd runs it.
func runningContainer(t *testing.T, e *harness.Env, name string) string {
	t.Helper()
	ctx := stepCtx(t)
	p, err := e.WaitRunning(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	id, err := harness.ContainerID(p)
	if err != nil {
		t.Fatal(err)
	}
	if n := p.Status.ContainerStatuses[0].RestartCount; n != 0 {
		t.Fatalf("pod %s: container restarted %d times", name, n)
	}
	assertTaskRunning(t, e, id)
	return id
}

func assertTaskRunning(t *testing.T, e *harness.Env, id string) {
	t.Helper()
	tasks, err := e.RunningTasks(stepCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if !tasks[id] {
		t.Fatalf("containerd does not run container %s (running: %v)", id, tasks)
	}
}

// Scenario 1: one GPU, and the container sees exactly the UUID the kubelet says it allocated.
func TestOneGPU(t *testing.T) {
	uuids := nodeUUIDs(t)
	e := start(t, "")
	// The standalone scenarios run on Debian's containerd 1.6 (no CDI); the CDI ones on a 2.x. Each Env
	// logs its containerd's version; this one and TestCDIWithContainerd2 check theirs.
	if v, err := e.ContainerdVersion(stepCtx(t)); err != nil || !strings.HasPrefix(v, "1.6") {
		t.Fatalf("containerd %q (%v), want Debian's 1.6", v, err)
	}
	if got := waitAllocatable(t, e, nodeGPUs); !slices.Equal(got, uuids) {
		t.Fatalf("kubelet offers %v, the node has %v", got, uuids)
	}
	addPod(t, e, "one-gpu", 1)
	got := visibleDevices(t, e, "one-gpu")
	if len(got) != 1 || !slices.Contains(uuids, got[0]) {
		t.Fatalf("container got NVIDIA_VISIBLE_DEVICES=%v, want one UUID of %v", got, uuids)
	}
}

// Scenario 2: exhaustion is refused at admission, and freed devices are handed out again.
func TestExhaustionAndReuse(t *testing.T) {
	uuids := nodeUUIDs(t)
	e := start(t, "")
	waitAllocatable(t, e, nodeGPUs)

	addPod(t, e, "four-a", 4)
	addPod(t, e, "four-b", 4)
	a := visibleDevices(t, e, "four-a")
	b := visibleDevices(t, e, "four-b")
	for name, ids := range map[string][]string{"four-a": a, "four-b": b} {
		if len(ids) != 4 || !subset(ids, uuids) {
			t.Fatalf("pod %s got %v, want 4 UUIDs of %v", name, ids, uuids)
		}
	}
	if both := overlap(a, b); len(both) > 0 {
		t.Fatalf("pods four-a %v and four-b %v share %v", a, b, both)
	}

	addPod(t, e, "one-too-many", 1)
	p, err := e.WaitPod(stepCtx(t), "one-too-many", "rejected", func(p *corev1.Pod) bool {
		return p != nil && p.Status.Phase == corev1.PodFailed
	})
	if err != nil {
		t.Fatal(err)
	}
	// A static pod skips the scheduler, so it is the kubelet's device manager that refuses it at admission
	// (Allocate cannot find a free device); kubelet v1.36.3 says:
	//   reason UnexpectedAdmissionError, message "Allocate failed due to requested number of devices
	//   unavailable for nvidia.com/gpu. Requested: 1, Available: 0, which is unexpected"
	if p.Status.Reason != "UnexpectedAdmissionError" ||
		!strings.Contains(p.Status.Message, "requested number of devices unavailable for "+gpuResource+". Requested: 1, Available: 0") {
		t.Fatalf("pod one-too-many: %s; want reason UnexpectedAdmissionError, 1 requested and 0 available %s", harness.DescribePod(p), gpuResource)
	}
	t.Logf("pod one-too-many rejected: %s", harness.DescribePod(p))
	if len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].State.Running != nil {
		t.Fatalf("pod one-too-many: rejected, yet its container runs: %s", harness.DescribePod(p))
	}

	if err := e.DeletePod("four-a"); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitGone(stepCtx(t), "four-a"); err != nil {
		t.Fatal(err)
	}
	// The kubelet does not retry a rejected static pod, so a new pod tests the freed devices.
	addPod(t, e, "after-free", 1)
	got := visibleDevices(t, e, "after-free")
	if len(got) != 1 || !slices.Contains(a, got[0]) {
		t.Fatalf("pod after-free got %v, want one of four-a's freed %v", got, a)
	}
}

// Scenario 3: a kubelet restart wipes the plugin directory; gpu-agent must serve and register again, and the
// running pod must keep its container and its devices.
func TestKubeletRestart(t *testing.T) {
	e := start(t, "")
	waitAllocatable(t, e, nodeGPUs)
	addPod(t, e, "before", 1)
	before := visibleDevices(t, e, "before")
	id := runningContainer(t, e, "before")
	agentPID := e.Agent().PID()

	if err := e.StopKubelet(); err != nil {
		t.Fatal(err)
	}
	assertTaskRunning(t, e, id)
	restarted := time.Now()
	if err := e.StartKubelet(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	// After a restart the kubelet offers nothing until a plugin registers and reports its devices, so
	// seeing all of them again means gpu-agent re-registered.
	waitAllocatable(t, e, nodeGPUs)
	if done, err := e.Agent().Exited(); done || e.Agent().PID() != agentPID {
		t.Fatalf("gpu-agent did not survive the kubelet restart (exited=%v: %v)", done, err)
	}
	if _, err := e.WaitAgentStatus(stepCtx(t), "re-registered", func(st *harness.AgentStatus) bool {
		return st.RegisteredSince(gpuResource, restarted)
	}); err != nil {
		t.Fatal(err)
	}

	if got := runningContainer(t, e, "before"); got != id {
		t.Fatalf("pod before: container %s replaced by %s across the kubelet restart", id, got)
	}
	if got, err := e.PodDevices(stepCtx(t), "before", gpuResource); err != nil || !slices.Equal(got, before) {
		t.Fatalf("pod before: pod-resources lists %v (err %v) after the restart, want %v", got, err, before)
	}

	addPod(t, e, "after", 1)
	after := visibleDevices(t, e, "after")
	if len(after) != 1 || len(overlap(after, before)) > 0 {
		t.Fatalf("pod after got %v; want one GPU other than before's %v", after, before)
	}
}

// Scenario 4: a gpu-agent restart leaves running pods alone and brings back the same devices.
func TestAgentRestart(t *testing.T) {
	e := start(t, "")
	offered := waitAllocatable(t, e, nodeGPUs)
	addPod(t, e, "running", 2)
	devs := visibleDevices(t, e, "running")
	id := runningContainer(t, e, "running")

	if err := e.StopAgent(); err != nil {
		t.Fatal(err)
	}
	// The kubelet marks a plugin's devices unhealthy when its ListAndWatch stream ends; waiting for that
	// proves the restart below is what brings them back.
	waitAllocatable(t, e, 0)
	assertTaskRunning(t, e, id)

	if err := e.StartAgent(stepCtx(t)); err != nil {
		t.Fatal(err)
	}
	if again := waitAllocatable(t, e, nodeGPUs); !slices.Equal(again, offered) {
		t.Fatalf("device IDs changed across the gpu-agent restart: %v, then %v", offered, again)
	}
	if got := runningContainer(t, e, "running"); got != id {
		t.Fatalf("pod running: container %s replaced by %s", id, got)
	}
	if got, err := e.PodDevices(stepCtx(t), "running", gpuResource); err != nil || !slices.Equal(got, devs) {
		t.Fatalf("pod running: pod-resources lists %v (err %v), want %v", got, err, devs)
	}

	addPod(t, e, "new", 1)
	got := visibleDevices(t, e, "new")
	if len(got) != 1 || len(overlap(got, devs)) > 0 {
		t.Fatalf("pod new got %v; want one GPU other than running's %v", got, devs)
	}
}

const plainConfig = `version: v1
configs:
  default:
    devicePlugin:
      passDeviceSpecs: false
`

const timeSlicedConfig = `version: v1
configs:
  default:
    devicePlugin:
      passDeviceSpecs: false
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
`

// Scenario 6: editing the mounted ConfigMap (the kubelet swaps the ..data symlink) changes what the kubelet
// is offered, with no gpu-agent restart.
func TestConfigSwap(t *testing.T) {
	uuids := nodeUUIDs(t)
	e := start(t, plainConfig)
	waitAllocatable(t, e, nodeGPUs)
	agentPID := e.Agent().PID()

	gen := loadedConfig(t, e, 0)
	if err := e.UpdateAgentConfig(timeSlicedConfig); err != nil {
		t.Fatal(err)
	}
	gen = loadedConfig(t, e, gen)
	replicas := waitAllocatable(t, e, 2*nodeGPUs)
	perGPU := map[string]int{}
	for _, id := range replicas {
		uuid, _, ok := strings.Cut(id, "::")
		if !ok || !slices.Contains(uuids, uuid) {
			t.Fatalf("replica ID %q is not <GPU UUID>::<n> of this node", id)
		}
		perGPU[uuid]++
	}
	for _, u := range uuids {
		if perGPU[u] != 2 {
			t.Fatalf("GPU %s has %d replicas, want 2 (all: %v)", u, perGPU[u], replicas)
		}
	}

	// A container of a time-sliced GPU sees the GPU itself: the replica suffix is the kubelet's business.
	addPod(t, e, "shared", 1)
	ctx := stepCtx(t)
	if _, err := e.WaitRunning(ctx, "shared"); err != nil {
		t.Fatal(err)
	}
	env, err := e.ContainerEnv(ctx, "shared")
	if err != nil {
		t.Fatal(err)
	}
	listed, err := e.PodDevices(ctx, "shared", gpuResource)
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != 1 || !strings.HasPrefix(listed[0], env["NVIDIA_VISIBLE_DEVICES"]+"::") {
		t.Fatalf("pod shared: pod-resources lists %v, container got NVIDIA_VISIBLE_DEVICES=%q", listed, env["NVIDIA_VISIBLE_DEVICES"])
	}

	if err := e.UpdateAgentConfig(plainConfig); err != nil {
		t.Fatal(err)
	}
	loadedConfig(t, e, gen)
	if back := waitAllocatable(t, e, nodeGPUs); !slices.Equal(back, uuids) {
		t.Fatalf("after the config swap back the kubelet offers %v, want %v", back, uuids)
	}
	if done, err := e.Agent().Exited(); done || e.Agent().PID() != agentPID {
		t.Fatalf("gpu-agent restarted or exited during config swaps (exited=%v: %v)", done, err)
	}
}

// loadedConfig waits until gpu-agent reports a config generation newer than after, without an error, and
// returns it; a test that then waits for the kubelet knows the agent did read the file.
func loadedConfig(t *testing.T, e *harness.Env, after int) int {
	t.Helper()
	st, err := e.WaitAgentStatus(stepCtx(t), fmt.Sprintf("a config newer than generation %d", after), func(st *harness.AgentStatus) bool {
		return st.Config.Generation > after && st.Config.Error == ""
	})
	if err != nil {
		t.Fatal(err)
	}
	return st.Config.Generation
}

// An invalid edit of the ConfigMap is reported and ignored: the kubelet keeps being offered the last good
// config's devices, and pods keep being admitted.
func TestInvalidConfigKeepsLastGood(t *testing.T) {
	e := start(t, plainConfig)
	offered := waitAllocatable(t, e, nodeGPUs)
	agentPID := e.Agent().PID()
	gen := loadedConfig(t, e, 0)

	if err := e.UpdateAgentConfig("version: v1\nconfigs:\n  default:\n    devicePlugin:\n      noSuchField: true\n"); err != nil {
		t.Fatal(err)
	}
	st, err := e.WaitAgentStatus(stepCtx(t), "reporting the config error", func(st *harness.AgentStatus) bool {
		return st.Config.Error != ""
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(st.Config.Error, "noSuchField") {
		t.Errorf("config error %q does not name the bad field noSuchField", st.Config.Error)
	}
	if st.Config.Generation != gen {
		t.Errorf("config generation moved from %d to %d on an invalid edit", gen, st.Config.Generation)
	}
	if got, err := e.Allocatable(stepCtx(t)); err != nil || !slices.Equal(got[gpuResource], offered) {
		t.Fatalf("after an invalid edit the kubelet is offered %v (err %v), want the last good %v", got, err, offered)
	}
	addPod(t, e, "still-admitted", 1)
	if got := visibleDevices(t, e, "still-admitted"); len(got) != 1 || !slices.Contains(offered, got[0]) {
		t.Fatalf("pod still-admitted got %v, want one of %v", got, offered)
	}

	// A fixed file clears the error; the comment makes it differ from the first good content.
	if err := e.UpdateAgentConfig(plainConfig + "# fixed\n"); err != nil {
		t.Fatal(err)
	}
	loadedConfig(t, e, gen)
	if done, err := e.Agent().Exited(); done || e.Agent().PID() != agentPID {
		t.Fatalf("gpu-agent restarted or exited on config edits (exited=%v: %v)", done, err)
	}
}

// healthConfig probes often, so that a reset is noticed within the test.
const healthConfig = `version: v1
configs:
  default:
    health:
      probeInterval: 200ms
`

// gpuUUIDAt returns the UUID of the simulated node's GPU with NVML index idx.
func gpuUUIDAt(t *testing.T, idx int) string {
	t.Helper()
	out, err := exec.Command(inputs.agent, "inventory", "--backend", backend, "-o", "json").Output()
	if err != nil {
		t.Fatalf("gpu-agent inventory: %v", err)
	}
	var inv struct {
		GPUs []struct {
			Index int    `json:"index"`
			UUID  string `json:"uuid"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(out, &inv); err != nil {
		t.Fatal(err)
	}
	for _, g := range inv.GPUs {
		if g.Index == idx {
			return g.UUID
		}
	}
	t.Fatalf("no GPU %d in the inventory", idx)
	return ""
}

// simPost injects a fault through the agent's /sim endpoints.
func simPost(t *testing.T, e *harness.Env, path, body string) {
	t.Helper()
	out, err := exec.Command("curl", "-sS", "-f", "-XPOST", "http://"+e.AgentAddr()+path, "-d", body).CombinedOutput()
	if err != nil {
		t.Fatalf("POST %s %s: %v: %s", path, body, err, out)
	}
}

// A fatal XID on a free GPU takes it out of what the kubelet can allocate within 2 s; a pod asking for every
// GPU is then refused; after a GPU reset the device comes back, without restarting anything.
func TestFatalXIDAndRecovery(t *testing.T) {
	bad := gpuUUIDAt(t, 3)
	e := start(t, healthConfig)
	waitAllocatable(t, e, nodeGPUs)
	agentPID := e.Agent().PID()
	// Events that happen before the agent registered for them are not delivered (as with real NVML).
	if _, err := e.WaitAgentStatus(stepCtx(t), "health events registered on every GPU", func(st *harness.AgentStatus) bool {
		return len(st.HealthEvents) == nodeGPUs
	}); err != nil {
		t.Fatal(err)
	}

	injected := time.Now()
	simPost(t, e, "/sim/xid", `{"gpu":3,"xid":48}`)
	ctx := stepCtx(t)
	var left []string
	for {
		all, err := e.Allocatable(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if left = all[gpuResource]; len(left) == nodeGPUs-1 {
			break
		}
		if time.Since(injected) > 2*time.Second {
			t.Fatalf("2 s after XID 48 on GPU 3 the kubelet still offers %d GPUs: %v", len(left), left)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if slices.Contains(left, bad) {
		t.Fatalf("the kubelet still offers GPU 3 (%s) after its fatal XID: %v", bad, left)
	}
	t.Logf("GPU 3 left the allocatable set %v after the XID", time.Since(injected).Round(time.Millisecond))
	st, err := e.AgentStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.HealthCauses) != 1 || st.HealthCauses[0].GPU != bad || !strings.Contains(st.HealthCauses[0].Reason, "XID 48") {
		t.Errorf("/status health causes %+v, want one naming XID 48 on %s", st.HealthCauses, bad)
	}

	addPod(t, e, "all-eight", nodeGPUs)
	p, err := e.WaitPod(stepCtx(t), "all-eight", "rejected", func(p *corev1.Pod) bool {
		return p != nil && p.Status.Phase == corev1.PodFailed
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.Reason != "UnexpectedAdmissionError" ||
		!strings.Contains(p.Status.Message, fmt.Sprintf("Requested: %d, Available: %d", nodeGPUs, nodeGPUs-1)) {
		t.Fatalf("pod all-eight: %s; want UnexpectedAdmissionError with %d requested and %d available", harness.DescribePod(p), nodeGPUs, nodeGPUs-1)
	}

	simPost(t, e, "/sim/reset", `{"gpu":3}`)
	back := waitAllocatable(t, e, nodeGPUs)
	if !slices.Contains(back, bad) {
		t.Fatalf("after the reset the kubelet offers %v, without GPU 3 (%s)", back, bad)
	}
	if done, err := e.Agent().Exited(); done || e.Agent().PID() != agentPID {
		t.Fatalf("gpu-agent restarted or exited (exited=%v: %v)", done, err)
	}
}

// packedSharedConfig time-slices every GPU into replicas and packs pods onto as few GPUs as possible.
func packedSharedConfig(replicas int) string {
	return fmt.Sprintf(`version: v1
configs:
  default:
    allocation:
      policy: packed
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: %d
`, replicas)
}

// Two pods on replicas of one GPU (the packed policy puts the second next to the first) both see that GPU's
// UUID; a replica count edit reaches the kubelet live while they run.
func TestTimeSlicedReplicas(t *testing.T) {
	uuids := nodeUUIDs(t)
	e := start(t, packedSharedConfig(2))
	waitAllocatable(t, e, 2*nodeGPUs)
	agentPID := e.Agent().PID()

	addPod(t, e, "slice-a", 1)
	a := visibleDevicesOf(t, e, "slice-a")
	addPod(t, e, "slice-b", 1)
	b := visibleDevicesOf(t, e, "slice-b")
	if a.visible != b.visible || !slices.Contains(uuids, a.visible) {
		t.Fatalf("slice-a sees %q, slice-b sees %q: want both the same GPU of this node (packed)", a.visible, b.visible)
	}
	if a.id == b.id || !strings.HasPrefix(a.id, a.visible+"::") || !strings.HasPrefix(b.id, b.visible+"::") {
		t.Fatalf("slice-a holds %q, slice-b holds %q: want two distinct replicas of %s", a.id, b.id, a.visible)
	}

	gen := loadedConfig(t, e, 0)
	if err := e.UpdateAgentConfig(packedSharedConfig(3)); err != nil {
		t.Fatal(err)
	}
	loadedConfig(t, e, gen)
	// 24 replicas, of which the kubelet counts those the running pods hold as allocatable too.
	ids := waitAllocatable(t, e, 3*nodeGPUs)
	for _, held := range []string{a.id, b.id} {
		if !slices.Contains(ids, held) {
			t.Errorf("replica %s held by a running pod is gone after the edit: %v", held, ids)
		}
	}
	for _, pod := range []string{"slice-a", "slice-b"} {
		if p, err := e.Pod(stepCtx(t), pod); err != nil || p.Status.Phase != corev1.PodRunning {
			t.Fatalf("pod %s after the edit: %v %v", pod, err, harness.DescribePod(p))
		}
	}
	if done, err := e.Agent().Exited(); done || e.Agent().PID() != agentPID {
		t.Fatalf("gpu-agent restarted or exited (exited=%v: %v)", done, err)
	}
}

type podDevice struct{ id, visible string }

// visibleDevicesOf runs a one-replica pod and returns the replica ID the kubelet gave it and the
// NVIDIA_VISIBLE_DEVICES its container saw.
func visibleDevicesOf(t *testing.T, e *harness.Env, name string) podDevice {
	t.Helper()
	ctx := stepCtx(t)
	if _, err := e.WaitRunning(ctx, name); err != nil {
		t.Fatal(err)
	}
	env, err := e.ContainerEnv(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	listed, err := e.PodDevices(ctx, name, gpuResource)
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != 1 {
		t.Fatalf("pod %s holds %v, want one replica", name, listed)
	}
	t.Logf("pod %s: holds %s, container got NVIDIA_VISIBLE_DEVICES=%s", name, listed[0], env["NVIDIA_VISIBLE_DEVICES"])
	return podDevice{id: listed[0], visible: env["NVIDIA_VISIBLE_DEVICES"]}
}

func migLayoutConfig(counts string) string {
	return `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: ` + counts + "\n"
}

// A mixed MIG layout is applied and served: a pod gets a MIG device. A live layout edit while the pod holds an
// instance changes every other GPU, keeps the held instance (its GPU waits, naming the pod), and that GPU
// finishes by itself once the pod is gone.
func TestMIGLayoutLive(t *testing.T) {
	const res3g, res1g = "nvidia.com/mig-3g.20gb", "nvidia.com/mig-1g.5gb"
	// Pass the resync sooner than the default 30 s, so the release is noticed within the test.
	t.Setenv("GPU_AGENT_RESYNC", "2s")
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend + ",mig-enabled", NodeName: nodeName, AgentConfig: migLayoutConfig(`{"3g.20gb": 2}`),
	})
	ctx := stepCtx(t)
	if _, err := e.WaitAllocatable(ctx, res3g, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if err := e.AddPod(harness.PodSpec{Name: "mig-user", Limits: map[string]int64{res3g: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitRunning(ctx, "mig-user"); err != nil {
		t.Fatal(err)
	}
	env, err := e.ContainerEnv(ctx, "mig-user")
	if err != nil {
		t.Fatal(err)
	}
	held, err := e.PodDevices(ctx, "mig-user", res3g)
	if err != nil {
		t.Fatal(err)
	}
	if len(held) != 1 || !strings.HasPrefix(held[0], "MIG-") || env["NVIDIA_VISIBLE_DEVICES"] != held[0] {
		t.Fatalf("pod mig-user holds %v, container got NVIDIA_VISIBLE_DEVICES=%q: want one MIG UUID, the same", held, env["NVIDIA_VISIBLE_DEVICES"])
	}

	if err := e.UpdateAgentConfig(migLayoutConfig(`{"1g.5gb": 7}`)); err != nil {
		t.Fatal(err)
	}
	// Seven GPUs change; the held instance's GPU keeps its 3g instances, and drains the one nobody holds: it
	// is no longer offered, so no new pod keeps the layout from applying.
	if _, err := e.WaitAllocatable(stepCtx(t), res1g, 7*(nodeGPUs-1)); err != nil {
		t.Fatal(err)
	}
	left, err := e.WaitAllocatable(stepCtx(t), res3g, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(left, held[0]) {
		t.Fatalf("the held instance %s is gone: %s offers %v", held[0], res3g, left)
	}
	st, err := e.WaitAgentStatus(stepCtx(t), "one GPU pending on the pod", func(st *harness.AgentStatus) bool {
		for _, m := range st.MIG {
			if m.Phase == "pending" && strings.Contains(m.Reason, "mig-user") {
				return true
			}
		}
		return false
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("MIG states while held: %+v", st.MIG)

	if err := e.DeletePod("mig-user"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), res1g, 7*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(stepCtx(t), res3g, 0); err != nil {
		t.Fatal(err)
	}
}

// mountedSomewhere reports whether some process on the machine (a container) has path mounted at
// containerPath: device plugin mounts do not show in the pod's status, so look at the mount tables.
func mountedSomewhere(containerPath string) bool {
	tables, _ := filepath.Glob("/proc/[0-9]*/mountinfo")
	for _, f := range tables {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if fields := strings.Fields(line); len(fields) > 4 && fields[4] == containerPath {
				return true
			}
		}
	}
	return false
}

// mpsStandIn is the --mps-binary that names gpu-agent's own stand-in MPS control program (`gpu-agent
// mps-control-sim`, package mps/simdaemon): it speaks the real one's protocol, which needs a GPU.
const mpsStandIn = "mps-control-sim"

// MPS: the agent runs a control daemon per shared GPU (a stand-in program speaking its protocol), and a
// pod on an MPS replica gets the pipe directory and its per-client limits.
func TestMPSReplicas(t *testing.T) {
	const resMPS = "nvidia.com/gpu.mps"
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend, NodeName: nodeName,
		// The DaemonSet's args name the real program; gpu-agent's own stand-in replaces it.
		AgentArgs: []string{"--mps-binary=" + mpsStandIn, "--mps-shm-dir=" + t.TempDir()},
		AgentConfig: `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          rename: nvidia.com/gpu.mps
          replicas: 2
          pinnedDeviceMemoryLimit: 10Gi
`,
	})
	// Replicas turn healthy once their daemon answers.
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
	env, err := e.ContainerEnv(ctx, "mps-client")
	if err != nil {
		t.Fatal(err)
	}
	pipe := env["CUDA_MPS_PIPE_DIRECTORY"]
	if pipe == "" || env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != "0=10240M" ||
		!strings.Contains(pipe, env["NVIDIA_VISIBLE_DEVICES"]) {
		t.Fatalf("MPS client env: pipe %q, threads %q, memory %q, visible %q", pipe,
			env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["NVIDIA_VISIBLE_DEVICES"])
	}
	if _, err := os.Stat(filepath.Join(pipe, "nvidia-cuda-mps-control.pid")); err != nil {
		t.Errorf("no MPS daemon behind the pipe directory: %v", err)
	}
	if !mountedSomewhere(pipe) {
		t.Errorf("the pipe directory %s is mounted in no container", pipe)
	}
}
