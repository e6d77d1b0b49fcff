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

// TestClusterDRAMIGSpares: deploy/examples/dra-mig-on-demand.yaml (spareGPUs: 1) on a simulated DGX H100 under
// the real scheduler and kubelet. One free GPU offers MIG devices on demand (GPU 7, last in the publish order);
// a MIG claim the scheduler allocates lands there, and once it is prepared GPU 6 opens too; the claim's pod
// deleted, one of the two free spares closes after the grace, leaving one; a claim for a whole GPU goes to GPU 0.
func TestClusterDRAMIGSpares(t *testing.T) {
	c, _ := installOverlay(t, "sim-dra-spares-overlay")
	ctx := clusterCtx(t)
	raw, err := os.ReadFile(filepath.Join(repoRoot(), "deploy", "examples", "dra-mig-on-demand.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := yaml.Unmarshal(raw, &cm); err != nil || !strings.Contains(cm.Data["config.yaml"], "spareGPUs: 1") {
		t.Fatalf("the example's ConfigMap (%v) has no spareGPUs: 1:\n%s", err, cm.Data["config.yaml"])
	}
	applied := setConfigMap(t, c, cm.Data)
	eventually(t, "one spare GPU offering MIG devices on demand, the others closed after the grace", func() bool {
		open, closing := spareState(t, c)
		return slices.Equal(open, []int{7}) && len(closing) == 0
	})
	t.Logf("MEASURED example applied -> one spare left (the others closed through a 5 s grace): %s", time.Since(applied).Round(10*time.Millisecond))
	if n := len(nodeSlice(t, c)); n != nodeGPUs+25 {
		t.Errorf("the node publishes %d devices, want 8 whole GPUs and GPU 7's 25 partitions", n)
	}

	// A plain 1g.10gb claim, as NVIDIA's users write one: it can only land on the spare.
	claim := migClaim("small", "1g.10gb", "")
	claim.Spec.Devices.Requests[0].Exactly.Selectors[0].CEL.Expression = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
	took := claimAndRun(t, c, claim)
	t.Logf("MEASURED DRA claim (1g.10gb on the spare) created -> container running: %s", took.Round(10*time.Millisecond))
	cl, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, "small", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || !strings.HasPrefix(cl.Status.Allocation.Devices.Results[0].Device, "gpu-7-mig-1g10gb-") {
		t.Fatalf("claim small: %v, allocation %+v; want a 1g.10gb partition of GPU 7", err, cl.Status.Allocation)
	}
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
	cl, err = c.Client.ResourceV1().ResourceClaims("default").Get(ctx, "whole", metav1.GetOptions{})
	if err != nil || cl.Status.Allocation == nil || cl.Status.Allocation.Devices.Results[0].Device != "gpu-0" {
		t.Errorf("claim whole: %v, allocation %+v; want gpu-0", err, cl.Status.Allocation)
	}
}
