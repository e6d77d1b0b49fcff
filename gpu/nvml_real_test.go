package gpu_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// TestRealNVML is the read-only check of the real backend on a machine with a
// GPU; it changes nothing on the GPU. Run it with GPU_AGENT_REAL_NVML=1.
func TestRealNVML(t *testing.T) {
	if os.Getenv("GPU_AGENT_REAL_NVML") != "1" {
		t.Skip("set GPU_AGENT_REAL_NVML=1 on a machine with an NVIDIA GPU")
	}
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("nvml Init: %v", ret)
	}
	defer lib.Shutdown()

	inv, err := gpu.New(lib, gpu.Options{NUMANode: gpu.SysfsNUMA("/sys")})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	var buf bytes.Buffer
	if err := gpu.WriteTable(&buf, inv); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", buf.String())
	for _, e := range inv.Errors {
		t.Errorf("inventory error: %v", e)
	}
	count, _ := lib.DeviceGetCount()
	if len(inv.GPUs) != count {
		t.Errorf("%d GPUs in the inventory, NVML counts %d", len(inv.GPUs), count)
	}

	busRE := regexp.MustCompile(`^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)
	nameRE := regexp.MustCompile(`^[0-9]+g\.[0-9]+gb([+-].+)?$`)
	for i, g := range inv.GPUs {
		if !busRE.MatchString(g.PCIBusID) {
			t.Errorf("GPU %d: bus id %q not in sysfs form", g.Index, g.PCIBusID)
		} else if _, err := os.Stat(filepath.Join("/sys/bus/pci/devices", g.PCIBusID)); err != nil {
			t.Errorf("GPU %d: %v", g.Index, err)
		}
		if _, err := os.Stat(fmt.Sprintf("/dev/nvidia%d", g.Minor)); err != nil {
			t.Logf("GPU %d: %v (expected inside some containers)", g.Index, err)
		}
		if inv.Topology.Level[i][i] != gpu.LevelInternal {
			t.Errorf("GPU %d: level to itself %v", g.Index, inv.Topology.Level[i][i])
		}
		if !g.MIGCapable {
			continue
		}
		// Name every profile the GPU offers; this only reads.
		dev, _ := lib.DeviceGetHandleByIndex(g.Index)
		for id := range nvml.GPU_INSTANCE_PROFILE_COUNT {
			info, ret := dev.GetGpuInstanceProfileInfo(id)
			if ret != nvml.SUCCESS {
				continue
			}
			name := gpu.MIGProfileName(id, info, g.MemoryBytes)
			t.Logf("GPU %d profile %d: %d slices, %d MiB -> %s", g.Index, id, info.SliceCount, info.MemorySizeMB, name)
			if !nameRE.MatchString(name) {
				t.Errorf("GPU %d profile %d: odd name %q", g.Index, id, name)
			}
		}
	}
}
