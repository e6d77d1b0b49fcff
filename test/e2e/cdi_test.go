//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// cdiSpecNodes reads the agent's CDI spec in e's spec directory and returns the container paths of the device
// nodes a container given CDI device name gets: the device's own and the spec's common ones.
func cdiSpecNodes(t *testing.T, e *harness.Env, name string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.CDISpecDir(), "gpu-agent.json"))
	if err != nil {
		t.Fatalf("the agent's CDI spec: %v", err)
	}
	type edits struct {
		DeviceNodes []struct {
			Path string `json:"path"`
		} `json:"deviceNodes"`
	}
	var spec struct {
		Kind    string `json:"kind"`
		Devices []struct {
			Name           string `json:"name"`
			ContainerEdits edits  `json:"containerEdits"`
		} `json:"devices"`
		ContainerEdits edits `json:"containerEdits"`
	}
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatalf("the agent's CDI spec: %v", err)
	}
	if spec.Kind != "nvidia.com/gpu" {
		t.Fatalf("the agent's CDI spec is of kind %q, want NVIDIA's nvidia.com/gpu", spec.Kind)
	}
	var out []string
	for _, n := range spec.ContainerEdits.DeviceNodes {
		out = append(out, n.Path)
	}
	for _, d := range spec.Devices {
		if d.Name == name {
			for _, n := range d.ContainerEdits.DeviceNodes {
				out = append(out, n.Path)
			}
			slices.Sort(out)
			return out
		}
	}
	t.Fatalf("the agent's CDI spec has no device %q", name)
	return nil
}

// gpuDevices returns the sorted GPU device nodes of an E2E_DEVICES listing, without the nvidia-caps directory.
func gpuDevices(listing string) []string {
	var got []string
	for _, f := range strings.Fields(listing) {
		if f != "/dev/nvidia-caps" { // the directory itself
			got = append(got, f)
		}
	}
	slices.Sort(got)
	return got
}

// containerDevices runs pod name and returns the GPU device nodes its container has, sorted, after checking
// that it was told of them through CDI alone (no NVIDIA_VISIBLE_DEVICES).
func containerDevices(t *testing.T, e *harness.Env, name string) []string {
	t.Helper()
	ctx := stepCtx(t)
	if _, err := e.WaitRunning(ctx, name); err != nil {
		t.Fatal(err)
	}
	env, err := e.ContainerEnv(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := env["NVIDIA_VISIBLE_DEVICES"]; ok {
		t.Errorf("pod %s: NVIDIA_VISIBLE_DEVICES=%s with a CDI-only device list strategy", name, v)
	}
	return gpuDevices(env["E2E_DEVICES"])
}

// CDI through a CDI-enabled containerd (2.x, built from its Go module): the agent writes the node's CDI spec,
// the device plugin names the devices by CDI (cdi-cri, then cdi-annotations after a live config change), and
// each container gets exactly its MIG device's nodes (the parent GPU and its two nvidia-caps access nodes)
// plus the control nodes, and no other GPU.
func TestCDIWithContainerd2(t *testing.T) {
	const res3g = "nvidia.com/mig-3g.20gb"
	layout := migLayoutConfig(`{"3g.20gb": 2}`)
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: backend + ",mig-enabled", NodeName: nodeName, Containerd2: inputs.containerd2,
		AgentConfig: layout + "    devicePlugin:\n      deviceListStrategy: cdi-cri\n",
	})
	ctx := stepCtx(t)
	if v, err := e.ContainerdVersion(ctx); err != nil || !strings.HasPrefix(v, "2.") {
		t.Fatalf("containerd %q (%v), want a 2.x with CDI", v, err)
	}
	if _, err := e.WaitAllocatable(ctx, res3g, 2*nodeGPUs); err != nil {
		t.Fatal(err)
	}
	gen := loadedConfig(t, e, 0)
	for i, strategy := range []string{"cdi-cri", "cdi-annotations"} {
		if i > 0 {
			if err := e.UpdateAgentConfig(layout + "    devicePlugin:\n      deviceListStrategy: " + strategy + "\n"); err != nil {
				t.Fatal(err)
			}
			gen = loadedConfig(t, e, gen)
		}
		name := "cdi-" + strategy
		if err := e.AddPod(harness.PodSpec{Name: name, Limits: map[string]int64{res3g: 1}}); err != nil {
			t.Fatal(err)
		}
		got := containerDevices(t, e, name)
		held, err := e.PodDevices(stepCtx(t), name, res3g)
		if err != nil || len(held) != 1 {
			t.Fatalf("pod %s holds %v (%v), want one MIG device", name, held, err)
		}
		want := cdiSpecNodes(t, e, held[0])
		if !slices.Equal(got, want) {
			t.Fatalf("%s: pod %s holds %s; its container has %v, want %v", strategy, name, held[0], got, want)
		}
		var gpuNodes, caps int
		for _, p := range got {
			switch {
			case strings.HasPrefix(p, "/dev/nvidia-caps/"):
				caps++
			case strings.TrimLeft(strings.TrimPrefix(p, "/dev/nvidia"), "0123456789") == "":
				gpuNodes++
			}
		}
		if gpuNodes != 1 || caps != 2 {
			t.Fatalf("%s: container devices %v: want one GPU node and its MIG device's two capability nodes", strategy, got)
		}
		t.Logf("%s: pod %s holds %s, its container has %v", strategy, name, held[0], got)
	}
}

// A DRA claim on a node whose containerd has CDI: the agent, installed as the DaemonSet with its DRA
// component, answers Prepare with the CDI name of the GPU (nvidia.com/gpu=<UUID>), containerd resolves it in
// the spec the agent keeps in the node's /var/run/cdi (the install's hostPath), and the pod's container gets
// that GPU's device node and no other.
func TestClusterDRACDIContainerd2(t *testing.T) {
	c, _ := installOverlayOn(t, "sim-dra-overlay", inputs.containerd2)
	ctx := clusterCtx(t)
	if v, err := c.ContainerdVersion(ctx); err != nil || !strings.HasPrefix(v, "2.") {
		t.Fatalf("containerd %q (%v), want a 2.x with CDI", v, err)
	}
	created := time.Now()
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, wholeGPUClaim("cdi-gpu"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, claimPod("cdi-user", "cdi-gpu"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=cdi-user", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	t.Logf("MEASURED DRA claim (whole GPU, CDI on containerd 2) created -> container running: %s", time.Since(created).Round(10*time.Millisecond))
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, "cdi-gpu", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || len(cl.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim cdi-gpu: %+v (%v)", cl.Status, err)
	}
	uuid := attr(nodeSlice(t, c)[cl.Status.Allocation.Devices.Results[0].Device], "uuid")
	env, err := c.PodContainerEnv(ctx, &pods[0])
	if err != nil {
		t.Fatal(err)
	}
	got := gpuDevices(env["E2E_DEVICES"])
	want := cdiSpecNodes(t, c.Env, uuid)
	if !slices.Equal(got, want) || len(want) == 0 {
		t.Fatalf("claim cdi-gpu holds %s; the container has %v, the agent's CDI spec gives it %v", uuid, got, want)
	}
	var gpuNodes []string
	for _, p := range got {
		if strings.TrimLeft(strings.TrimPrefix(p, "/dev/nvidia"), "0123456789") == "" {
			gpuNodes = append(gpuNodes, p)
		}
	}
	if len(gpuNodes) != 1 {
		t.Fatalf("container devices %v: want exactly the claimed GPU's node", got)
	}
	t.Logf("claim cdi-gpu: %s, the container has %v", uuid, got)
}

// MPS through DRA on a containerd 2.x node: the config shares GPU 0 by MPS (2 replicas, a stand-in control
// daemon), the slice offers it with 2 shares; one claim takes the default share, the other asks for 8 GiB of its
// memory. Each pod's container gets, from its claim's own CDI spec, the daemon's pipe directory and MPS limits
// derived from what its claim consumes: 50% of the threads each, the default half of the memory and the 8 GiB.
func TestClusterDRAMPSContainerd2(t *testing.T) {
	c, _ := installDRAWithFakeMPS(t)
	gpu0 := shareGPU0ByMPS(t, c)
	mem := gpu0.Capacity["memory"].Value
	half := mem.Value() / 2 >> 20
	tests := []struct {
		name   string
		memory string // "" takes the default
		limit  string
	}{
		{"mps-default", "", fmt.Sprintf("0=%dM", half)},
		{"mps-8gi", "8Gi", "0=8192M"},
	}
	for _, tt := range tests {
		cl := wholeGPUClaim(tt.name)
		cl.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: "device.attributes['gpu.nvidia.com'].index == 0",
		}}}
		if tt.memory != "" {
			cl.Spec.Devices.Requests[0].Exactly.Capacity = &resourceapi.CapacityRequirements{
				Requests: map[resourceapi.QualifiedName]apiresource.Quantity{"memory": apiresource.MustParse(tt.memory)},
			}
		}
		took := claimAndRun(t, c, cl)
		t.Logf("MEASURED DRA claim (MPS share of GPU 0) created -> container running: %s", took.Round(10*time.Millisecond))
		pods, err := c.WaitPodsRunning(clusterCtx(t), "default", "app="+tt.name, 1)
		if err != nil {
			t.Fatal(err)
		}
		env, err := c.PodContainerEnv(clusterCtx(t), &pods[0])
		if err != nil {
			t.Fatal(err)
		}
		if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != tt.limit ||
			!strings.Contains(env["CUDA_MPS_PIPE_DIRECTORY"], attr(gpu0, "uuid")) {
			t.Fatalf("claim %s: container env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q CUDA_MPS_PIPE_DIRECTORY=%q; want 50, %s and GPU 0's pipe directory",
				tt.name, env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_PIPE_DIRECTORY"], tt.limit)
		}
		t.Logf("claim %s: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%s, pipe %s", tt.name, env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_PIPE_DIRECTORY"])
	}
}

// installDRAWithFakeMPS installs the agent with its DRA component on a containerd 2.x node, with gpu-agent's own
// stand-in MPS control program as its --mps-binary. It returns the cluster and the agent's URL.
func installDRAWithFakeMPS(t *testing.T) (*harness.Cluster, string) {
	t.Helper()
	return installOverlayOn(t, "sim-dra-overlay", inputs.containerd2, func(c *harness.Cluster, l *harness.NodeLayer) {
		l.ExtraArgs = append(l.ExtraArgs, "--mps-binary="+mpsStandIn)
	})
}

// shareGPU0ByMPS sets the config that shares GPU 0 by MPS 2 ways, and returns the gpu-0 device of the node's
// ResourceSlice once it offers the 2 shares.
func shareGPU0ByMPS(t *testing.T, c *harness.Cluster) resourceapi.Device {
	t.Helper()
	setConfigMap(t, c, map[string]string{"config.yaml": `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          devices: [0]
          replicas: 2
`})
	var gpu0 resourceapi.Device
	eventually(t, "gpu-0 shared 2 ways by MPS in the ResourceSlice", func() bool {
		gpu0 = nodeSlice(t, c)["gpu-0"]
		q, ok := gpu0.Capacity["shares"]
		return ok && q.Value.Value() == 2
	})
	return gpu0
}
