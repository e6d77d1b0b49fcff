package health

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
)

// TestRealNVML is the read-only check of the watcher on a machine with a
// GPU: events register and probes find every GPU reachable (package
// telemetry checks the metrics there). Run it with GPU_AGENT_REAL_NVML=1.
func TestRealNVML(t *testing.T) {
	if os.Getenv("GPU_AGENT_REAL_NVML") != "1" {
		t.Skip("set GPU_AGENT_REAL_NVML=1 on a machine with an NVIDIA GPU")
	}
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("nvml Init: %v", ret)
	}
	defer lib.Shutdown()
	inv := simtest.Inventory(t, lib)

	w := NewWatcher(lib, Policy{ProbeInterval: 50 * time.Millisecond}, WatcherOptions{WaitTimeout: 50 * time.Millisecond})
	w.SetInventory(inv)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := w.Run(ctx); err != nil {
		t.Fatal(err)
	}
	for _, d := range w.devs {
		t.Logf("gpu %d: events registered %#x, skipped %#x", d.index, d.registered, d.skipped)
		if d.registered&nvml.EventTypeXidCriticalError == 0 {
			t.Errorf("gpu %d: XID events not registered", d.index)
		}
	}
	if s := w.State(); len(s.Causes) > 0 {
		t.Errorf("healthy machine has causes: %+v", s.Causes)
	}
}
