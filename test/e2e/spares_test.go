//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// exampleConfig is the data of the ConfigMap deploy/examples/name, whose config.yaml must hold want.
func exampleConfig(t *testing.T, name, want string) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(repoRoot(), "deploy", "examples", name))
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := yaml.Unmarshal(raw, &cm); err != nil || !strings.Contains(cm.Data["config.yaml"], want) {
		t.Fatalf("the ConfigMap of %s (%v) has no %q:\n%s", name, err, want, cm.Data["config.yaml"])
	}
	return cm.Data
}

// smallOnSpare runs a pod with a plain 1g.10gb claim ("small"), as NVIDIA's users write one, and checks that it
// got a MIG device of GPU 7, the spare.
func smallOnSpare(t *testing.T, c *harness.Cluster) {
	t.Helper()
	claim := migClaim("small", "1g.10gb", "")
	claim.Spec.Devices.Requests[0].Exactly.Selectors[0].CEL.Expression = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
	took := claimAndRun(t, c, claim)
	t.Logf("MEASURED DRA claim (1g.10gb on the spare) created -> container running: %s", took.Round(10*time.Millisecond))
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(clusterCtx(t), "small", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || !strings.HasPrefix(cl.Status.Allocation.Devices.Results[0].Device, "gpu-7-mig-1g10gb-") {
		t.Fatalf("claim small: %v, allocation %+v; want a 1g.10gb MIG device of GPU 7", err, cl.Status.Allocation)
	}
}

// spareState reads which GPUs of the node offer MIG devices on demand, and which of those are closing (their
// partitions tainted gpu.nvidia.com/closing), from the ResourceSlices.
func spareState(t *testing.T, c *harness.Cluster) (open, closing []int) {
	t.Helper()
	for name, d := range nodeSlice(t, c) {
		var gpu int
		if _, err := fmt.Sscanf(name, "gpu-%d-mig-", &gpu); err != nil || attr(d, "uuid") != "" {
			continue // a whole GPU, or a MIG device that exists
		}
		tainted := slices.ContainsFunc(d.Taints, func(tt resourceapi.DeviceTaint) bool { return tt.Key == draDriver+"/closing" })
		list := &open
		if tainted {
			list = &closing
		}
		if !slices.Contains(*list, gpu) {
			*list = append(*list, gpu)
		}
	}
	slices.Sort(open)
	slices.Sort(closing)
	return open, closing
}

// TestClusterDRAMIGSpares: deploy/examples/dra-mig-on-demand-every-placement.yaml (spareGPUs: 1) on a simulated DGX H100 under
// the real scheduler and kubelet. One free GPU offers MIG devices on demand (GPU 7, last in the publish order);
// a MIG claim the scheduler allocates lands there, and once it is prepared GPU 6 opens too; the claim's pod
// deleted, one of the two free spares closes after the grace, leaving one; a claim for a whole GPU goes to GPU 0.
func TestClusterDRAMIGSpares(t *testing.T) {
	c, agent := installOverlay(t, "sim-dra-spares-overlay")
	ctx := clusterCtx(t)
	applied := setConfigMap(t, c, exampleConfig(t, "dra-mig-on-demand-every-placement.yaml", "spareGPUs: 1"))
	// On counters under a 1.36 scheduler, /status says what that costs and what to use instead.
	sv, err := c.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(sv.GitVersion, "v1.36.") {
		eventually(t, "a /status warning that MIG on demand on counters is slow on "+sv.GitVersion, func() bool {
			var st struct {
				Config struct {
					Warnings []string `json:"warnings"`
				} `json:"config"`
			}
			agentGet(t, agent, "/status", &st)
			return slices.ContainsFunc(st.Config.Warnings, func(w string) bool {
				return strings.Contains(w, "the control plane is Kubernetes "+sv.GitVersion) && strings.Contains(w, "set spareLayout")
			})
		})
		t.Logf("/status warns that MIG on demand on counters is slow on %s", sv.GitVersion)
	}
	eventually(t, "one spare GPU offering MIG devices on demand, the others closed after the grace", func() bool {
		open, closing := spareState(t, c)
		return slices.Equal(open, []int{7}) && len(closing) == 0
	})
	t.Logf("MEASURED example applied -> one spare left (the others closed through a 5 s grace): %s", time.Since(applied).Round(10*time.Millisecond))
	if n := len(nodeSlice(t, c)); n != nodeGPUs+19 {
		t.Errorf("the node publishes %d devices, want 8 whole GPUs and GPU 7's 19 partitions", n)
	}

	// A plain 1g.10gb claim, as NVIDIA's users write one: it can only land on the spare.
	smallOnSpare(t, c)
	eventually(t, "GPU 6 opened once the spare was taken", func() bool {
		open, closing := spareState(t, c)
		return slices.Equal(open, []int{6, 7}) && len(closing) == 0
	})

	released := time.Now()
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "small", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "one spare again (GPU 7), GPU 6 closed after the grace", func() bool {
		open, closing := spareState(t, c)
		return slices.Equal(open, []int{7}) && len(closing) == 0
	})
	t.Logf("MEASURED MIG claim's pod deleted -> the surplus spare closed: %s", time.Since(released).Round(10*time.Millisecond))

	// A whole GPU goes first in the publish order, not to the spare.
	claimAndRun(t, c, wholeGPUClaim("whole"))
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, "whole", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || cl.Status.Allocation.Devices.Results[0].Device != "gpu-0" {
		t.Errorf("claim whole: %v, allocation %+v; want gpu-0", err, cl.Status.Allocation)
	}
}

// layoutState reads, per GPU of the node, what it offers: whole (and whether tainted gpu.nvidia.com/closing) and
// how many partitions (MIG devices made on demand, not yet made or made, and whether tainted); and how many counter
// sets the node's ResourceSlices carry.
func layoutState(t *testing.T, c *harness.Cluster) (faces map[int]string, counterSets int) {
	t.Helper()
	list, err := c.Client.ResourceV1().ResourceSlices().List(clusterCtx(t), metav1.ListOptions{
		FieldSelector: "spec.driver=" + draDriver + ",spec.nodeName=" + c.NodeName(),
	})
	if err != nil {
		t.Fatal(err)
	}
	type face struct {
		whole, wholeTainted, partsTainted bool
		parts                             int
	}
	byGPU := map[int]*face{}
	for _, s := range list.Items {
		counterSets += len(s.Spec.SharedCounters)
		for _, d := range s.Spec.Devices {
			var gpu int
			if _, err := fmt.Sscanf(d.Name, "gpu-%d", &gpu); err != nil {
				continue
			}
			if byGPU[gpu] == nil {
				byGPU[gpu] = &face{}
			}
			f := byGPU[gpu]
			tainted := slices.ContainsFunc(d.Taints, func(tt resourceapi.DeviceTaint) bool { return tt.Key == draDriver+"/closing" })
			if d.Name == fmt.Sprintf("gpu-%d", gpu) {
				f.whole, f.wholeTainted = true, tainted
			} else {
				f.parts++
				f.partsTainted = f.partsTainted || tainted
			}
		}
	}
	faces = map[int]string{}
	for gpu, f := range byGPU {
		var s []string
		if f.whole {
			s = append(s, map[bool]string{false: "whole", true: "whole(tainted)"}[f.wholeTainted])
		}
		if f.parts > 0 {
			s = append(s, fmt.Sprintf("%d parts%s", f.parts, map[bool]string{false: "", true: "(tainted)"}[f.partsTainted]))
		}
		faces[gpu] = strings.Join(s, "+")
	}
	return faces, counterSets
}

// TestClusterDRAMIGSpareLayout: deploy/examples/dra-mig-on-demand.yaml (spareGPUs: 1, each model's balanced layout) on a
// simulated DGX H100 under the real scheduler and kubelet. Once settled, GPU 7 offers its layout's 4 MIG devices
// and not itself whole, the others are whole, and the node publishes no counter set. A 1g.10gb claim lands on GPU
// 7; GPU 6 is then offered whole, tainted, for the grace, then offers its layout. The claim's pod deleted, one of
// the two free spares goes back to whole through the grace.
func TestClusterDRAMIGSpareLayout(t *testing.T) {
	c, _ := installOverlay(t, "sim-dra-spares-overlay")
	ctx := clusterCtx(t)
	cm := exampleConfig(t, "dra-mig-on-demand.yaml", "spareLayout:")
	settled := func(spares ...int) func() bool {
		return func() bool {
			faces, sets := layoutState(t, c)
			for gpu := range nodeGPUs {
				want := "whole"
				if slices.Contains(spares, gpu) {
					want = "4 parts"
				}
				if faces[gpu] != want {
					return false
				}
			}
			return sets == 0
		}
	}
	applied := setConfigMap(t, c, cm)
	eventually(t, "GPU 7 offering its layout, the others whole, no counter set", settled(7))
	t.Logf("MEASURED example applied -> settled, no counters (a 5 s grace): %s", time.Since(applied).Round(10*time.Millisecond))

	smallOnSpare(t, c)
	taken := time.Now()
	eventually(t, "GPU 6 offering its layout once the spare was taken", func() bool {
		faces, sets := layoutState(t, c)
		return faces[6] == "4 parts" && faces[7] == "4 parts" && sets == 0
	})
	t.Logf("MEASURED spare taken -> the next spare's layout offered (through the 5 s grace): %s", time.Since(taken).Round(10*time.Millisecond))

	released := time.Now()
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "small", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "one spare again (GPU 7), GPU 6 whole after the grace", settled(7))
	t.Logf("MEASURED MIG claim's pod deleted -> the surplus spare whole again: %s", time.Since(released).Round(10*time.Millisecond))
}
