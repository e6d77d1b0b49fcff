package devicemodel

import (
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
)

// PublishOrder orders inv's GPUs (by index) so that the first N of them are a
// well-connected set for every N: the scheduler's allocator takes the first
// free devices of a slice in the slice's order, so on a free node a plain
// "count: N" claim gets the first N GPUs published. The sets are nested from
// the top: the best N-1 GPUs (by the device plugin's GetPreferredAllocation
// score: NVLink lanes, then PCIe distance, then NUMA) are chosen among the
// best N, so the first 8 of two NVLink islands are one island, the first 4
// of those its best quad, and so on. nil when the topology is unknown or
// too large to rank.
func PublishOrder(inv *gpu.Inventory) []int {
	if inv == nil || inv.Topology == nil || inv.Topology.Len() != len(inv.GPUs) {
		return nil
	}
	s := topology.FromInventory(inv, topology.PolicyTopology)
	n := s.Len()
	if n == 0 || n > topology.MaxGPUs-1 {
		return nil
	}
	set := make([]int, n)
	for i := range set {
		set[i] = i
	}
	// order is filled from the back: the GPU that leaves each set.
	order := make([]int, n)
	for k := n - 1; k >= 1; k-- {
		var avail uint64
		for _, p := range set {
			avail |= 1 << p
		}
		best, err := s.Best(avail, 0, k)
		if err != nil {
			return nil
		}
		var kept uint64
		for _, p := range best {
			kept |= 1 << p
		}
		for _, p := range set {
			if kept&(1<<p) == 0 {
				order[k] = inv.GPUs[p].Index
			}
		}
		set = best
	}
	order[0] = inv.GPUs[set[0]].Index
	return order
}
