package sim

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// newNode builds an initialised node and shuts it down when the test ends.
func newNode(t *testing.T, profile string, opts ...Option) *Node {
	t.Helper()
	n, err := New(profile, opts...)
	if err != nil {
		t.Fatalf("New(%q): %v", profile, err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatalf("Init: %v", r)
	}
	t.Cleanup(func() { n.Shutdown() })
	return n
}

func handle(t *testing.T, n *Node, i int) nvml.Device {
	t.Helper()
	d, r := n.DeviceGetHandleByIndex(i)
	if r != nvml.SUCCESS {
		t.Fatalf("DeviceGetHandleByIndex(%d): %v", i, r)
	}
	return d
}

func wantRet(t *testing.T, what string, got, want nvml.Return) {
	t.Helper()
	if got != want {
		t.Errorf("%s: got %v, want %v", what, got, want)
	}
}

func giInfo(t *testing.T, d nvml.Device, profile int) *nvml.GpuInstanceProfileInfo {
	t.Helper()
	info, r := d.GetGpuInstanceProfileInfo(profile)
	if r != nvml.SUCCESS {
		t.Fatalf("GetGpuInstanceProfileInfo(%d): %v", profile, r)
	}
	return &info
}

func createGI(t *testing.T, d nvml.Device, profile int, start uint32) nvml.GpuInstance {
	t.Helper()
	info := giInfo(t, d, profile)
	gi, r := d.CreateGpuInstanceWithPlacement(info, &nvml.GpuInstancePlacement{Start: start, Size: sizeOf(t, d, info)})
	if r != nvml.SUCCESS {
		t.Fatalf("create profile %d at %d: %v", profile, start, r)
	}
	return gi
}

func sizeOf(t *testing.T, d nvml.Device, info *nvml.GpuInstanceProfileInfo) uint32 {
	t.Helper()
	pls, r := d.GetGpuInstancePossiblePlacements(info)
	if r != nvml.SUCCESS || len(pls) == 0 {
		t.Fatalf("placements of %d: %v", info.Id, r)
	}
	return pls[0].Size
}

func createFullCI(t *testing.T, gi nvml.GpuInstance) nvml.ComputeInstance {
	t.Helper()
	info, r := gi.GetInfo()
	if r != nvml.SUCCESS {
		t.Fatalf("gi GetInfo: %v", r)
	}
	prof, ok := profileByID(info.Device, info.ProfileId)
	if !ok {
		t.Fatalf("no profile with id %d", info.ProfileId)
	}
	ciProfile := map[uint32]int{1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[prof.SliceCount]
	ciInfo, r := gi.GetComputeInstanceProfileInfo(ciProfile, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if r != nvml.SUCCESS {
		t.Fatalf("ci profile %d: %v", ciProfile, r)
	}
	ci, r := gi.CreateComputeInstance(&ciInfo)
	if r != nvml.SUCCESS {
		t.Fatalf("CreateComputeInstance: %v", r)
	}
	return ci
}

// profileByID finds the profile whose reported id is id: GpuInstanceInfo
// carries that id, not the GPU_INSTANCE_PROFILE_* index.
func profileByID(d nvml.Device, id uint32) (nvml.GpuInstanceProfileInfo, bool) {
	for p := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, r := d.GetGpuInstanceProfileInfo(p)
		if r == nvml.SUCCESS && info.Id == id {
			return info, true
		}
	}
	return nvml.GpuInstanceProfileInfo{}, false
}
