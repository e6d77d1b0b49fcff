package telemetry

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// newSampler is a sampler on clk (which the node should share, so that
// GPM's averages see the time pass).
func newSampler(lib nvml.Interface, clk *simtest.Clock) *Sampler {
	return NewSampler(lib, SamplerOptions{Now: clk.Now, Sleep: clk.Sleep})
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
