package telemetry

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/health"
)

// TestRealNVML is the read-only check of the sampler and the collector on a
// machine with a GPU: the metrics carry values, and a healthy machine's
// health watcher marks nothing. Run it with GPU_AGENT_REAL_NVML=1.
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

	w := health.NewWatcher(lib, health.Policy{ProbeInterval: 50 * time.Millisecond}, health.WatcherOptions{WaitTimeout: 50 * time.Millisecond})
	w.SetInventory(inv)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := w.Run(ctx); err != nil {
		t.Fatal(err)
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
