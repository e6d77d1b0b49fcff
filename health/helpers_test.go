package health

import (
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// newNode builds an initialised simulated node, shut down when the test ends.
func newNode(tb testing.TB, profile string, opts ...sim.Option) *sim.Node {
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

// createMIG creates perGPU 1g instances (one full compute instance each) on
// every GPU of a MIG-enabled node.
func createMIG(tb testing.TB, n *sim.Node, perGPU int) {
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

func inventory(tb testing.TB, lib nvml.Interface) *gpu.Inventory {
	tb.Helper()
	inv, err := gpu.New(lib, gpu.Options{})
	if err != nil {
		tb.Fatalf("gpu.New: %v", err)
	}
	return inv
}

// fakeClock is a settable clock for quiet periods.
type fakeClock struct {
	t     time.Time
	slept []time.Duration // what sleep was asked to wait
}

func (c *fakeClock) now() time.Time      { return c.t }
func (c *fakeClock) add(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *fakeClock               { return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

// sleep is SamplerOptions.Sleep: it moves the clock instead of waiting.
func (c *fakeClock) sleep(d time.Duration) {
	c.slept = append(c.slept, d)
	c.add(d)
}
