package topology

import (
	"reflect"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/plugin/topology/topotest"
)

// The hand-built profiles must describe the simulated nodes, or the property
// tests and benchmarks would run on topologies no agent ever sees.
func TestProfilesMatchSim(t *testing.T) {
	for _, p := range topotest.Profiles() {
		t.Run(p.Name, func(t *testing.T) {
			node, err := sim.New(p.Name)
			if err != nil {
				t.Fatal(err)
			}
			if ret := node.Init(); ret != nvml.SUCCESS {
				t.Fatalf("Init: %v", ret)
			}
			inv, err := gpu.New(node, gpu.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if len(inv.Errors) > 0 {
				t.Fatalf("inventory errors: %v", inv.Errors)
			}
			if !reflect.DeepEqual(inv.Topology, p.Topology) {
				t.Fatalf("topology differs\nsim:  %+v\nhand: %+v", inv.Topology, p.Topology)
			}
			numa := make([]int, len(inv.GPUs))
			for i, g := range inv.GPUs {
				numa[i] = g.NUMANode
			}
			if !reflect.DeepEqual(numa, p.NUMA) {
				t.Fatalf("NUMA nodes: sim %v, hand %v", numa, p.NUMA)
			}
		})
	}
}
