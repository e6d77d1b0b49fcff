package health

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// TestRealNVML is the read-only check of the watcher and the sampler on a
// machine with a GPU: events register, probes find every GPU reachable and
// the metrics carry values. Run it with GPU_AGENT_REAL_NVML=1.
func TestRealNVML(t *testing.T) {
	if os.Getenv("GPU_AGENT_REAL_NVML") != "1" {
		t.Skip("set GPU_AGENT_REAL_NVML=1 on a machine with an NVIDIA GPU")
	}
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("nvml Init: %v", ret)
	}
	defer lib.Shutdown()
	inv := inventory(t, lib)

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

	s := NewSampler(lib, SamplerOptions{})
	s.SetInventory(inv)
	s.Sample()
	out := scrape(t, NewCollector(CollectorOptions{Samples: s, Health: w, Hostname: "real"}), nil)
	for _, name := range []string{"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_SM_CLOCK"} {
		if !strings.Contains(out, name+"{") {
			t.Errorf("no %s on a real GPU", name)
		}
	}
	t.Logf("\n%s", out)
}
