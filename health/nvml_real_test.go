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
	defer s.release()
	s.SetInventory(inv)
	s.Sample()
	out := scrape(t, NewCollector(CollectorOptions{Samples: s, Health: w, Hostname: "real"}), nil)
	want := []string{"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_SM_CLOCK",
		"DCGM_FI_DEV_PCIE_REPLAY_COUNTER"}
	// GPM from Hopper on: its first pass must already have profiling series.
	for _, g := range inv.GPUs {
		dev, ret := lib.DeviceGetHandleByUUID(g.UUID)
		if ret != nvml.SUCCESS {
			continue
		}
		if arch, ret := dev.GetArchitecture(); ret == nvml.SUCCESS && arch >= nvml.DEVICE_ARCH_HOPPER && arch != nvml.DEVICE_ARCH_UNKNOWN {
			want = append(want, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE")
			break
		}
	}
	for _, name := range want {
		if !strings.Contains(out, name+"{") {
			t.Errorf("no %s on a real GPU", name)
		}
	}
	t.Logf("\n%s", out)
}
