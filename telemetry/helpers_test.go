package telemetry

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
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

// newSampler is a sampler on clk (which the node should share, so that
// GPM's averages see the time pass).
func newSampler(lib nvml.Interface, clk *fakeClock) *Sampler {
	return NewSampler(lib, SamplerOptions{Now: clk.now, Sleep: clk.sleep})
}

// watchedHealth runs a health.Watcher on lib for the GPUs of inv, calls
// inject once every GPU is watched for events, and returns the first State
// that done accepts; the watcher has stopped when it returns.
func watchedHealth(tb testing.TB, lib nvml.Interface, inv *gpu.Inventory, inject func(), done func(*health.State) bool) *health.State {
	tb.Helper()
	w := health.NewWatcher(lib, health.Policy{ProbeInterval: time.Hour}, health.WatcherOptions{WaitTimeout: 5 * time.Millisecond})
	w.SetInventory(inv)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-stopped; err != nil {
			tb.Errorf("health watcher: %v", err)
		}
	}()
	testwait.For(tb, "every GPU watched for health events", func() bool {
		for _, g := range inv.GPUs {
			if !slices.Contains(w.Watched(), g.UUID) {
				return false
			}
		}
		return true
	})
	inject()
	var st *health.State
	testwait.For(tb, "the injected events in the health state", func() bool { st = w.State(); return done(st) })
	return st
}
