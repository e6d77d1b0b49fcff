// Package topotest holds hand-built topologies of the simulated node profiles,
// written from their specification rather than read from gpu/sim, so tests
// and benchmarks of plugin/topology can check the simulator against them and
// run without it.
package topotest

import (
	"fmt"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Profile is one node: its topology and the NUMA node of each GPU.
type Profile struct {
	Name     string
	Topology *gpu.Topology
	NUMA     []int
}

// Inventory returns a minimal inventory for the profile: GPUs with index,
// UUID ("GPU-<name>-<i>") and NUMA node, plus the topology.
func (p Profile) Inventory() *gpu.Inventory {
	inv := &gpu.Inventory{Topology: p.Topology}
	for i, numa := range p.NUMA {
		inv.GPUs = append(inv.GPUs, gpu.GPU{Index: i, UUID: UUID(p.Name, i), NUMANode: numa, Minor: i})
	}
	return inv
}

// UUID is the UUID Inventory gives GPU i of the named profile.
func UUID(profile string, i int) string { return fmt.Sprintf("GPU-%s-%d", profile, i) }

// Profiles returns every profile, 8-GPU ones first.
func Profiles() []Profile {
	return []Profile{DGX1V100(), PCIe8GPU(), DGXA100(), TwoIslands16()}
}

func newTopology(n int) *gpu.Topology {
	t := &gpu.Topology{
		Level:       make([][]gpu.LinkLevel, n),
		DirectLanes: make([][]int, n),
		SwitchLanes: make([]int, n),
		Fabric:      make([]int, n),
	}
	for i := range n {
		t.Level[i] = make([]gpu.LinkLevel, n)
		t.DirectLanes[i] = make([]int, n)
		t.Fabric[i] = -1
	}
	return t
}

// levels fills Level from a function of the pair (i < j); the diagonal is
// LevelInternal as in gpu.Topology.
func levels(t *gpu.Topology, f func(i, j int) gpu.LinkLevel) {
	for i := range t.Len() {
		t.Level[i][i] = gpu.LevelInternal
		for j := i + 1; j < t.Len(); j++ {
			t.Level[i][j] = f(i, j)
			t.Level[j][i] = t.Level[i][j]
		}
	}
}

func lanes(t *gpu.Topology, i, j, n int) {
	t.DirectLanes[i][j], t.DirectLanes[j][i] = n, n
}

// dgx1Lanes is the DGX-1 (V100) hybrid cube-mesh: [i, j, lanes].
var dgx1Lanes = [][3]int{
	{0, 1, 1}, {0, 2, 1}, {0, 3, 2}, {0, 4, 2}, {1, 2, 2}, {1, 3, 1}, {1, 5, 2}, {2, 3, 2},
	{2, 6, 1}, {3, 7, 1}, {4, 5, 1}, {4, 6, 1}, {4, 7, 2}, {5, 6, 2}, {5, 7, 1}, {6, 7, 2},
}

func numaBy(n, per int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i / per
	}
	return out
}

// DGX1V100: 8 V100s in a hybrid cube-mesh, no NVSwitch; PCIe pairs on one
// switch, halves on one host bridge, halves on different sockets.
func DGX1V100() Profile {
	t := newTopology(8)
	for _, l := range dgx1Lanes {
		lanes(t, l[0], l[1], l[2])
	}
	levels(t, func(i, j int) gpu.LinkLevel {
		switch {
		case i/2 == j/2:
			return gpu.LevelSingle
		case i/4 == j/4:
			return gpu.LevelHostBridge
		}
		return gpu.LevelSystem
	})
	return Profile{Name: "dgx1-v100", Topology: t, NUMA: numaBy(8, 4)}
}

// PCIe8GPU: 8 GPUs without NVLink; pairs on one switch, halves on one NUMA node.
func PCIe8GPU() Profile {
	t := newTopology(8)
	levels(t, func(i, j int) gpu.LinkLevel {
		switch {
		case i/2 == j/2:
			return gpu.LevelSingle
		case i/4 == j/4:
			return gpu.LevelNode
		}
		return gpu.LevelSystem
	})
	return Profile{Name: "pcie-8gpu", Topology: t, NUMA: numaBy(8, 4)}
}

// DGXA100: 8 A100s with 12 lanes each into one NVSwitch fabric; PCIe pairs
// behind several switches, everything else across sockets.
func DGXA100() Profile {
	t := newTopology(8)
	for i := range 8 {
		t.SwitchLanes[i], t.Fabric[i] = 12, 0
	}
	levels(t, func(i, j int) gpu.LinkLevel {
		if i/2 == j/2 {
			return gpu.LevelMultiple
		}
		return gpu.LevelSystem
	})
	return Profile{Name: "dgx-a100", Topology: t, NUMA: []int{3, 3, 1, 1, 7, 7, 5, 5}}
}

// TwoIslands16: two DGX-1 cube-mesh islands (0-7, 8-15) with no NVLink
// between them; pairs on one switch, quads behind several, an island on one
// NUMA node.
func TwoIslands16() Profile {
	t := newTopology(16)
	for _, off := range []int{0, 8} {
		for _, l := range dgx1Lanes {
			lanes(t, off+l[0], off+l[1], l[2])
		}
	}
	levels(t, func(i, j int) gpu.LinkLevel {
		switch {
		case i/2 == j/2:
			return gpu.LevelSingle
		case i/4 == j/4:
			return gpu.LevelMultiple
		case i/8 == j/8:
			return gpu.LevelNode
		}
		return gpu.LevelSystem
	})
	return Profile{Name: "two-islands-16", Topology: t, NUMA: numaBy(16, 8)}
}
