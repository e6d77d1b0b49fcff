//go:build e2e && k8s134

package e2e

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// What only an API server of the Kubernetes users run today does: on 1.34 (and 1.35) DRA is v1, and
// partitionable devices, consumable capacity, extended-resource mapping and device taints are alpha and off,
// so the API server drops their fields from the slices the driver writes. run.sh builds these tests only with
// E2E_K8S=1.34 (make e2e-k8s134), against the kubelet and control plane of k8s134/go.mod.

// agentPod is the gpu-agent DaemonSet's pod.
func agentPod(t *testing.T, c *harness.Cluster) *corev1.Pod {
	t.Helper()
	pods, err := c.Client.CoreV1().Pods("gpu-agent").List(clusterCtx(t), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		if slices.ContainsFunc(pods.Items[i].Spec.Containers, func(ct corev1.Container) bool { return ct.Name == "gpu-agent" }) {
			return &pods.Items[i]
		}
	}
	t.Fatalf("no gpu-agent pod among %d in namespace gpu-agent", len(pods.Items))
	return nil
}

// leftOut is /status dra.slices.leftOut: the features the API server drops, by name, with what each leaves out.
func leftOut(t *testing.T, agent string) map[string]string {
	t.Helper()
	var st struct {
		DRA struct {
			Slices struct {
				LeftOut []struct {
					Feature string `json:"feature"`
					Devices string `json:"devices"`
				} `json:"leftOut"`
			} `json:"slices"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	out := map[string]string{}
	for _, l := range st.DRA.Slices.LeftOut {
		out[l.Feature] = l.Devices
	}
	return out
}

// TestClusterK8s134DRA: against a v1.34 kube-apiserver, scheduler and kubelet, on a simulated DGX H100 whose
// idle GPUs the driver offers whole and as MIG devices made on demand. The API server drops the shared
// counters; the agent warns naming DRAPartitionableDevices, and leaves the on-demand MIG devices and counter
// sets out while the whole GPUs stay. A layout's MIG devices (static MIG, GPU 0) are published; a claim for a
// whole GPU and one for a static MIG device allocate and their pods run. A fatal XID's taint is dropped too:
// the agent warns naming DRADeviceTaints and leaves the unhealthy GPU out until it is reset. Time-slicing the
// GPUs drops their sharing: DRAConsumableCapacity is named and the shared GPUs leave the slice.
func TestClusterK8s134DRA(t *testing.T) {
	c, agent := installOverlay(t, "sim-dra-h100-overlay")
	ctx := clusterCtx(t)

	// The control plane and kubelet are the ones run.sh built for 1.34, not the suite's.
	want := os.Getenv("E2E_K8S_VERSION")
	if !strings.HasPrefix(want, "v1.34.") {
		t.Fatalf("E2E_K8S_VERSION=%q: run through run.sh with E2E_K8S=1.34", want)
	}
	v, err := c.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	node, err := c.Node(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v.GitVersion != want || node.Status.NodeInfo.KubeletVersion != want {
		t.Fatalf("kube-apiserver %s, kubelet %s; want both %s", v.GitVersion, node.Status.NodeInfo.KubeletVersion, want)
	}
	t.Logf("kube-apiserver %s, kubelet %s", v.GitVersion, node.Status.NodeInfo.KubeletVersion)

	// The counters are dropped: the MIG devices made on demand go, the whole GPUs stay.
	var devs map[string]resourceapi.Device
	eventually(t, "DRAPartitionableDevices left out on /status, and a slice of the 8 whole GPUs alone", func() bool {
		devs = nodeSlice(t, c)
		_, partitions := leftOut(t, agent)["DRAPartitionableDevices"]
		return partitions && len(devs) == nodeGPUs && !slices.ContainsFunc(slices.Collect(maps.Keys(devs)), func(n string) bool { return strings.Contains(n, "-mig-") })
	})
	for name, d := range devs {
		if attr(d, "type") != "gpu" || len(d.ConsumesCounters) > 0 {
			t.Errorf("%s in the slice: type %q, consumes %v; want a whole GPU drawing on no counters", name, attr(d, "type"), d.ConsumesCounters)
		}
	}
	warned := agentLogHas(t, c, "DRAPartitionableDevices")
	t.Logf("the agent's warning: %s", warned)

	// A layout on GPU 0 (static MIG): two 3g.40gb devices published in its place.
	setConfigMap(t, c, map[string]string{"config.yaml": `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - devices: [0]
        mig-enabled: true
        mig-devices:
          "3g.40gb": 2
`})
	var mig []string
	eventually(t, "GPU 0's two 3g.40gb MIG devices in the slice, beside GPUs 1-7", func() bool {
		devs = nodeSlice(t, c)
		mig = nil
		for name, d := range devs {
			if attr(d, "type") == "mig" && attr(d, "profile") == "3g.40gb" {
				mig = append(mig, name)
			}
		}
		_, whole0 := devs["gpu-0"]
		return len(mig) == 2 && len(devs) == nodeGPUs-1+2 && !whole0
	})
	t.Logf("static MIG devices: %v", mig)

	took := claimAndRun(t, c, wholeGPUClaim("one-gpu"))
	t.Logf("MEASURED (1.34) DRA claim (whole GPU) created -> container running: %s", took.Round(10*time.Millisecond))
	took = claimAndRun(t, c, migClaim("three", "3g.40gb", sliceGPUUUID(t, c, 0)))
	t.Logf("MEASURED (1.34) DRA claim (static MIG 3g.40gb) created -> container running: %s", took.Round(10*time.Millisecond))
	allocated := map[string]string{}
	for _, name := range []string{"one-gpu", "three"} {
		cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil || cl.Status.Allocation == nil || len(cl.Status.Allocation.Devices.Results) != 1 {
			t.Fatalf("claim %s: %+v (%v)", name, cl.Status, err)
		}
		allocated[name] = cl.Status.Allocation.Devices.Results[0].Device
	}
	if d := devs[allocated["one-gpu"]]; attr(d, "type") != "gpu" {
		t.Errorf("claim one-gpu got %s, not a whole GPU", allocated["one-gpu"])
	}
	if !slices.Contains(mig, allocated["three"]) {
		t.Errorf("claim three got %s, not one of GPU 0's 3g.40gb devices %v", allocated["three"], mig)
	}
	var st struct {
		DRA struct {
			Claims []string `json:"claims"`
		} `json:"dra"`
	}
	agentGet(t, agent, "/status", &st)
	for name, dev := range allocated {
		if w := "default/" + name + ": " + dev; !slices.Contains(st.DRA.Claims, w) {
			t.Errorf("/status dra claims %v, want %q", st.DRA.Claims, w)
		}
	}

	// A fatal XID on a GPU no claim holds: its taint would be dropped, so the GPU leaves the slice.
	victim := 7
	if allocated["one-gpu"] == fmt.Sprintf("gpu-%d", victim) {
		victim = 6
	}
	name := fmt.Sprintf("gpu-%d", victim)
	agentPost(t, agent, "/sim/xid", fmt.Sprintf(`{"gpu":%d,"xid":48}`, victim))
	eventually(t, "DRADeviceTaints left out on /status, and the unhealthy "+name+" out of the slice", func() bool {
		_, taints := leftOut(t, agent)["DRADeviceTaints"]
		_, listed := nodeSlice(t, c)[name]
		return taints && !listed
	})
	warned = agentLogHas(t, c, "DRADeviceTaints")
	t.Logf("the agent's warning: %s", warned)
	agentPost(t, agent, "/sim/reset", fmt.Sprintf(`{"gpu":%d}`, victim))
	eventually(t, name+" back in the slice after the reset, with no taint", func() bool {
		d, ok := nodeSlice(t, c)[name]
		return ok && len(d.Taints) == 0
	})

	// Time-slicing the whole GPUs: without consumable capacity a shared device cannot be offered to several
	// claims, so the whole GPUs leave the slice and the layout's MIG devices, which the config does not share,
	// stay.
	setConfigMap(t, c, map[string]string{"config.yaml": `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 2
    mig:
      strategy: mixed
      devices:
      - devices: [0]
        mig-enabled: true
        mig-devices:
          "3g.40gb": 2
`})
	eventually(t, "DRAConsumableCapacity left out on /status, and only GPU 0's MIG devices in the slice", func() bool {
		_, sharing := leftOut(t, agent)["DRAConsumableCapacity"]
		devs = nodeSlice(t, c)
		return sharing && len(devs) == len(mig) && !slices.ContainsFunc(slices.Collect(maps.Values(devs)), func(d resourceapi.Device) bool {
			return attr(d, "type") != "mig"
		})
	})
	warned = agentLogHas(t, c, "DRAConsumableCapacity")
	t.Logf("the agent's warning: %s", warned)
}

// agentLogHas waits for the agent's warning naming feature in its log, and returns that line.
func agentLogHas(t *testing.T, c *harness.Cluster, feature string) string {
	t.Helper()
	p := agentPod(t, c)
	var line string
	eventually(t, "the agent's log warns that the API server drops "+feature, func() bool {
		log, err := c.ContainerLog(p, "gpu-agent")
		if err != nil {
			t.Logf("agent log: %v", err)
			return false
		}
		for l := range strings.Lines(log) {
			if strings.Contains(l, "WARN") && strings.Contains(l, feature) && strings.Contains(l, "left out") {
				line = strings.TrimSpace(l)
				return true
			}
		}
		return false
	})
	return line
}
