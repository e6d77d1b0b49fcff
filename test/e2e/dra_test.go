//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// The DRA issue's scenarios on the real control plane: gpu-agent installed from deploy/manifests with its
// DRA component (testdata/sim-dra-overlay) serves the same simulated DGX A100 through its device plugin and
// as DRA driver gpu.nvidia.com, and a device goes one way at a time.

const draDriver = "gpu.nvidia.com"

func installDRA(t *testing.T) (*harness.Cluster, string) {
	t.Helper()
	return installDRAWith(t, "")
}

// installDRAWith is installDRA on an API server with the feature gates gates ("": its defaults).
func installDRAWith(t *testing.T, gates string) (*harness.Cluster, string) {
	t.Helper()
	c := startClusterWith(t, "", gates)
	agent := installOverlayIn(t, c, "sim-dra-overlay")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the agent's log:\n%s", c.ContainerLogTail("gpu-agent", "gpu-agent-", "gpu-agent", 80))
		}
	})
	return c, agent
}

// nodeSlice returns the agent's ResourceSlice devices on the node, by name (nil when there is no slice).
func nodeSlice(t *testing.T, c *harness.Cluster) map[string]resourceapi.Device {
	t.Helper()
	list, err := c.Client.ResourceV1().ResourceSlices().List(clusterCtx(t), metav1.ListOptions{
		FieldSelector: "spec.driver=" + draDriver + ",spec.nodeName=" + c.NodeName(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) == 0 {
		return nil
	}
	out := map[string]resourceapi.Device{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			out[d.Name] = d
		}
	}
	return out
}

func attr(d resourceapi.Device, name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(name)]
	switch {
	case !ok:
		return ""
	case a.StringValue != nil:
		return *a.StringValue
	case a.VersionValue != nil:
		return *a.VersionValue
	}
	return ""
}

// claimPod is a pod whose one container uses the claim, and asks for no device plugin resource.
func claimPod(name, claim string) *corev1.Pod {
	tpl := harness.GPUPodTemplate(map[string]string{"app": name}, gpuResource, 1)
	spec := tpl.Spec
	delete(spec.Containers[0].Resources.Limits, gpuResource)
	delete(spec.Containers[0].Resources.Requests, gpuResource)
	spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
	spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: tpl.Labels}, Spec: spec}
}

func wholeGPUClaim(name string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: draDriver},
		}}}},
	}
}

// draDeviceHealth is the health the pod's status gives a DRA device (by its resource ID), "" when absent.
func draDeviceHealth(t *testing.T, c *harness.Cluster, pod, device string) corev1.ResourceHealthStatus {
	t.Helper()
	p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cs := range p.Status.ContainerStatuses {
		for _, rs := range cs.AllocatedResourcesStatus {
			for _, r := range rs.Resources {
				if string(r.ResourceID) == device {
					return r.Health
				}
			}
		}
	}
	return ""
}

// TestClusterDRAWholeGPU: the ResourceSlice lists the node's 8 GPUs with NVIDIA's attributes; a claim
// through NVIDIA's DeviceClass gets one, which the device plugin then withholds; a device plugin pod's GPUs
// leave the slice; a fatal XID taints the claimed GPU and shows in the pod's status; a released claim's GPU
// returns to both.
func TestClusterDRAWholeGPU(t *testing.T) {
	c, agent := installDRA(t)
	ctx := clusterCtx(t)
	var devs map[string]resourceapi.Device
	eventually(t, "the agent's ResourceSlice with 8 GPUs", func() bool {
		devs = nodeSlice(t, c)
		return len(devs) == nodeGPUs
	})
	g0 := devs["gpu-0"]
	mem := g0.Capacity["memory"].Value
	if attr(g0, "type") != "gpu" || !strings.HasPrefix(attr(g0, "uuid"), "GPU-") || attr(g0, "productName") != "NVIDIA A100-SXM4-40GB" ||
		attr(g0, "architecture") != "Ampere" || attr(g0, "cudaComputeCapability") != "8.0.0" || mem.IsZero() ||
		attr(g0, "brand") != "Nvidia" || attr(g0, "cudaDriverVersion") == "" ||
		!strings.HasPrefix(attr(g0, "resource.kubernetes.io/pciBusID"), "0000:") || !strings.HasPrefix(attr(g0, "resource.kubernetes.io/pcieRoot"), "pci") {
		t.Errorf("gpu-0 in the ResourceSlice: %+v", g0)
	}

	// A claim through NVIDIA's DeviceClass, used by a pod.
	created := time.Now()
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, wholeGPUClaim("one-gpu"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, claimPod("dra-user", "one-gpu"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=dra-user", 1); err != nil {
		dumpPods(t, c, "default")
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
	t.Logf("MEASURED DRA claim (whole GPU) created -> container running: %s", time.Since(created).Round(10*time.Millisecond))
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, "one-gpu", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || len(cl.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim one-gpu: %+v (%v)", cl.Status, err)
	}
	got := cl.Status.Allocation.Devices.Results[0]
	uuid := attr(devs[got.Device], "uuid")
	if got.Driver != draDriver || got.Pool != c.NodeName() || uuid == "" {
		t.Fatalf("claim one-gpu allocated %+v", got)
	}
	t.Logf("claim one-gpu: device %s (%s)", got.Device, uuid)
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	if want := "default/one-gpu: " + got.Device; !slices.Contains(st.DRA.Claims, want) {
		t.Errorf("/status dra claims %v, want %q", st.DRA.Claims, want)
	}
	// The device plugin withholds it: the Node's allocatable drops to 7.
	waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, time.Now())

	// A fatal XID on the claimed GPU: its slice entry gets the NoSchedule taint, and the kubelet's DRA health
	// stream puts it into the pod's status; a reset clears both.
	idx := gpuIndex(t, agent, uuid)
	injected := time.Now()
	agentPost(t, agent, "/sim/xid", fmt.Sprintf(`{"gpu":%d,"xid":48}`, idx))
	eventually(t, "the claimed GPU tainted in the ResourceSlice", func() bool {
		d := nodeSlice(t, c)[got.Device]
		return slices.ContainsFunc(d.Taints, func(tt resourceapi.DeviceTaint) bool {
			return tt.Key == "gpu.nvidia.com/unhealthy" && tt.Effect == resourceapi.DeviceTaintEffectNoSchedule
		})
	})
	t.Logf("MEASURED fatal XID -> DRA device taint: %s", time.Since(injected).Round(10*time.Millisecond))
	// The kubelet names a DRA device in pod status by its first CDI device ID.
	want := "nvidia.com/gpu=" + uuid
	eventually(t, "the DRA pod's allocatedResourcesStatus shows "+want+" unhealthy", func() bool {
		return draDeviceHealth(t, c, "dra-user", want) == corev1.ResourceHealthStatusUnhealthy
	})
	t.Logf("MEASURED fatal XID -> DRA pod status unhealthy: %s", time.Since(injected).Round(10*time.Millisecond))
	// The claim's status says so too: Ready false, with the cause.
	eventually(t, "claim one-gpu's device not Ready, reason Unhealthy", func() bool {
		cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(clusterCtx(t), "one-gpu", metav1.GetOptions{})
		if err != nil || len(cl.Status.Devices) != 1 {
			return false
		}
		cond := meta.FindStatusCondition(cl.Status.Devices[0].Conditions, "Ready")
		return cond != nil && cond.Status == metav1.ConditionFalse && cond.Reason == "Unhealthy" && strings.Contains(cond.Message, "48")
	})
	logClaimStatus(t, c, "one-gpu")
	agentPost(t, agent, "/sim/reset", fmt.Sprintf(`{"gpu":%d}`, idx))
	eventually(t, "the taint gone and the pod's device healthy after the reset", func() bool {
		return len(nodeSlice(t, c)[got.Device].Taints) == 0 && draDeviceHealth(t, c, "dra-user", want) == corev1.ResourceHealthStatusHealthy
	})
	eventually(t, "claim one-gpu's device Ready again", func() bool { return readyDevice(t, c, "one-gpu") != nil })

	// /metrics names the pod on its GPU's series, with the claim.
	userSeries := func() string {
		return draSeries(t, agent, "DCGM_FI_DEV_GPU_TEMP", `UUID="`+uuid+`"`, `pod="dra-user"`, `dra_claim_name="one-gpu"`, `dra_device_name="`+got.Device+`"`)
	}
	eventually(t, "the DRA pod on its GPU's series", func() bool { return userSeries() != "" })

	// A device plugin pod for the other 7 GPUs: none is the claimed one, and they leave the slice.
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("dp-user", 1, nodeGPUs-1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=dp-user", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	held, err := c.PodDevicesOf(ctx, &pods[0], gpuResource)
	if err != nil || len(held) != nodeGPUs-1 || slices.Contains(held, uuid) {
		t.Fatalf("device plugin pod holds %v (%v); want 7 GPUs without the claimed %s", held, err, uuid)
	}
	eventually(t, "the ResourceSlice keeps only the claimed GPU", func() bool {
		d := nodeSlice(t, c)
		_, ok := d[got.Device]
		return len(d) == 1 && ok
	})

	// Released: the claim's GPU is the device plugin's again, and stays in the slice.
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "dra-user", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the claim unprepared", func() bool {
		st.DRA.Claims = nil // absent when empty: do not keep the last answer's
		agentGet(t, agent, "/status", &st)
		return len(st.DRA.Claims) == 0
	})
	eventually(t, "the released claim's pod gone from its GPU's series", func() bool { return userSeries() == "" })
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())
	if d := nodeSlice(t, c); len(d) != 1 {
		t.Errorf("slice after the release: %d devices, want the one GPU no pod holds", len(d))
	}
}

// TestClusterDRAExtendedResource: with NVIDIA's DeviceClass mapped to nvidia.com/gpu, a label switches the node's
// config to devicePlugin.enabled: false, live: the Node's allocatable drops to 0, an unchanged pod asking for
// nvidia.com/gpu: 1 is served through DRA, and the pod that got its GPU through the device plugin keeps it;
// switched back, both keep their devices and the device plugin offers the rest.
func TestClusterDRAExtendedResource(t *testing.T) {
	c, agent := installOverlay(t, "sim-dra-ext-overlay")
	ctx := clusterCtx(t)
	setConfigMap(t, c, map[string]string{"config.yaml": "version: v1\nconfigs:\n  default: {}\n  dra-only:\n    devicePlugin:\n      enabled: false\n"})

	// A pod served by the device plugin.
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("dp-holder", 1, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=dp-holder", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	holder := pods[0]
	held, err := c.PodDevicesOf(ctx, &holder, gpuResource)
	if err != nil || len(held) != 1 {
		t.Fatalf("dp-holder holds %v (%v)", held, err)
	}
	container := runningContainerID(t, c, holder.Name)

	// Switch the node to DRA only.
	switched := labelNode(t, c, "gpu-agent.io/config", "dra-only")
	took := waitAllocatableQ(t, c, gpuResource, 0, switched)
	t.Logf("MEASURED label gpu-agent.io/config=dra-only -> Node allocatable %s=0: %s", gpuResource, took.Round(10*time.Millisecond))
	eventually(t, "the ResourceSlice offers the 7 GPUs no container holds", func() bool { return len(nodeSlice(t, c)) == nodeGPUs-1 })

	// An unchanged pod asking for nvidia.com/gpu: 1, through DRA.
	created := time.Now()
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("ext-user", 1, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err = c.WaitPodsRunning(ctx, "default", "app=ext-user", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	t.Logf("MEASURED nvidia.com/gpu pod through DRA created -> container running: %s", time.Since(created).Round(10*time.Millisecond))
	ext := pods[0]
	if ext.Status.ExtendedResourceClaimStatus == nil || ext.Status.ExtendedResourceClaimStatus.ResourceClaimName == "" {
		t.Fatalf("ext-user: no extended resource claim in its status: %+v", ext.Status)
	}
	claimName := ext.Status.ExtendedResourceClaimStatus.ResourceClaimName
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, claimName, metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || len(cl.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim %s: %+v (%v)", claimName, cl, err)
	}
	dev := cl.Status.Allocation.Devices.Results[0].Device
	t.Logf("ext-user: claim %s, device %s", claimName, dev)
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	if want := "default/" + claimName + ": " + dev; !slices.Contains(st.DRA.Claims, want) {
		t.Errorf("/status dra claims %v, want %q", st.DRA.Claims, want)
	}
	if idx := gpuIndex(t, agent, held[0]); dev == fmt.Sprintf("gpu-%d", idx) {
		t.Fatalf("DRA gave %s, the GPU dp-holder holds", dev)
	}

	// Back to both paths: nobody loses a device.
	labelNode(t, c, "gpu-agent.io/config", "")
	waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, time.Now())
	if got := runningContainerID(t, c, holder.Name); got != container {
		t.Errorf("dp-holder's container %s replaced by %s", container, got)
	}
	p, err := c.Client.CoreV1().Pods("default").Get(ctx, holder.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if still, err := c.PodDevicesOf(ctx, p, gpuResource); err != nil || !slices.Equal(still, held) {
		t.Errorf("dp-holder holds %v (%v), want %v", still, err, held)
	}
	st.DRA.Claims = nil
	agentGet(t, agent, "/status", &st)
	if len(st.DRA.Claims) != 1 {
		t.Errorf("after switching back the DRA claims are %v, want ext-user's", st.DRA.Claims)
	}
}

// sliceGPUUUID is the UUID of the node's GPU index, from its whole device or one of its MIG devices in the slices.
func sliceGPUUUID(t *testing.T, c *harness.Cluster, index int) string {
	t.Helper()
	for name, d := range nodeSlice(t, c) {
		switch {
		case name == fmt.Sprintf("gpu-%d", index):
			return attr(d, "uuid")
		case strings.HasPrefix(name, fmt.Sprintf("gpu-%d-mig-", index)):
			return attr(d, "parentUUID")
		}
	}
	t.Fatalf("no device of GPU %d in the node's ResourceSlices", index)
	return ""
}

// migClaim asks for a MIG device of profile on the GPU parent (its UUID), as NVIDIA's users select one.
func migClaim(name, profile, parent string) *resourceapi.ResourceClaim {
	// The capacity clause is how NVIDIA's users select MIG devices: the scheduler fails the claim if no device
	// has the key.
	expr := fmt.Sprintf("device.attributes['gpu.nvidia.com'].profile == '%s' && device.attributes['gpu.nvidia.com'].parentUUID == '%s' && "+
		"device.capacity['gpu.nvidia.com'].multiprocessors.compareTo(quantity('1')) >= 0", profile, parent)
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: "mig.nvidia.com",
				Selectors:       []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}},
			},
		}}}},
	}
}

// claimAndRun creates a claim and a pod using it; it returns when the pod runs, with how long that took.
func claimAndRun(t *testing.T, c *harness.Cluster, claim *resourceapi.ResourceClaim) time.Duration {
	t.Helper()
	ctx := clusterCtx(t)
	created := time.Now()
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, claimPod(claim.Name, claim.Name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app="+claim.Name, 1); err != nil {
		dumpPods(t, c, "default")
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
	return time.Since(created)
}

// TestClusterDRADynamicMIG: an A100 node with MIG on and no layout offers every profile at every placement; a
// 3g and a 4g claim for GPU 0 land there as MIG devices created on demand; a 7g claim for GPU 0 then stays
// unschedulable (the scheduler counts the GPU's memory slices), and runs once the two are released.
func TestClusterDRADynamicMIG(t *testing.T) {
	c, agent := installOverlay(t, "sim-dra-mig-overlay")
	ctx := clusterCtx(t)
	// A100 profiles x placements; 1g.10gb+me, of which one fits, at its last only.
	const perGPU = 7 + 1 + 4 + 3 + 2 + 1 + 1
	eventually(t, "the ResourceSlices with every A100 profile at every placement", func() bool {
		return len(nodeSlice(t, c)) == nodeGPUs*perGPU
	})

	gpu0 := sliceGPUUUID(t, c, 0)
	took := claimAndRun(t, c, migClaim("three", "3g.20gb", gpu0))
	t.Logf("MEASURED DRA claim (dynamic MIG 3g.20gb) created -> container running: %s", took.Round(10*time.Millisecond))
	took = claimAndRun(t, c, migClaim("four", "4g.20gb", gpu0))
	t.Logf("MEASURED DRA claim (dynamic MIG 4g.20gb) created -> container running: %s", took.Round(10*time.Millisecond))
	var st struct {
		GPUs []struct {
			Index     int `json:"index"`
			Instances []struct {
				Profile string `json:"profile"`
				UUID    string `json:"uuid"`
			} `json:"instances"`
		} `json:"gpus"`
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	var profiles []string
	for _, m := range st.GPUs[0].Instances {
		profiles = append(profiles, m.Profile)
	}
	slices.Sort(profiles)
	if !slices.Equal(profiles, []string{"3g.20gb", "4g.20gb"}) || len(st.DRA.Claims) != 2 {
		t.Fatalf("GPU 0 has %v, DRA claims %v; want a 3g.20gb and a 4g.20gb made for the two claims", profiles, st.DRA.Claims)
	}

	// The claim's status.devices (KEP-4817), as kubectl describe resourceclaim shows it: the device Ready,
	// and the MIG device made for it named by its UUID and placement.
	var made *resourceapi.AllocatedDeviceStatus
	eventually(t, "claim three's status.devices: Ready with the MIG device's UUID", func() bool {
		made = readyDevice(t, c, "three")
		return made != nil && made.Data != nil && strings.Contains(string(made.Data.Raw), `"uuid":"MIG-`)
	})
	var data struct {
		UUID      string `json:"uuid"`
		Profile   string `json:"profile"`
		Placement struct {
			Start int `json:"start"`
			Size  int `json:"size"`
		} `json:"placement"`
	}
	if err := json.Unmarshal(made.Data.Raw, &data); err != nil || data.Profile != "3g.20gb" || data.Placement.Size != 4 ||
		!slices.ContainsFunc(st.GPUs[0].Instances, func(m struct {
			Profile string `json:"profile"`
			UUID    string `json:"uuid"`
		}) bool {
			return m.UUID == data.UUID
		}) {
		t.Errorf("claim three's device data %s (%v), want the 3g.20gb device made for it (GPU 0: %+v)", made.Data.Raw, err, st.GPUs[0].Instances)
	}
	logClaimStatus(t, c, "three")

	// A 7g claim for the same GPU: the scheduler sees its memory slices taken.
	ctx7 := clusterCtx(t)
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx7, migClaim("seven", "7g.40gb", gpu0), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx7, claimPod("seven", "seven"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodMatching(ctx7, "default", "app=seven", "unschedulable", func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
				return true
			}
		}
		return false
	}); err != nil {
		t.Fatal(err)
	}

	released := time.Now()
	for _, p := range []string{"three", "four"} {
		if err := c.Client.CoreV1().Pods("default").Delete(ctx, p, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=seven", 1); err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	t.Logf("MEASURED 3g and 4g pods deleted -> the 7g claim's container running: %s", time.Since(released).Round(10*time.Millisecond))
	agentGet(t, agent, "/status", &st)
	if n := len(st.GPUs[0].Instances); n != 1 || st.GPUs[0].Instances[0].Profile != "7g.40gb" {
		t.Errorf("GPU 0 after the release: %+v, want one 7g.40gb", st.GPUs[0].Instances)
	}
}

// TestClusterDRARestartBeforeStart: the agent is replaced (a rolling update) after it prepared a claim and
// before the pod's container starts (an init container waits on a file): the new agent restores the claim from
// its checkpoint, keeps its GPU from the device plugin, the container then starts, and deleting the pod
// releases the claim through the new agent.
func TestClusterDRARestartBeforeStart(t *testing.T) {
	c, agent := installDRA(t)
	ctx := clusterCtx(t)
	eventually(t, "the agent's ResourceSlice with 8 GPUs", func() bool { return len(nodeSlice(t, c)) == nodeGPUs })
	gate := t.TempDir()
	pod := claimPod("gated", "gated")
	pod.Spec.Volumes = []corev1.Volume{{Name: "gate", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: gate}}}}
	pod.Spec.InitContainers = []corev1.Container{{
		Name: "gate", Image: pod.Spec.Containers[0].Image, ImagePullPolicy: corev1.PullNever,
		Command:      []string{"sh", "-c", "until [ -e /gate/open ]; do sleep 0.1; done"},
		VolumeMounts: []corev1.VolumeMount{{Name: "gate", MountPath: "/gate"}},
	}}
	if _, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, wholeGPUClaim("gated"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	eventually(t, "the claim prepared, the pod's init container waiting", func() bool {
		st.DRA.Claims = nil
		agentGet(t, agent, "/status", &st)
		p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), "gated", metav1.GetOptions{})
		return err == nil && len(st.DRA.Claims) == 1 && len(p.Status.InitContainerStatuses) == 1 && p.Status.InitContainerStatuses[0].State.Running != nil
	})
	prepared := st.DRA.Claims[0]
	waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, time.Now())

	upgradeAgentImage(t, c, "v0.1.1")
	st.DRA.Claims = nil
	agentGet(t, agent, "/status", &st)
	if !slices.Equal(st.DRA.Claims, []string{prepared}) {
		t.Fatalf("the new agent's claims %v, want %q restored", st.DRA.Claims, prepared)
	}
	waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, time.Now())

	if err := os.WriteFile(filepath.Join(gate, "open"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=gated", 1); err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "gated", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new agent unprepares the claim", func() bool {
		st.DRA.Claims = nil
		agentGet(t, agent, "/status", &st)
		return len(st.DRA.Claims) == 0
	})
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())
}

// TestClusterDRASharedGPU: with the config time-slicing GPUs ×4, the ResourceSlice offers each GPU to several
// claims (consumable capacity "shares"); two claims for GPU 0 both get it, each with its own share, and both
// pods run.
func TestClusterDRASharedGPU(t *testing.T) {
	c, agent := installDRA(t)
	t.Cleanup(func() {
		if t.Failed() {
			logClaimStatus(t, c, "share-a")
		}
	})
	ctx := clusterCtx(t)
	setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	eventually(t, "gpu-0 shared 4 ways in the ResourceSlice", func() bool {
		d := nodeSlice(t, c)["gpu-0"]
		q, ok := d.Capacity["shares"]
		return ok && q.Value.Value() == 4 && d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations
	})
	for _, name := range []string{"share-a", "share-b"} {
		cl := wholeGPUClaim(name)
		cl.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: "device.attributes['gpu.nvidia.com'].index == 0",
		}}}
		took := claimAndRun(t, c, cl)
		t.Logf("MEASURED DRA claim (a share of GPU 0) created -> container running: %s", took.Round(10*time.Millisecond))
	}
	shares := map[string]bool{}
	for _, name := range []string{"share-a", "share-b"} {
		cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil || cl.Status.Allocation == nil {
			t.Fatalf("claim %s: %v", name, err)
		}
		r := cl.Status.Allocation.Devices.Results[0]
		if r.Device != "gpu-0" || r.ShareID == nil {
			t.Fatalf("claim %s allocated %+v, want a share of gpu-0", name, r)
		}
		shares[string(*r.ShareID)] = true
	}
	if len(shares) != 2 {
		t.Errorf("the two claims got shares %v, want two different ones", shares)
	}
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	if !slices.Equal(st.DRA.Claims, []string{"default/share-a: gpu-0", "default/share-b: gpu-0"}) && !slices.Equal(st.DRA.Claims, []string{"default/share-b: gpu-0", "default/share-a: gpu-0"}) {
		t.Errorf("/status dra claims %v", st.DRA.Claims)
	}

	// Each claim's status names its share of gpu-0, Ready.
	for _, name := range []string{"share-a", "share-b"} {
		eventually(t, "claim "+name+"'s status.devices: gpu-0 Ready", func() bool {
			d := readyDevice(t, c, name)
			return d != nil && d.Device == "gpu-0" && d.ShareID != nil
		})
	}

	// /metrics: GPU 0's series, once per claim, name each pod and its claim with dcgm-exporter's DRA labels;
	// a released claim's series goes, the other stays.
	claimSeries := func(claim string) string {
		return draSeries(t, agent, "DCGM_FI_DEV_GPU_TEMP", `gpu="0"`, `pod="`+claim+`"`, `namespace="default"`, `container="main"`,
			`dra_claim_name="`+claim+`"`, `dra_claim_namespace="default"`, `dra_driver_name="`+draDriver+`"`,
			`dra_pool_name="`+c.NodeName()+`"`, `dra_device_name="gpu-0"`, `dra_mig_profile=""`)
	}
	listed, err := c.DynamicResources(ctx)
	t.Logf("pod-resources lists DRA devices %q (%v)", listed, err)
	lastLog := time.Now()
	eventually(t, "GPU 0's metrics carry one series per claim", func() bool {
		if claimSeries("share-a") != "" && claimSeries("share-b") != "" {
			return true
		}
		if time.Since(lastLog) > time.Minute {
			// What to look at if it never comes.
			t.Logf("not yet; a series of GPU 0: %s", draSeries(t, agent, "DCGM_FI_DEV_GPU_TEMP", `gpu="0"`))
			lastLog = time.Now()
		}
		return false
	})
	t.Logf("a DRA pod's series: %s", claimSeries("share-a"))
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "share-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	eventually(t, "the released claim's series gone, the other's kept", func() bool {
		return claimSeries("share-a") == "" && claimSeries("share-b") != ""
	})
	t.Logf("MEASURED DRA pod deleted -> its series gone from /metrics: %s", time.Since(released).Round(10*time.Millisecond))
}

// draSeries returns the first series of metric on the agent's /metrics that has all the labels, "" if none.
func draSeries(t *testing.T, agent, metric string, labels ...string) string {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(agent + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s %v", resp.Status, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(l, metric+"{") {
			continue
		}
		ok := true
		for _, lb := range labels {
			ok = ok && (strings.Contains(l, "{"+lb+",") || strings.Contains(l, ","+lb+",") || strings.Contains(l, ","+lb+"}"))
		}
		if ok {
			return l
		}
	}
	return ""
}

// readyDevice is the first entry of the claim's status.devices that is this node's, of gpu.nvidia.com, with
// the condition Ready true; nil when there is none.
func readyDevice(t *testing.T, c *harness.Cluster, claim string) *resourceapi.AllocatedDeviceStatus {
	t.Helper()
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(clusterCtx(t), claim, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range cl.Status.Devices {
		if d.Driver == draDriver && d.Pool == c.NodeName() && meta.IsStatusConditionTrue(d.Conditions, "Ready") {
			return &cl.Status.Devices[i]
		}
	}
	return nil
}

// logClaimStatus prints the claim's status as YAML: what kubectl describe resourceclaim shows of it.
func logClaimStatus(t *testing.T, c *harness.Cluster, claim string) {
	t.Helper()
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(clusterCtx(t), claim, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st := cl.Status.DeepCopy()
	out, err := yaml.Marshal(map[string]any{"name": cl.Name, "namespace": cl.Namespace, "status": st})
	if err != nil {
		t.Fatal(err)
	}
	var managers []string
	for _, m := range cl.ManagedFields {
		managers = append(managers, m.Manager+" ("+string(m.Operation)+" "+m.Subresource+")")
	}
	t.Logf("ResourceClaim %s/%s (field managers %v):\n%s", cl.Namespace, cl.Name, managers, out)
}

// TestClusterDRASlicesComeBack: what restoring the API server's data from a backup taken before the node
// joined leaves the agent (issue 24): no ResourceSlices of its node, and its Node created again, under another
// UID. The agent's ResourceSlice controller still holds the old owner; its slices come back owned by the new
// Node, without the agent restarting, and /status says publishing started over.
func TestClusterDRASlicesComeBack(t *testing.T) {
	c, agent := installDRA(t)
	ctx := clusterCtx(t)
	eventually(t, "the agent's ResourceSlice with 8 GPUs", func() bool { return len(nodeSlice(t, c)) == nodeGPUs })
	pods, err := c.Client.CoreV1().Pods("gpu-agent").List(ctx, metav1.ListOptions{})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("the agent's pod: %d pods (%v)", len(pods.Items), err)
	}
	agentPod := pods.Items[0]

	old, err := c.Node(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lost := time.Now()
	if err := c.Client.CoreV1().Nodes().Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the Node gone", func() bool {
		_, err := c.Node(ctx)
		return apierrors.IsNotFound(err)
	})
	// Created again at once, labels and all, before the pod garbage collector takes the node's pods for orphans.
	fresh, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: old.Name, Labels: old.Labels, Annotations: old.Annotations},
		Spec:       corev1.NodeSpec{PodCIDR: old.Spec.PodCIDR, PodCIDRs: old.Spec.PodCIDRs, ProviderID: old.Spec.ProviderID},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The garbage collector deletes the old Node's slices; a wiped etcd would not have them either.
	list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + draDriver})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list.Items {
		if err := c.Client.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}

	// Back, owned by the new Node, and kept: each check after the restart finds them ours.
	var st struct {
		DRA struct {
			Slices struct {
				NotOurs  string `json:"notOurs"`
				Restarts int    `json:"restarts"`
			} `json:"slices"`
		} `json:"dra"`
	}
	defer func() {
		if t.Failed() {
			var raw map[string]any
			agentGet(t, agent, "/status", &raw)
			t.Logf("/status dra: %v", raw["dra"])
		}
	}()
	eventually(t, "the ResourceSlices back with 8 GPUs, owned by the new Node, and /status saying publishing started over", func() bool {
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
			FieldSelector: "spec.driver=" + draDriver + ",spec.nodeName=" + c.NodeName(),
		})
		if err != nil || len(list.Items) == 0 {
			return false
		}
		devices := 0
		for _, s := range list.Items {
			if len(s.OwnerReferences) != 1 || s.OwnerReferences[0].UID != fresh.UID {
				return false
			}
			devices += len(s.Spec.Devices)
		}
		st.DRA.Slices.Restarts, st.DRA.Slices.NotOurs = 0, ""
		agentGet(t, agent, "/status", &st)
		return devices == nodeGPUs && st.DRA.Slices.Restarts > 0
	})
	t.Logf("MEASURED ResourceSlices and Node lost -> published again, owned by the new Node: %s (restarts %d)",
		time.Since(lost).Round(time.Second), st.DRA.Slices.Restarts)

	p, err := c.Client.CoreV1().Pods("gpu-agent").Get(ctx, agentPod.Name, metav1.GetOptions{})
	if err != nil || p.UID != agentPod.UID {
		t.Fatalf("the agent's pod replaced (%v)", err)
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.RestartCount != 0 {
			t.Errorf("container %s restarted %d times; the agent must publish again without", cs.Name, cs.RestartCount)
		}
	}
}
