// Package simtest builds simulated nodes for the tests of the packages that
// read GPUs through NVML: an initialised sim.Node, its inventory, MIG
// devices on it, and a settable clock to hand both the node and the code
// under test. It is imported by tests only.
package simtest

import (
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Node returns an initialised simulated node of profile, shut down when the
// test ends.
func Node(tb testing.TB, profile string, opts ...sim.Option) *sim.Node {
	tb.Helper()
	n, err := sim.New(profile, opts...)
	if err != nil {
		tb.Fatalf("sim.New(%q): %v", profile, err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		tb.Fatalf("Init: %v", r)
	}
	tb.Cleanup(func() { n.Shutdown() })
	return n
}

// Inventory reads the GPUs of lib (initialised).
func Inventory(tb testing.TB, lib nvml.Interface) *gpu.Inventory {
	tb.Helper()
	inv, err := gpu.New(lib, gpu.Options{})
	if err != nil {
		tb.Fatalf("gpu.New: %v", err)
	}
	return inv
}

// NodeInventory is Node and its Inventory.
func NodeInventory(tb testing.TB, profile string, opts ...sim.Option) (*sim.Node, *gpu.Inventory) {
	tb.Helper()
	n := Node(tb, profile, opts...)
	return n, Inventory(tb, n)
}

// Profiles are GPU g's MIG profiles, as the agent reads them from NVML.
func Profiles(tb testing.TB, n *sim.Node, g gpu.GPU) mig.Profiles {
	tb.Helper()
	dev, r := n.DeviceGetHandleByIndex(g.Index)
	if r != nvml.SUCCESS {
		tb.Fatalf("handle %d: %v", g.Index, r)
	}
	ps, err := mig.QueryProfiles(dev, g.MemoryBytes)
	if err != nil {
		tb.Fatalf("GPU %d (%s): MIG profiles: %v", g.Index, g.Name, err)
	}
	return ps
}

// CreateMIG creates perGPU 1g instances (one full compute instance each) on
// every GPU of a MIG-enabled node.
func CreateMIG(tb testing.TB, n *sim.Node, perGPU int) {
	tb.Helper()
	count, r := n.DeviceGetCount()
	if r != nvml.SUCCESS {
		tb.Fatalf("DeviceGetCount: %v", r)
	}
	for i := range count {
		dev, r := n.DeviceGetHandleByIndex(i)
		if r != nvml.SUCCESS {
			tb.Fatalf("handle %d: %v", i, r)
		}
		info, r := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
		if r != nvml.SUCCESS {
			tb.Fatalf("gpu %d: 1g profile: %v", i, r)
		}
		for s := range perGPU {
			gi, r := dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(s), Size: 1})
			if r != nvml.SUCCESS {
				tb.Fatalf("gpu %d: create 1g at %d: %v", i, s, r)
			}
			ciInfo, r := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if r != nvml.SUCCESS {
				tb.Fatalf("gpu %d: ci profile: %v", i, r)
			}
			if _, r := gi.CreateComputeInstance(&ciInfo); r != nvml.SUCCESS {
				tb.Fatalf("gpu %d: create ci: %v", i, r)
			}
		}
	}
}

// Clock is a settable clock: the tests move it instead of waiting. It is
// not safe for concurrent use.
type Clock struct {
	T     time.Time
	Slept []time.Duration // what Sleep was asked to wait
}

// NewClock returns a clock at a fixed instant.
func NewClock() *Clock { return &Clock{T: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

// Now is the clock's time.
func (c *Clock) Now() time.Time { return c.T }

// Add moves the clock on by d.
func (c *Clock) Add(d time.Duration) { c.T = c.T.Add(d) }

// Sleep records d and moves the clock on by it, for code that sleeps
// through an injected function.
func (c *Clock) Sleep(d time.Duration) {
	c.Slept = append(c.Slept, d)
	c.Add(d)
}
