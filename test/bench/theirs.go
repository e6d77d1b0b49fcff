// Package bench compares gpu-agent's GetPreferredAllocation search
// (plugin/topology) with go-gpuallocator's best-effort policy, which NVIDIA's
// device plugin uses, on the simulated nodes. It is its own module so that
// go-gpuallocator never becomes a dependency of the agent.
package bench

import (
	"fmt"

	"github.com/NVIDIA/go-gpuallocator/gpuallocator"
	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// Node is one simulated node as both allocators see it.
type Node struct {
	Name string
	Inv  *gpu.Inventory
	// Theirs are go-gpuallocator's devices, Theirs[i] at position i.
	Theirs []*gpuallocator.Device
}

// LoadNode builds the inventory of a simulated profile through gpu.New (the
// agent's NVML path) and go-gpuallocator's devices from that inventory.
//
// Their devices are filled in directly rather than read through
// gpuallocator.NewDevices: go-nvlib wraps NVML device handles, so the
// simulator's GetTopologyCommonAncestor receives a handle it did not issue and
// answers INVALID_ARGUMENT. The filled links are the ones NewDevices would
// derive: the PCIe level maps one to one onto their P2P link types (as their
// internal links.GetP2PLink does), and a pair's NVLink type counts the lanes
// whose remote end is the peer GPU. Lanes into an NVSwitch end at the switch,
// so, as in their code, they produce no link at all.
func LoadNode(profile string) (*Node, error) {
	node, err := sim.New(profile)
	if err != nil {
		return nil, err
	}
	if ret := node.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%s: nvml init: %v", profile, ret)
	}
	inv, err := gpu.New(node, gpu.Options{})
	if err != nil {
		return nil, fmt.Errorf("%s: inventory: %w", profile, err)
	}
	if len(inv.Errors) > 0 {
		return nil, fmt.Errorf("%s: inventory errors: %v", profile, inv.Errors)
	}
	return &Node{Name: profile, Inv: inv, Theirs: theirDevices(inv)}, nil
}

// Values of go-gpuallocator's internal links.P2PLinkType (v0.6.0); the type
// is internal, so untyped constants fill its fields.
const (
	p2pCrossCPU     = 1
	p2pSameCPU      = 2
	p2pHostBridge   = 3
	p2pMultiSwitch  = 4
	p2pSingleSwitch = 5
	p2pSameBoard    = 6
	p2pOneNVLink    = 7 // n lanes: p2pOneNVLink + n - 1
)

func theirDevices(inv *gpu.Inventory) []*gpuallocator.Device {
	t := inv.Topology
	devs := make([]*gpuallocator.Device, len(inv.GPUs))
	for i, g := range inv.GPUs {
		d := &gpuallocator.Device{Index: i, Links: map[int][]gpuallocator.P2PLink{}}
		d.UUID = g.UUID
		d.PCI.BusID = g.PCIBusID
		devs[i] = d
	}
	for i := range devs {
		for j := range devs {
			if i == j {
				continue
			}
			var l gpuallocator.P2PLink
			l.GPU = devs[j]
			switch t.Level[i][j] {
			case gpu.LevelInternal:
				l.Type = p2pSameBoard
			case gpu.LevelSingle:
				l.Type = p2pSingleSwitch
			case gpu.LevelMultiple:
				l.Type = p2pMultiSwitch
			case gpu.LevelHostBridge:
				l.Type = p2pHostBridge
			case gpu.LevelNode:
				l.Type = p2pSameCPU
			default:
				l.Type = p2pCrossCPU
			}
			devs[i].Links[j] = append(devs[i].Links[j], l)
			if n := t.DirectLanes[i][j]; n > 0 {
				l.Type = p2pOneNVLink
				for range n - 1 {
					l.Type++
				}
				devs[i].Links[j] = append(devs[i].Links[j], l)
			}
		}
	}
	return devs
}

// TheirScore is go-gpuallocator's own set score (its calculateGPUSetScore,
// restated): per pair 10..60 by PCIe level plus 100 per direct NVLink lane.
func TheirScore(t *gpu.Topology, set []int) int {
	s := 0
	for a, i := range set {
		for _, j := range set[a+1:] {
			s += 100 * t.DirectLanes[i][j]
			switch t.Level[i][j] {
			case gpu.LevelInternal:
				s += 60
			case gpu.LevelSingle:
				s += 50
			case gpu.LevelMultiple:
				s += 40
			case gpu.LevelHostBridge:
				s += 30
			case gpu.LevelNode:
				s += 20
			default:
				s += 10
			}
		}
	}
	return s
}
