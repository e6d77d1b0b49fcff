package agent

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/mig"
)

// While the GPU Operator runs mig-manager on the node, gpu-agent does not
// repartition (or reset) a GPU, and says why; once it is off, the layout
// is applied.
func TestConflictMIGManager(t *testing.T) {
	node := simNode(t, "dgx-a100")
	c := &cluster{}
	h := newHarness(t, node, withMIG(), withReset(), withCluster(c))
	h.step(LabelsChanged{Labels: map[string]string{LabelDeployMIGManager: "true"}})
	h.config(a100Layout(""))
	for i := range 8 {
		st := h.migState(i)
		if st.Phase != mig.PhasePending || !strings.Contains(st.Reason, "mig-manager runs on this node") {
			t.Fatalf("GPU %d: %+v, want pending on mig-manager", i, st)
		}
		if cur, pending := migMode(t, node, i); cur != nvml.DEVICE_MIG_DISABLE || pending != nvml.DEVICE_MIG_DISABLE {
			t.Fatalf("GPU %d's MIG mode was changed under mig-manager", i)
		}
	}
	if cf := h.a.Status().Conflicts; len(cf) != 1 || !strings.Contains(cf[0], LabelDeployMIGManager) {
		t.Errorf("conflicts %q, want mig-manager named", cf)
	}
	if ev := strings.Join(c.took(), "\n"); !strings.Contains(ev, "Warning "+ReasonConflict+": mig-manager") {
		t.Errorf("events:\n%s\nwant a %s Event naming mig-manager", ev, ReasonConflict)
	}
	h.step(LabelsChanged{Labels: map[string]string{LabelDeployMIGManager: "false"}})
	for i := range 8 {
		if st := h.migState(i); st.Phase != mig.PhaseApplied {
			t.Fatalf("mig-manager off: GPU %d %+v, want applied", i, st)
		}
	}
	if cf := h.a.Status().Conflicts; len(cf) != 0 {
		t.Errorf("conflicts %q after mig-manager left", cf)
	}
}

// Where GFD runs, its labels are its own: gpu-agent writes only the others.
func TestConflictGFDLabels(t *testing.T) {
	c := &cluster{}
	h := newHarness(t, simNode(t, "dgx-h100-mig"), withMIG(), withCluster(c))
	h.config(mixedNoMIG)
	if c.labels["nvidia.com/gpu.product"] == "" {
		t.Fatalf("without GFD: labels %v, want nvidia.com/gpu.product", c.labels)
	}
	h.step(LabelsChanged{Labels: map[string]string{LabelDeployGFD: "true"}})
	for k := range c.labels {
		if gfdLabel(k) {
			t.Errorf("with GFD on the node gpu-agent still writes %s", k)
		}
	}
	if cf := h.a.Status().Conflicts; len(cf) != 1 || !strings.Contains(cf[0], "GPU feature discovery") {
		t.Errorf("conflicts %q, want GFD named", cf)
	}
	h.step(LabelsChanged{Labels: map[string]string{}})
	if c.labels["nvidia.com/gpu.product"] == "" {
		t.Errorf("GFD gone: labels %v, want nvidia.com/gpu.product back", c.labels)
	}
}

// A resource another device plugin serves on the kubelet is not offered
// by gpu-agent until that plugin is gone; the others are.
func TestConflictForeignPlugin(t *testing.T) {
	c := &cluster{}
	foreign := map[string]string{ResourceGPU: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock", "nvidia.com/other": "/x/nvidia-other.sock"}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withCluster(c), func(h *harness) {
		h.opts.ForeignPlugins = func() map[string]string { return foreign }
	})
	h.config(sliced2)
	if _, ok := h.pub.last().Resources[ResourceGPU]; ok {
		t.Errorf("%s handed to the kubelet while another plugin serves it", ResourceGPU)
	}
	cf := h.a.Status().Conflicts
	if len(cf) != 1 || !strings.Contains(cf[0], "another device plugin serves "+ResourceGPU) {
		t.Errorf("conflicts %q, want %s named (and not nvidia.com/other, which gpu-agent does not serve)", cf, ResourceGPU)
	}
	if ev := strings.Join(c.took(), "\n"); !strings.Contains(ev, "Warning "+ReasonConflict+": another device plugin serves "+ResourceGPU) {
		t.Errorf("events:\n%s\nwant a %s Event", ev, ReasonConflict)
	}
	foreign = nil
	h.step(Tick{})
	if got := h.count(ResourceGPU); got != 8 {
		t.Errorf("other plugin gone: %d %s devices, want 8 (4 GPUs x 2 replicas)", got, ResourceGPU)
	}
}
