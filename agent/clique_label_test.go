package agent

import (
	"testing"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// A fabric-attached node is labelled with its clique as NVIDIA names it;
// a GPU whose registration is not complete leaves the node unlabelled,
// and so does a node without a fabric.
func TestCliqueLabel(t *testing.T) {
	n, err := sim.New("gb200-tray", sim.WithClique(3))
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	labels := func() map[string]string {
		inv, err := gpu.New(n, gpu.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return NodeLabels(inv, config.Selected{}, nil)
	}
	if got, want := labels()[LabelClique], sim.ClusterUUID(3).String()+".3"; got != want {
		t.Errorf("clique label %q, want %q", got, want)
	}
	if err := n.SetFabricFault(1, sim.FabricFault{State: 2}); err != nil {
		t.Fatal(err)
	}
	if got, ok := labels()[LabelClique]; ok {
		t.Errorf("clique label %q with GPU 1's registration in progress", got)
	}
	inv, err := gpu.New(simNode(t, "pcie-4gpu"), gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := NodeLabels(inv, config.Selected{}, nil)[LabelClique]; ok {
		t.Errorf("a node without a fabric labelled %q", got)
	}
}
