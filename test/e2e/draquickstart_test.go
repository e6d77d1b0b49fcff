//go:build e2e

package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// What NVIDIA's DRA quickstart and consumable-shares demos ask, in claims written here (docs/dra-devices.md
// lists their claims and how each allocates): one GPU per pod from a claim template, one claim used by two
// containers of a pod with time-slicing config, one claim used by two pods, one claim of two GPUs (one
// time-sliced, one MPS with limits) split over two containers, and, on GPUs the node config shares, claims
// taking a share of a GPU by its memory or by a plain request. Every pod must run, and each container must
// have the device node of the GPU its claim was allocated and no other.
func TestClusterDRAQuickstartContainerd2(t *testing.T) {
	c, agent := installDRAWithFakeMPS(t)
	ctx := clusterCtx(t)
	setConfigMap(t, c, map[string]string{"config.yaml": "version: v1\nconfigs:\n  default: {}\n"})
	eventually(t, "the ResourceSlice with 8 unshared GPUs", func() bool {
		d := nodeSlice(t, c)
		_, shared := d["gpu-0"].Capacity["shares"]
		return len(d) == nodeGPUs && !shared
	})

	// gpu-test1: two pods, each with its own claim from one template.
	createTemplate(t, c, "one-gpu", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{gpuRequest("gpu")}})
	var first []string
	for _, name := range []string{"own-gpu-a", "own-gpu-b"} {
		runClaimPod(t, c, name, claimSource{template: "one-gpu"}, []string{"gpu"})
		got := checkContainers(t, c, name, map[string]string{"main": "gpu"})
		first = append(first, got...)
	}
	if len(first) != 2 || first[0] == first[1] {
		t.Fatalf("pods with a claim each got GPUs %v, want two different ones", first)
	}

	// gpu-test2: one pod, two containers, one claim; NVIDIA's time-slicing config with the default interval.
	createTemplate(t, c, "ts-gpu", resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{gpuRequest("gpu")},
		Config:   []resourceapi.DeviceClaimConfiguration{gpuConfig("gpu", `"sharing":{"strategy":"TimeSlicing"}`)},
	})
	runClaimPod(t, c, "two-ctrs", claimSource{template: "ts-gpu"}, []string{"gpu", "gpu"})
	checkContainers(t, c, "two-ctrs", map[string]string{"main": "gpu", "second": "gpu"})

	// gpu-test3: one claim, two pods.
	shared := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "shared-by-pods", Namespace: "default"},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{gpuRequest("gpu")}}},
	}
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, shared, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var byPods []string
	for _, name := range []string{"shared-a", "shared-b"} {
		runClaimPod(t, c, name, claimSource{claim: shared.Name}, []string{"gpu"})
		byPods = append(byPods, checkContainers(t, c, name, map[string]string{"main": "gpu"})...)
	}
	if byPods[0] != byPods[1] {
		t.Fatalf("two pods of one claim have GPUs %v", byPods)
	}
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, shared.Name, metav1.GetOptions{})
	if err != nil || len(cl.Status.ReservedFor) != 2 {
		t.Fatalf("claim %s reserved for %+v (%v), want both pods", shared.Name, cl.Status.ReservedFor, err)
	}

	// gpu-test5: one claim of two GPUs, one time-sliced and one an MPS client with NVIDIA's limits, each
	// request used by its own container.
	createTemplate(t, c, "ts-and-mps", resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{gpuRequest("ts-gpu"), gpuRequest("mps-gpu")},
		Config: []resourceapi.DeviceClaimConfiguration{
			gpuConfig("ts-gpu", `"sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Default"}}`),
			gpuConfig("mps-gpu", `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50,"defaultPinnedDeviceMemoryLimit":"10Gi"}}`),
		},
	})
	runClaimPod(t, c, "ts-and-mps", claimSource{template: "ts-and-mps"}, []string{"ts-gpu", "mps-gpu"})
	gpus := checkContainers(t, c, "ts-and-mps", map[string]string{"main": "ts-gpu", "second": "mps-gpu"})
	if gpus[0] == gpus[1] {
		t.Fatalf("the claim's two requests got one GPU %s", gpus[0])
	}
	p, err := c.Client.CoreV1().Pods("default").Get(ctx, "ts-and-mps", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	env, err := c.PodContainerEnvOf(ctx, p, "second")
	if err != nil {
		t.Fatal(err)
	}
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != "0=10240M" || env["CUDA_MPS_PIPE_DIRECTORY"] == "" {
		t.Errorf("the MPS request's container: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q CUDA_MPS_PIPE_DIRECTORY=%q; want 50, 0=10240M and a pipe directory",
			env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_PIPE_DIRECTORY"])
	}
	if main, err := c.PodContainerEnvOf(ctx, p, "main"); err != nil || main["CUDA_MPS_PIPE_DIRECTORY"] != "" {
		t.Errorf("the time-sliced request's container has CUDA_MPS_PIPE_DIRECTORY=%q (%v), want none", main["CUDA_MPS_PIPE_DIRECTORY"], err)
	}

	// Consumable shares: every pod and claim gone, the config shares each GPU 4 ways; two claims ask for 4Gi
	// of a GPU's memory and one for a plain share, and all three get shares of one GPU.
	for _, name := range []string{"own-gpu-a", "own-gpu-b", "two-ctrs", "shared-a", "shared-b", "ts-and-mps"} {
		if err := c.Client.CoreV1().Pods("default").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Client.ResourceV1().ResourceClaims("default").Delete(ctx, shared.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	eventually(t, "every claim unprepared", func() bool {
		st.DRA.Claims = nil
		agentGet(t, agent, "/status", &st)
		return len(st.DRA.Claims) == 0
	})
	setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	eventually(t, "gpu-0 shared 4 ways in the ResourceSlice", func() bool {
		q, ok := nodeSlice(t, c)["gpu-0"].Capacity["shares"]
		return ok && q.Value.Value() == 4
	})
	memReq := gpuRequest("gpu")
	memReq.Exactly.Capacity = &resourceapi.CapacityRequirements{
		Requests: map[resourceapi.QualifiedName]apiresource.Quantity{"memory": apiresource.MustParse("4Gi")},
	}
	createTemplate(t, c, "gpu-4gi", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{memReq}})
	createTemplate(t, c, "gpu-share", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{gpuRequest("gpu")}})
	shareIDs := map[string]bool{}
	var onGPU []string
	for _, pod := range []struct{ name, template, memory string }{
		{"mem-a", "gpu-4gi", "4Gi"}, {"mem-b", "gpu-4gi", "4Gi"}, {"plain-share", "gpu-share", ""},
	} {
		runClaimPod(t, c, pod.name, claimSource{template: pod.template}, []string{"gpu"})
		onGPU = append(onGPU, checkContainers(t, c, pod.name, map[string]string{"main": "gpu"})...)
		r := podClaim(t, c, pod.name).Status.Allocation.Devices.Results[0]
		if r.ShareID == nil {
			t.Fatalf("pod %s: %+v is no share", pod.name, r)
		}
		shareIDs[string(*r.ShareID)] = true
		got := r.ConsumedCapacity["memory"]
		if pod.memory != "" && got.Cmp(apiresource.MustParse(pod.memory)) != 0 {
			t.Errorf("pod %s: consumed memory %s, want %s", pod.name, got.String(), pod.memory)
		}
	}
	if len(shareIDs) != 3 || onGPU[0] != onGPU[1] || onGPU[1] != onGPU[2] {
		t.Errorf("shares %v on GPUs %v; want three shares of one GPU", shareIDs, onGPU)
	}
}

func gpuRequest(name string) resourceapi.DeviceRequest {
	return resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: draDriver}}
}

// gpuConfig is NVIDIA's GpuConfig for request, with fields (JSON members) besides its type.
func gpuConfig(request, fields string) resourceapi.DeviceClaimConfiguration {
	return resourceapi.DeviceClaimConfiguration{Requests: []string{request}, DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: draDriver, Parameters: runtime.RawExtension{
			Raw: []byte(`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig",` + fields + `}`),
		}},
	}}
}

func createTemplate(t *testing.T, c *harness.Cluster, name string, devices resourceapi.DeviceClaim) {
	t.Helper()
	tpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: devices}},
	}
	if _, err := c.Client.ResourceV1().ResourceClaimTemplates("default").Create(clusterCtx(t), tpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// claimSource is a pod's claim "gpu": made from a template, or an existing claim.
type claimSource struct{ template, claim string }

// containerNames are the names runClaimPod gives a pod's containers, in order.
var containerNames = []string{"main", "second", "third", "fourth"}

// runClaimPod runs a pod whose containers (containerNames) each use the request of claim "gpu" at the
// same position in requests, and waits until it runs.
func runClaimPod(t *testing.T, c *harness.Cluster, name string, src claimSource, requests []string) {
	t.Helper()
	ctx := clusterCtx(t)
	p := claimPod(name, "unused")
	p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu"}}
	if src.template != "" {
		p.Spec.ResourceClaims[0].ResourceClaimTemplateName = &src.template
	} else {
		p.Spec.ResourceClaims[0].ResourceClaimName = &src.claim
	}
	main := p.Spec.Containers[0]
	p.Spec.Containers = nil
	for i, req := range requests {
		ctr := *main.DeepCopy()
		ctr.Name = containerNames[i]
		ctr.Resources.Claims = []corev1.ResourceClaim{{Name: "gpu", Request: req}}
		p.Spec.Containers = append(p.Spec.Containers, ctr)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app="+name, 1); err != nil {
		dumpPods(t, c, "default")
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
}

// podClaim is the allocated claim "gpu" of the pod.
func podClaim(t *testing.T, c *harness.Cluster, pod string) *resourceapi.ResourceClaim {
	t.Helper()
	ctx := clusterCtx(t)
	p, err := c.Client.CoreV1().Pods("default").Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	name := ""
	if src := p.Spec.ResourceClaims[0]; src.ResourceClaimName != nil {
		name = *src.ResourceClaimName
	}
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.Name == "gpu" && s.ResourceClaimName != nil {
			name = *s.ResourceClaimName
		}
	}
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil {
		t.Fatalf("pod %s: claim %q: %v", pod, name, err)
	}
	return cl
}

// checkContainers checks that each named container has the GPU device node of what its request of the pod's
// claim was allocated, and no other GPU's; it returns the allocated devices, in the containers' order.
func checkContainers(t *testing.T, c *harness.Cluster, pod string, requests map[string]string) []string {
	t.Helper()
	ctx := clusterCtx(t)
	cl := podClaim(t, c, pod)
	p, err := c.Client.CoreV1().Pods("default").Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	devs := nodeSlice(t, c)
	var out []string
	for _, ctr := range p.Spec.Containers {
		req := requests[ctr.Name]
		i := slices.IndexFunc(cl.Status.Allocation.Devices.Results, func(r resourceapi.DeviceRequestAllocationResult) bool { return r.Request == req })
		if i < 0 {
			t.Fatalf("pod %s: claim %s has no result for request %q: %+v", pod, cl.Name, req, cl.Status.Allocation.Devices.Results)
		}
		dev := cl.Status.Allocation.Devices.Results[i].Device
		uuid := attr(devs[dev], "uuid")
		env, err := c.PodContainerEnvOf(ctx, p, ctr.Name)
		if err != nil {
			t.Fatal(err)
		}
		got, want := gpuNodes(gpuDevices(env["E2E_DEVICES"])), gpuNodes(cdiSpecNodes(t, c.Env, uuid))
		if len(want) != 1 || !slices.Equal(got, want) {
			t.Fatalf("pod %s container %s: request %s got %s (%s); the container has GPU nodes %v, want %v", pod, ctr.Name, req, dev, uuid, got, want)
		}
		t.Logf("pod %s container %s: request %s is %s, the container has %v", pod, ctr.Name, req, dev, got)
		out = append(out, dev)
	}
	return out
}

// gpuNodes keeps a GPU's own device nodes (/dev/nvidiaN) of a list.
func gpuNodes(paths []string) []string {
	var out []string
	for _, p := range paths {
		if n := strings.TrimPrefix(p, "/dev/nvidia"); n != p && n != "" && strings.TrimLeft(n, "0123456789") == "" {
			out = append(out, p)
		}
	}
	return out
}

// gpu-test4's ask on the real control plane: one claim of four MIG devices (two 1g.5gb, a 2g.10gb and a 3g.20gb)
// on one GPU (matchAttribute parentUUID), each used by its own container, on an A100 node that makes MIG devices
// on demand. The pod runs; the agent made those four profiles on one GPU; each container has that GPU's node and
// MIG access nodes of its own.
func TestClusterDRAQuickstartMIGContainerd2(t *testing.T) {
	c, agent := installOverlayOn(t, "sim-dra-mig-overlay", inputs.containerd2)
	eventually(t, "the ResourceSlices with MIG devices on demand", func() bool { return len(nodeSlice(t, c)) > nodeGPUs })
	profile := func(name, p string) resourceapi.DeviceRequest {
		r := gpuRequest(name)
		r.Exactly.DeviceClassName = "mig.nvidia.com"
		r.Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: "device.attributes['gpu.nvidia.com'].profile == '" + p + "'",
		}}}
		return r
	}
	requests := []string{"mig-1g-a", "mig-1g-b", "mig-2g", "mig-3g"}
	parent := resourceapi.FullyQualifiedName("gpu.nvidia.com/parentUUID")
	createTemplate(t, c, "four-mig", resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{
			profile(requests[0], "1g.5gb"), profile(requests[1], "1g.5gb"), profile(requests[2], "2g.10gb"), profile(requests[3], "3g.20gb"),
		},
		Constraints: []resourceapi.DeviceConstraint{{MatchAttribute: &parent}},
	})
	runClaimPod(t, c, "four-mig", claimSource{template: "four-mig"}, requests)

	var st struct {
		GPUs []struct {
			Index     int `json:"index"`
			Instances []struct {
				Profile string `json:"profile"`
			} `json:"instances"`
		} `json:"gpus"`
	}
	agentGet(t, agent, "/status", &st)
	gpuIdx := -1
	for _, g := range st.GPUs {
		var ps []string
		for _, m := range g.Instances {
			ps = append(ps, m.Profile)
		}
		slices.Sort(ps)
		switch {
		case len(ps) == 0:
		case slices.Equal(ps, []string{"1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"}) && gpuIdx < 0:
			gpuIdx = g.Index
		default:
			t.Fatalf("GPU %d has MIG devices %v; want the claim's four on one GPU", g.Index, ps)
		}
	}
	if gpuIdx < 0 {
		t.Fatal("no GPU has the claim's four MIG devices")
	}
	p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), "four-mig", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	caps := map[string]string{}
	for _, ctr := range containerNames {
		env, err := c.PodContainerEnvOf(clusterCtx(t), p, ctr)
		if err != nil {
			t.Fatal(err)
		}
		devs := gpuDevices(env["E2E_DEVICES"])
		var own []string
		for _, d := range devs {
			if strings.HasPrefix(d, "/dev/nvidia-caps/") {
				own = append(own, d)
			}
		}
		if g := gpuNodes(devs); len(g) != 1 || g[0] != fmt.Sprintf("/dev/nvidia%d", gpuIdx) || len(own) == 0 {
			t.Fatalf("container %s has %v; want GPU %d's node and MIG access nodes", ctr, devs, gpuIdx)
		}
		key := strings.Join(own, " ")
		if other, dup := caps[key]; dup {
			t.Fatalf("containers %s and %s have the same MIG access nodes %s", other, ctr, key)
		}
		caps[key] = ctr
		t.Logf("container %s: %v", ctr, devs)
	}
}
