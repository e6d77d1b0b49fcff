//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// The cluster scenarios of the "live inside the cluster" issue: selection by
// labels and ConfigMap edits through the API, state reported back (labels,
// Events, pod status), an upgrade, and RBAC taken away. The agent runs as
// the DaemonSet of deploy/manifests on a simulated DGX A100 that applies
// MIG mode changes at once and keeps its state across agent pods
// (testdata/sim-mig-overlay).

// installMIGCapable installs deploy/manifests with the MIG-capable overlay
// and returns the cluster and the agent's HTTP base URL.
func installMIGCapable(t *testing.T) (*harness.Cluster, string) {
	t.Helper()
	return installOverlay(t, "sim-mig-overlay")
}

// installOverlay starts a cluster and installs the overlay of
// deploy/manifests in testdata/<overlay> with the node layer; it returns the
// cluster and the agent's HTTP base URL.
func installOverlay(t *testing.T, overlay string) (*harness.Cluster, string) {
	t.Helper()
	return installOverlayOn(t, overlay, "")
}

// installOverlayOn is installOverlay on a node whose containerd is the 2.x build in containerd2 ("": 1.6);
// tweak, if given, adjusts the node layer first.
func installOverlayOn(t *testing.T, overlay, containerd2 string, tweak ...func(*harness.Cluster, *harness.NodeLayer)) (*harness.Cluster, string) {
	t.Helper()
	c := startClusterOn(t, containerd2)
	return c, installOverlayIn(t, c, overlay, tweak...)
}

// installOverlayIn installs the overlay in the cluster c, started already, and returns the agent's metrics URL.
func installOverlayIn(t *testing.T, c *harness.Cluster, overlay string, tweak ...func(*harness.Cluster, *harness.NodeLayer)) string {
	t.Helper()
	layer, err := c.NodeLayer()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range tweak {
		f(c, &layer)
	}
	objs, err := c.BuildManifests(filepath.Join("testdata", overlay), layer)
	if err != nil {
		t.Fatal(err)
	}
	crd, err := harness.ReadObjects(filepath.Join("testdata", "servicemonitor-crd.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	installAgent(t, c, layer, append(crd, objs...))
	return fmt.Sprintf("http://127.0.0.1:%d", layer.MetricsPort)
}

// waitAllocatableQ waits until the Node's allocatable resource is n and
// returns how long that took from since.
func waitAllocatableQ(t *testing.T, c *harness.Cluster, resource string, n int64, since time.Time) time.Duration {
	t.Helper()
	if err := c.WaitNodeAllocatable(clusterCtx(t), resource, n); err != nil {
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
	return time.Since(since)
}

// waitOfferedQ waits until the kubelet's device manager offers n devices of
// resource (pod-resources GetAllocatableResources, polled every 200 ms) and
// returns how long that took from since: what the agent serves, before the
// kubelet's next node status sync copies it into the Node's allocatable.
func waitOfferedQ(t *testing.T, c *harness.Cluster, resource string, n int, since time.Time) time.Duration {
	t.Helper()
	if _, err := c.WaitAllocatable(clusterCtx(t), resource, n); err != nil {
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
	return time.Since(since)
}

// setConfigMap replaces the agent's ConfigMap data through the API.
func setConfigMap(t *testing.T, c *harness.Cluster, data map[string]string) time.Time {
	t.Helper()
	ctx := clusterCtx(t)
	cms := c.Client.CoreV1().ConfigMaps("gpu-agent")
	cm, err := cms.Get(ctx, "gpu-agent-config", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data = data
	at := time.Now()
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	return at
}

// labelNode sets (or, with value "", removes) a label on the Node.
func labelNode(t *testing.T, c *harness.Cluster, key, value string) time.Time {
	t.Helper()
	v := any(value)
	if value == "" {
		v = nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{key: v}}})
	at := time.Now()
	if _, err := c.Client.CoreV1().Nodes().Patch(clusterCtx(t), c.NodeName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	return at
}

// nodeLabels reads the Node's labels.
func nodeLabels(t *testing.T, c *harness.Cluster) map[string]string {
	t.Helper()
	n, err := c.Node(clusterCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	return n.Labels
}

// agentGet reads one of the agent's HTTP endpoints.
func agentGet(t *testing.T, base, path string, into any) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(base + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s: %s", path, resp.Status, b)
	}
	if into != nil {
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
	}
}

func agentPost(t *testing.T, base, path, body string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Post(base+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("POST %s %s: %s: %s", path, body, resp.Status, b)
	}
}

// eventually polls cond until it holds or the cluster step timeout passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(clusterStepTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not seen in %s: %s", clusterStepTimeout, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

const (
	timeSliced4 = "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 4\n"
	// A mig-parted file shaped like the GPU Operator's default-mig-parted-config (our own entries).
	operatorMIGConfigs = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  all-balanced:
  - device-filter: ["0x20B010DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.5gb": 2
      "2g.10gb": 1
      "3g.20gb": 1
`
)

// TestClusterSelectionByAPI: GFD labels appear and a pod selecting the GPU
// product schedules; a ConfigMap edit through the API reaches the Node's
// allocatable; labelling the Node nvidia.com/mig.config repartitions it
// with the GPU Operator's kind of ConfigMap, and mig.config.state says so.
func TestClusterSelectionByAPI(t *testing.T) {
	c, agent := installMIGCapable(t)

	// GFD's labels, and a pod written for them.
	var product string
	eventually(t, "GFD labels on the Node", func() bool {
		l := nodeLabels(t, c)
		product = l["nvidia.com/gpu.product"]
		return product != "" && l["nvidia.com/gpu.count"] == "8" && l["nvidia.com/gpu.present"] == "true"
	})
	t.Logf("node labels: %v", gfdLabels(nodeLabels(t, c)))
	ctx := clusterCtx(t)
	d := gpuDeployment("by-product", 1, 1)
	d.Spec.Template.Spec.NodeSelector = map[string]string{"nvidia.com/gpu.product": product}
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=by-product", 1); err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	if err := c.Client.AppsV1().Deployments("default").Delete(ctx, "by-product", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())

	// A ConfigMap edit through the API: time-slicing ×4.
	edited := setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	offered := waitOfferedQ(t, c, gpuResource, 4*nodeGPUs, edited)
	t.Logf("MEASURED ConfigMap edit through the API -> kubelet offers %d %s (pod-resources): %s", 4*nodeGPUs, gpuResource, offered.Round(10*time.Millisecond))
	took := waitAllocatableQ(t, c, gpuResource, 4*nodeGPUs, edited)
	t.Logf("MEASURED ConfigMap edit through the API -> Node allocatable %s=%d: %s", gpuResource, 4*nodeGPUs, took.Round(10*time.Millisecond))
	if l := nodeLabels(t, c); l["nvidia.com/gpu.sharing-strategy"] != "time-slicing" || l["nvidia.com/gpu.replicas"] != "4" {
		t.Errorf("sharing labels after the edit: %v", gfdLabels(l))
	}

	// The GPU Operator's way: mig-configs in the ConfigMap, a label picks the layout.
	setConfigMap(t, c, map[string]string{"config.yaml": "version: v1\nconfigs:\n  default: {}\n", "mig-parted.yaml": operatorMIGConfigs})
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())
	labelled := labelNode(t, c, "nvidia.com/mig.config", "all-balanced")
	offered = waitOfferedQ(t, c, "nvidia.com/mig-3g.20gb", nodeGPUs, labelled)
	t.Logf("MEASURED label nvidia.com/mig.config=all-balanced -> repartitioned and served, kubelet offers %d nvidia.com/mig-3g.20gb (pod-resources): %s", nodeGPUs, offered.Round(10*time.Millisecond))
	took = waitAllocatableQ(t, c, "nvidia.com/mig-3g.20gb", nodeGPUs, labelled)
	for res, n := range map[string]int64{"nvidia.com/mig-1g.5gb": 2 * nodeGPUs, "nvidia.com/mig-2g.10gb": nodeGPUs, gpuResource: 0} {
		if err := c.WaitNodeAllocatable(clusterCtx(t), res, n); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("MEASURED label nvidia.com/mig.config=all-balanced -> MIG devices in the Node's allocatable: %s", took.Round(10*time.Millisecond))
	eventually(t, "nvidia.com/mig.config.state=success", func() bool {
		return nodeLabels(t, c)["nvidia.com/mig.config.state"] == "success"
	})
	var st struct {
		Cluster clusterStatus `json:"cluster"`
	}
	agentGet(t, agent, "/status", &st)
	if st.Cluster.API != "reachable" || st.Cluster.Labels.Error != "" {
		t.Errorf("/status cluster %+v, want reachable, labels written", st.Cluster)
	}
	// Labels it no longer wants go; labels it never owned stay.
	if l := nodeLabels(t, c); l["nvidia.com/gpu.replicas"] != "1" || l["nvidia.com/mig-1g.5gb.count"] != "16" || l["nvidia.com/gpu.present"] != "true" {
		t.Errorf("labels after repartitioning: %v", gfdLabels(l))
	}
}

// TestClusterConfigMapMountedVolume measures the same edit through the
// mounted volume only (the agent without --configmap), for comparison: it
// waits for the kubelet's volume sync.
func TestClusterConfigMapMountedVolume(t *testing.T) {
	c, _ := installOverlay(t, "sim-volume-only-overlay")
	edited := setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	offered := waitOfferedQ(t, c, gpuResource, 4*nodeGPUs, edited)
	t.Logf("MEASURED ConfigMap edit through the mounted volume only -> kubelet offers %d %s (pod-resources): %s", 4*nodeGPUs, gpuResource, offered.Round(10*time.Millisecond))
	took := waitAllocatableQ(t, c, gpuResource, 4*nodeGPUs, edited)
	t.Logf("MEASURED ConfigMap edit through the mounted volume only -> Node allocatable %s=%d: %s (this kubelet syncs every 10s; the default is 1m)",
		gpuResource, 4*nodeGPUs, took.Round(10*time.Millisecond))
}

// TestClusterFaultsUpgradeAndRBAC: a fatal XID on a GPU a pod holds takes it
// out of the Node's allocatable, records a Node Event and shows in the pod's
// allocatedResourcesStatus; a DaemonSet rolling update to a new image leaves
// running pods their devices; with patch on nodes revoked the agent keeps
// serving and says why its labels are stale.
func TestClusterFaultsUpgradeAndRBAC(t *testing.T) {
	c, agent := installMIGCapable(t)
	ctx := clusterCtx(t)
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("holder", 1, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=holder", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	holder := pods[0]
	held, err := c.PodDevicesOf(ctx, &holder, gpuResource)
	if err != nil || len(held) != 1 {
		t.Fatalf("holder holds %v (%v)", held, err)
	}
	idx := gpuIndex(t, agent, held[0])

	// A fatal XID on the held GPU.
	injected := time.Now()
	agentPost(t, agent, "/sim/xid", fmt.Sprintf(`{"gpu":%d,"xid":48}`, idx))
	took := waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, injected)
	t.Logf("MEASURED fatal XID -> Node allocatable %d: %s", nodeGPUs-1, took.Round(10*time.Millisecond))
	eventually(t, "a GPUUnhealthy Node Event", func() bool {
		evs, err := c.Client.CoreV1().Events("").List(clusterCtx(t), metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,reason=GPUUnhealthy"})
		return err == nil && slices.ContainsFunc(evs.Items, func(e corev1.Event) bool { return strings.Contains(e.Message, held[0]) })
	})
	eventually(t, "the holding pod's allocatedResourcesStatus shows the device unhealthy", func() bool {
		p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), holder.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, cs := range p.Status.ContainerStatuses {
			for _, rs := range cs.AllocatedResourcesStatus {
				for _, r := range rs.Resources {
					if string(r.ResourceID) == held[0] && r.Health == corev1.ResourceHealthStatusUnhealthy {
						return true
					}
				}
			}
		}
		return false
	})
	agentPost(t, agent, "/sim/reset", fmt.Sprintf(`{"gpu":%d}`, idx))
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())

	// A rolling update to a new image: the holder keeps its container and device.
	container := runningContainerID(t, c, holder.Name)
	upgradeAgentImage(t, c, "v0.1.1")
	p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), holder.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := runningContainerID(t, c, holder.Name); got != container {
		t.Fatalf("holder's container %s replaced by %s during the upgrade", container, got)
	}
	if still, err := c.PodDevicesOf(clusterCtx(t), p, gpuResource); err != nil || !slices.Equal(still, held) {
		t.Fatalf("after the upgrade the holder holds %v (%v), want %v", still, err, held)
	}
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())

	// patch nodes revoked: labels can no longer be written; the agent
	// serves on and says so.
	revokeNodePatch(t, c)
	setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	// The GPU the holder has whole is not offered as replicas while it
	// holds it: that would share a GPU its container was given alone.
	waitAllocatableQ(t, c, gpuResource, 4*(nodeGPUs-1), time.Now())
	var st struct {
		Cluster clusterStatus `json:"cluster"`
	}
	eventually(t, "/status reports the denial", func() bool {
		agentGet(t, agent, "/status", &st)
		return strings.Contains(st.Cluster.Labels.Error, "forbidden")
	})
	t.Logf("/status cluster: %+v", st.Cluster)
	if l := nodeLabels(t, c); l["nvidia.com/gpu.replicas"] == "4" {
		t.Errorf("labels were written although patch was revoked: %v", gfdLabels(l))
	}
}

// gpuIndex finds a GPU's index from the agent's /status.
func gpuIndex(t *testing.T, agent, uuid string) int {
	t.Helper()
	var st struct {
		GPUs []struct {
			Index int    `json:"index"`
			UUID  string `json:"uuid"`
		} `json:"gpus"`
	}
	agentGet(t, agent, "/status", &st)
	for _, g := range st.GPUs {
		if g.UUID == uuid {
			return g.Index
		}
	}
	t.Fatalf("GPU %s not in /status", uuid)
	return -1
}

// runningContainerID is the container ID of a pod's first container.
func runningContainerID(t *testing.T, c *harness.Cluster, pod string) string {
	t.Helper()
	p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].State.Running == nil {
		t.Fatalf("pod %s not running: %s", pod, harness.DescribeAPIPod(p))
	}
	return p.Status.ContainerStatuses[0].ContainerID
}

// upgradeAgentImage imports the agent image under a new tag, sets it on the
// DaemonSet, and waits until the new pod serves.
func upgradeAgentImage(t *testing.T, c *harness.Cluster, tag string) {
	t.Helper()
	ctx := clusterCtx(t)
	dss := c.Client.AppsV1().DaemonSets("gpu-agent")
	ds, err := dss.Get(ctx, "gpu-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ref := ds.Spec.Template.Spec.Containers[0].Image
	if i := strings.LastIndex(ref, ":"); i > 0 {
		ref = ref[:i]
	}
	ref += ":" + tag
	spec := clusterInputs(t).agentImage
	spec.Ref = ref
	tarball := filepath.Join(c.RunDir(), "gpu-agent-image-"+tag+".tar")
	if err := harness.WriteDockerArchive(tarball, spec); err != nil {
		t.Fatal(err)
	}
	if err := c.ImportImage(ctx, tarball); err != nil {
		t.Fatal(err)
	}
	ds.Spec.Template.Spec.Containers[0].Image = ref
	if _, err := dss.Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	pod, err := c.WaitPodMatching(ctx, "gpu-agent", "app.kubernetes.io/name=gpu-agent", "the new image running and ready", func(p *corev1.Pod) bool {
		if p.Spec.Containers[0].Image != ref || p.DeletionTimestamp != nil {
			return false
		}
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	if err != nil {
		dumpPods(t, c, "gpu-agent")
		t.Fatal(err)
	}
	t.Logf("rolling update to %s: pod %s ready after %s", ref, pod.Name, time.Since(started).Round(10*time.Millisecond))
}

// revokeNodePatch takes patch on nodes away from the agent's ClusterRole.
func revokeNodePatch(t *testing.T, c *harness.Cluster) {
	t.Helper()
	ctx := clusterCtx(t)
	crs := c.Client.RbacV1().ClusterRoles()
	cr, err := crs.Get(ctx, "gpu-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range cr.Rules {
		if slices.Contains(r.Resources, "nodes") {
			cr.Rules[i].Verbs = slices.DeleteFunc(slices.Clone(r.Verbs), func(v string) bool { return v == "patch" })
		}
	}
	if _, err := crs.Update(ctx, cr, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// gfdLabels keeps the nvidia.com/ labels, for logs.
func gfdLabels(l map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range l {
		if strings.HasPrefix(k, "nvidia.com/") {
			out[k] = v
		}
	}
	return out
}
