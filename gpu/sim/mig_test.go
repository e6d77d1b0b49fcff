package sim

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nameGB recovers the "Ngb" of a profile name the way NVIDIA's tools do:
// the profile's share of GPU memory rounded up to an eighth, in whole GiB.
// maxMigDevices is NVML's per-GPU MIG device limit on the 7-slice GPUs
// (A100, H100 and later); the sim's own comes from the model
// (model.maxMIGDevices: 4 on the A30).
const maxMigDevices = 7

func nameGB(profileMiB, totalMiB uint64) uint64 {
	eighths := (8*profileMiB + totalMiB - 1) / totalMiB
	totalGiB := (totalMiB + 1023) / 1024
	return (eighths*totalGiB + 4) / 8
}

// migProf is one GPU instance profile as NVIDIA documents it: the MIG User
// Guide's "Supported MIG Profiles" tables (name, compute slices, how many)
// and the driver's ids and placements (nvidia-smi mig -lgip, -lgipp).
type migProf struct {
	enum   int
	hwID   uint32
	name   string
	slices uint32
	count  uint32
	starts []uint32
	size   uint32
}

// sevenSlice are the profiles of a 7-compute-slice, 8-memory-slice GPU
// (A100 and later) with the names of one model's table.
func sevenSlice(names ...string) []migProf {
	return []migProf{
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 19, names[0], 1, 7, []uint32{0, 1, 2, 3, 4, 5, 6}, 1},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, names[1], 1, 1, []uint32{0, 1, 2, 3, 4, 5, 6}, 1},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, names[2], 1, 4, []uint32{0, 2, 4, 6}, 2},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 14, names[3], 2, 3, []uint32{0, 2, 4}, 2},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 9, names[4], 3, 2, []uint32{0, 4}, 4},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 5, names[5], 4, 1, []uint32{0}, 4},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, names[6], 7, 1, []uint32{0}, 8},
	}
}

// migTables are the profiles of every simulated MIG node's GPUs.
var migTables = []struct {
	profile string
	want    []migProf
	// unsupported are GPU_INSTANCE_PROFILE_* the model does not have.
	unsupported []int
	maxDevices  int
}{
	{"dgx-a100", sevenSlice("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"), nil, 7},
	{"dgx-a100-80gb", sevenSlice("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), nil, 7},
	{"dgx-h100", sevenSlice("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), nil, 7},
	{"pcie-h100nvl-x2", sevenSlice("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"), nil, 7},
	{"gh200", sevenSlice("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"), nil, 7},
	{"gh200-144g", sevenSlice("1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"), nil, 7},
	{"dgx-h200", sevenSlice("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), nil, 7},
	{"dgx-b200", sevenSlice("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"), nil, 7},
	{"gb200-tray", sevenSlice("1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"), nil, 7},
	// The A30: 4 compute and 4 memory slices, and a 2g profile with media
	// extensions instead of the 7-slice GPUs' 3g and 7g.
	{"pcie-a30x4", []migProf{
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 14, "1g.6gb", 1, 4, []uint32{0, 1, 2, 3}, 1},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, "1g.6gb+me", 1, 1, []uint32{0, 1, 2, 3}, 1},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 5, "2g.12gb", 2, 2, []uint32{0, 2}, 2},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1, 6, "2g.12gb+me", 2, 1, []uint32{0, 2}, 2},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, "4g.24gb", 4, 1, []uint32{0}, 4},
	}, []int{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.GPU_INSTANCE_PROFILE_7_SLICE}, 4},
}

func TestGPUInstanceProfilesAndPlacements(t *testing.T) {
	for _, tt := range migTables {
		t.Run(tt.profile, func(t *testing.T) {
			n := newNode(t, tt.profile) // MIG off: profiles and placements are still answered
			d := handle(t, n, 0)
			mem, _ := d.GetMemoryInfo()
			for _, w := range tt.want {
				info := giInfo(t, d, w.enum)
				suffix := ""
				if w.enum == nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1 || w.enum == nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1 {
					suffix = "+me"
				}
				name := fmt.Sprintf("%dg.%dgb%s", info.SliceCount, nameGB(info.MemorySizeMB, mem.Total>>20), suffix)
				// Real drivers report their own ids, not the index asked for.
				if info.Id != w.hwID || name != w.name || info.SliceCount != w.slices || info.InstanceCount != w.count ||
					info.MultiprocessorCount == 0 || info.CopyEngineCount == 0 {
					t.Errorf("profile %d: %+v (named %s), want %+v", w.enum, info, name, w)
				}
				pls, r := d.GetGpuInstancePossiblePlacements(info)
				wantRet(t, "placements", r, nvml.SUCCESS)
				var starts []uint32
				for _, p := range pls {
					starts = append(starts, p.Start)
					if p.Size != w.size {
						t.Errorf("%s: placement size %d, want %d", w.name, p.Size, w.size)
					}
				}
				if !slices.Equal(starts, w.starts) {
					t.Errorf("%s: starts %v, want %v", w.name, starts, w.starts)
				}
			}
			for _, p := range append([]int{nvml.GPU_INSTANCE_PROFILE_6_SLICE}, tt.unsupported...) {
				_, r := d.GetGpuInstanceProfileInfo(p)
				wantRet(t, fmt.Sprintf("profile %d", p), r, nvml.ERROR_NOT_SUPPORTED)
			}
			if len(tt.want) == 7 {
				_, r := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1)
				wantRet(t, "2g+me on a 7-slice GPU", r, nvml.ERROR_NOT_SUPPORTED)
			}
			_, r := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_COUNT)
			wantRet(t, "profile past the count", r, nvml.ERROR_INVALID_ARGUMENT)
			if c, r := d.GetMaxMigDeviceCount(); r != nvml.SUCCESS || c != tt.maxDevices {
				t.Errorf("GetMaxMigDeviceCount = %d, %v; want %d", c, r, tt.maxDevices)
			}
		})
	}
}

// TestMIGProfileNamesRound checks every model's table: each profile's name
// is what its memory rounds to, from the driver's size and the GPU's total
// the way NVIDIA's tools name profiles, its memory fits the GPU, and the
// counts of the smallest profile fill the GPU.
func TestMIGProfileNamesRound(t *testing.T) {
	seen := map[*model]bool{}
	for _, s := range nodeSpecs {
		m := s.model
		if m.mig == nil || seen[m] {
			continue
		}
		seen[m] = true
		var memSlices uint32
		for _, p := range m.mig {
			memSlices = max(memSlices, p.size)
		}
		for _, p := range m.mig {
			want := fmt.Sprintf("%dg.%dgb", p.slice, nameGB(p.memMiB, m.memMiB))
			if !strings.HasPrefix(p.name, want) || len(p.name) != len(want) && p.name[len(want):] != "+me" {
				t.Errorf("%s %s: %d of %d MiB names it %s", m.name, p.name, p.memMiB, m.memMiB, want)
			}
			if p.memMiB >= m.memMiB || p.memMiB*uint64(memSlices) > m.memMiB*uint64(p.size) {
				t.Errorf("%s %s: %d MiB is more than %d/%d of %d MiB", m.name, p.name, p.memMiB, p.size, memSlices, m.memMiB)
			}
			if p.sms == 0 || p.sms > m.sms || p.ce == 0 || p.ce > m.copyEngines {
				t.Errorf("%s %s: %d SMs, %d copy engines; the GPU has %d, %d", m.name, p.name, p.sms, p.ce, m.sms, m.copyEngines)
			}
			for _, st := range p.starts {
				if st+p.size > memSlices {
					t.Errorf("%s %s: placement %d+%d past %d memory slices", m.name, p.name, st, p.size, memSlices)
				}
			}
		}
	}
	if len(seen) != 10 {
		t.Errorf("%d MIG models, want 10 (A100 40/80 GB, A30, H100, H100 NVL, H200, GH200 96/144 GB, B200, GB200)", len(seen))
	}
}

func TestMIGRules(t *testing.T) {
	type step struct {
		profile int
		start   int // -1: CreateGpuInstance without placement
		size    uint32
		want    nvml.Return
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"overlap rejected", []step{
			{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, 4, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 4, 2, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 6, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, 4, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
		}},
		{"placement not possible", []step{
			{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 2, 4, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 6, 2, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 7, 1, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 0, 1, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 6, 2, nvml.SUCCESS},
		}},
		{"+me at most one", []step{
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0, 1, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1, 1, nvml.SUCCESS},
		}},
		{"first free placement", []step{
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, 1, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, -1, 0, nvml.SUCCESS}, // lands at 2
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, 2, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 4, 2, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, // lands at 1
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 6, 1, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
		}},
		{"seven 1g", []step{
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
		}},
	}
	// The A30's 4 slices: 2g placements at 0 and 2, one GPU-wide OFA for
	// whichever +me profile comes first.
	a30 := []struct {
		name  string
		steps []step
	}{
		{"overlap rejected", []step{
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, 2, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 3, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, 4, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, // lands at 0
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, // lands at 1
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
		}},
		{"placement not possible", []step{
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 1, 2, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 4, 1, nvml.ERROR_INVALID_ARGUMENT},
			{nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, 8, nvml.ERROR_NOT_SUPPORTED},
			{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, 4, nvml.SUCCESS},
		}},
		{"one +me of either size", []step{
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0, 1, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1, 2, 2, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, 2, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1, 1, nvml.SUCCESS},
		}},
		{"four 1g", []step{
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.SUCCESS},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
			{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, -1, 0, nvml.ERROR_INSUFFICIENT_RESOURCES},
		}},
	}
	run := func(t *testing.T, profile, name string, steps []step) {
		t.Run(profile+"/"+name, func(t *testing.T) {
			n := newNode(t, profile, WithMIGEnabled())
			d := handle(t, n, 0)
			for i, s := range steps {
				var r nvml.Return
				info, ir := d.GetGpuInstanceProfileInfo(s.profile)
				switch {
				case ir != nvml.SUCCESS:
					r = ir
				case s.start < 0:
					_, r = d.CreateGpuInstance(&info)
				default:
					_, r = d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(s.start), Size: s.size})
				}
				wantRet(t, fmt.Sprintf("step %d (profile %d at %d)", i, s.profile, s.start), r, s.want)
			}
		})
	}
	for _, m := range migTables {
		if m.profile == "pcie-a30x4" {
			for _, tt := range a30 {
				run(t, m.profile, tt.name, tt.steps)
			}
			continue
		}
		for _, tt := range tests {
			run(t, m.profile, tt.name, tt.steps)
		}
	}
}

func TestRemainingCapacity(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 0)
	capOf := func(p int) int {
		t.Helper()
		c, r := d.GetGpuInstanceRemainingCapacity(giInfo(t, d, p))
		wantRet(t, "GetGpuInstanceRemainingCapacity", r, nvml.SUCCESS)
		return c
	}
	want := map[int]int{
		nvml.GPU_INSTANCE_PROFILE_1_SLICE: 7, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: 1, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: 4,
		nvml.GPU_INSTANCE_PROFILE_2_SLICE: 3, nvml.GPU_INSTANCE_PROFILE_3_SLICE: 2, nvml.GPU_INSTANCE_PROFILE_4_SLICE: 1,
		nvml.GPU_INSTANCE_PROFILE_7_SLICE: 1,
	}
	for p, c := range want {
		if got := capOf(p); got != c {
			t.Errorf("empty GPU: capacity of %d = %d, want %d", p, got, c)
		}
	}
	createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 2)
	createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	want = map[int]int{
		nvml.GPU_INSTANCE_PROFILE_1_SLICE: 3, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: 0, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: 1,
		nvml.GPU_INSTANCE_PROFILE_2_SLICE: 1, nvml.GPU_INSTANCE_PROFILE_3_SLICE: 0, nvml.GPU_INSTANCE_PROFILE_4_SLICE: 0,
		nvml.GPU_INSTANCE_PROFILE_7_SLICE: 0,
	}
	for p, c := range want {
		if got := capOf(p); got != c {
			t.Errorf("with +me at 2 and 3g at 4: capacity of %d = %d, want %d", p, got, c)
		}
	}
}

// On the A30 the two +me profiles share the GPU's one OFA: once either
// exists, the other has no capacity although its slices are free.
func TestRemainingCapacityA30(t *testing.T) {
	d := handle(t, newNode(t, "pcie-a30x4", WithMIGEnabled()), 0)
	capOf := func(p int) int {
		t.Helper()
		c, r := d.GetGpuInstanceRemainingCapacity(giInfo(t, d, p))
		wantRet(t, "GetGpuInstanceRemainingCapacity", r, nvml.SUCCESS)
		return c
	}
	for _, tt := range []struct {
		create int
		start  uint32
		want   map[int]int
	}{
		{-1, 0, map[int]int{
			nvml.GPU_INSTANCE_PROFILE_1_SLICE: 4, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: 1, nvml.GPU_INSTANCE_PROFILE_2_SLICE: 2,
			nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1: 1, nvml.GPU_INSTANCE_PROFILE_4_SLICE: 1,
		}},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0, map[int]int{
			nvml.GPU_INSTANCE_PROFILE_1_SLICE: 3, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: 0, nvml.GPU_INSTANCE_PROFILE_2_SLICE: 1,
			nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1: 0, nvml.GPU_INSTANCE_PROFILE_4_SLICE: 0,
		}},
	} {
		if tt.create >= 0 {
			createGI(t, d, tt.create, tt.start)
		}
		for p, c := range tt.want {
			if got := capOf(p); got != c {
				t.Errorf("after creating %d: capacity of %d = %d, want %d", tt.create, p, got, c)
			}
		}
	}
}

func TestMIGModeOffAndNonMIG(t *testing.T) {
	n := newNode(t, "dgx-a100")
	d := handle(t, n, 0)
	info := giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	_, r := d.CreateGpuInstance(info)
	wantRet(t, "create with MIG off", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.CreateGpuInstanceWithPlacement(info, &nvml.GpuInstancePlacement{Start: 0, Size: 1})
	wantRet(t, "create at placement with MIG off", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.GetGpuInstanceRemainingCapacity(info)
	wantRet(t, "capacity with MIG off", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG device with MIG off", r, nvml.ERROR_NOT_FOUND)

	v := handle(t, newNode(t, "dgx1-v100", WithMIGEnabled()), 0)
	_, _, r = v.GetMigMode()
	wantRet(t, "V100 GetMigMode", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = v.SetMigMode(nvml.DEVICE_MIG_ENABLE)
	wantRet(t, "V100 SetMigMode", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = v.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	wantRet(t, "V100 profile info", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = v.GetMaxMigDeviceCount()
	wantRet(t, "V100 max MIG devices", r, nvml.ERROR_NOT_SUPPORTED)
	if isMig, r := v.IsMigDeviceHandle(); r != nvml.SUCCESS || isMig {
		t.Errorf("V100 IsMigDeviceHandle = %v, %v", isMig, r)
	}
}

func TestMIGModeChange(t *testing.T) {
	mode := func(d nvml.Device) [2]int {
		t.Helper()
		c, p, r := d.GetMigMode()
		wantRet(t, "GetMigMode", r, nvml.SUCCESS)
		return [2]int{c, p}
	}
	on, off, pendingOn, pendingOff := [2]int{1, 1}, [2]int{0, 0}, [2]int{0, 1}, [2]int{1, 0}

	t.Run("pending until reset", func(t *testing.T) {
		n := newNode(t, "dgx-h100")
		d := handle(t, n, 3)
		act, r := d.SetMigMode(nvml.DEVICE_MIG_ENABLE)
		wantRet(t, "SetMigMode", r, nvml.SUCCESS)
		wantRet(t, "activation", act, nvml.ERROR_RESET_REQUIRED)
		if m := mode(d); m != pendingOn {
			t.Fatalf("mode %v, want %v", m, pendingOn)
		}
		_, r = d.CreateGpuInstance(giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE))
		wantRet(t, "create while pending", r, nvml.ERROR_NOT_SUPPORTED)
		if err := n.Reset(3); err != nil {
			t.Fatal(err)
		}
		if m := mode(d); m != on {
			t.Fatalf("after reset mode %v, want %v", m, on)
		}
		if m := mode(handle(t, n, 2)); m != off {
			t.Errorf("other GPU changed: %v", m)
		}
		gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0)
		_, r = d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
		wantRet(t, "disable with a GPU instance", r, nvml.ERROR_IN_USE)
		if m := mode(d); m != on {
			t.Errorf("refused change altered mode: %v", m)
		}
		wantRet(t, "destroy", gi.Destroy(), nvml.SUCCESS)
		d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
		if m := mode(d); m != pendingOff {
			t.Errorf("mode %v, want %v", m, pendingOff)
		}
		d.SetMigMode(nvml.DEVICE_MIG_ENABLE) // back to current: nothing pending
		if m := mode(d); m != on {
			t.Errorf("mode %v, want %v", m, on)
		}
		_, r = d.SetMigMode(2)
		wantRet(t, "mode 2", r, nvml.ERROR_INVALID_ARGUMENT)
	})

	t.Run("immediate", func(t *testing.T) {
		n := newNode(t, "dgx-a100", WithImmediateMIGModeChange())
		d := handle(t, n, 0)
		act, r := d.SetMigMode(nvml.DEVICE_MIG_ENABLE)
		if r != nvml.SUCCESS || act != nvml.SUCCESS || mode(d) != on {
			t.Fatalf("SetMigMode = %v, %v; mode %v", act, r, mode(d))
		}
		n.SetProcesses(0, []nvml.ProcessInfo{{Pid: 42, GpuInstanceId: NoInstance, ComputeInstanceId: NoInstance}})
		act, r = d.SetMigMode(nvml.DEVICE_MIG_DISABLE)
		if r != nvml.SUCCESS || act != nvml.ERROR_IN_USE || mode(d) != pendingOff {
			t.Errorf("busy GPU: SetMigMode = %v, %v; mode %v", act, r, mode(d))
		}
	})
}

func TestGPUAndComputeInstances(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 5)
	gi3 := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	gi1 := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0)
	gi2 := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2)
	for want, gi := range []nvml.GpuInstance{gi3, gi1, gi2} {
		info, r := gi.GetInfo()
		if r != nvml.SUCCESS || int(info.Id) != want+1 || info.Device != d {
			t.Errorf("gi %d: %+v, %v", want+1, info, r)
		}
	}
	info3, _ := gi3.GetInfo()
	if info3.ProfileId != 9 /* 3g hardware id */ || info3.Placement != (nvml.GpuInstancePlacement{Start: 4, Size: 4}) {
		t.Errorf("3g info %+v", info3)
	}
	if got, r := d.GetGpuInstanceById(3); r != nvml.SUCCESS || got != gi2 {
		t.Errorf("GetGpuInstanceById(3) = %v, %v", got, r)
	}
	_, r := d.GetGpuInstanceById(4)
	wantRet(t, "GetGpuInstanceById(4)", r, nvml.ERROR_NOT_FOUND)
	if gis, r := d.GetGpuInstances(giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE)); r != nvml.SUCCESS || len(gis) != 1 || gis[0] != gi1 {
		t.Errorf("GetGpuInstances(1g) = %v, %v", gis, r)
	}

	// Compute instances: two 1c in the 3g, then the full-size one on the others.
	c1, r := gi3.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	wantRet(t, "1c profile", r, nvml.SUCCESS)
	_, r = gi3.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	wantRet(t, "4c in a 3g", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = gi3.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
	wantRet(t, "bad engine profile", r, nvml.ERROR_INVALID_ARGUMENT)
	ciA, _ := gi3.CreateComputeInstance(&c1)
	ciB, r := gi3.CreateComputeInstanceWithPlacement(&c1, &nvml.ComputeInstancePlacement{Start: 2, Size: 1})
	wantRet(t, "1c at 2", r, nvml.SUCCESS)
	_, r = gi3.CreateComputeInstanceWithPlacement(&c1, &nvml.ComputeInstancePlacement{Start: 2, Size: 1})
	wantRet(t, "1c at 2 again", r, nvml.ERROR_INSUFFICIENT_RESOURCES)
	_, r = gi3.CreateComputeInstanceWithPlacement(&c1, &nvml.ComputeInstancePlacement{Start: 3, Size: 1})
	wantRet(t, "1c at 3 of a 3g", r, nvml.ERROR_INVALID_ARGUMENT)
	if left, _ := gi3.GetComputeInstanceRemainingCapacity(&c1); left != 1 {
		t.Errorf("1c capacity left %d, want 1", left)
	}
	for want, ci := range []nvml.ComputeInstance{ciA, ciB} {
		info, r := ci.GetInfo()
		if r != nvml.SUCCESS || int(info.Id) != want || info.GpuInstance != gi3 || info.Device != d {
			t.Errorf("ci %d: %+v, %v", want, info, r)
		}
	}
	createFullCI(t, gi1)
	createFullCI(t, gi2)

	// MIG devices in GI, then CI, order: the 3g (id 1) holds CIs 0 and 1.
	wantOrder := [][3]any{{1, 0, "1c.3g.20gb"}, {1, 1, "1c.3g.20gb"}, {2, 0, "1g.5gb"}, {3, 0, "2g.10gb"}}
	seen := map[string]bool{}
	for i, w := range wantOrder {
		m, r := d.GetMigDeviceHandleByIndex(i)
		wantRet(t, fmt.Sprintf("MIG device %d", i), r, nvml.SUCCESS)
		giID, _ := m.GetGpuInstanceId()
		ciID, _ := m.GetComputeInstanceId()
		name, _ := m.GetName()
		uuid, _ := m.GetUUID()
		isMig, _ := m.IsMigDeviceHandle()
		parent, _ := m.GetDeviceHandleFromMigDeviceHandle()
		if giID != w[0] || ciID != w[1] || name != "NVIDIA A100-SXM4-40GB MIG "+w[2].(string) || !isMig || parent != d || seen[uuid] {
			t.Errorf("MIG device %d: gi %d ci %d name %q mig %v parent ok %v uuid %s", i, giID, ciID, name, isMig, parent == d, uuid)
		}
		seen[uuid] = true
		if h, r := n.DeviceGetHandleByUUID(uuid); r != nvml.SUCCESS || h != m {
			t.Errorf("DeviceGetHandleByUUID(%s) = %v, %v", uuid, h, r)
		}
	}
	_, r = d.GetMigDeviceHandleByIndex(len(wantOrder))
	wantRet(t, "past the last MIG device", r, nvml.ERROR_NOT_FOUND)
	_, r = d.GetMigDeviceHandleByIndex(maxMigDevices)
	wantRet(t, "past the maximum", r, nvml.ERROR_INVALID_ARGUMENT)

	m0, _ := d.GetMigDeviceHandleByIndex(2)
	if mem, r := m0.GetMemoryInfo(); r != nvml.SUCCESS || mem.Total != 4864<<20 {
		t.Errorf("1g.5gb memory %+v, %v", mem, r)
	}
	if a, r := m0.GetAttributes(); r != nvml.SUCCESS || a.GpuInstanceSliceCount != 1 || a.MemorySizeMB != 4864 {
		t.Errorf("1g.5gb attributes %+v, %v", a, r)
	}
	m1c, _ := d.GetMigDeviceHandleByIndex(1)
	if a, r := m1c.GetAttributes(); r != nvml.SUCCESS || a.GpuInstanceSliceCount != 3 || a.ComputeInstanceSliceCount != 1 || a.MultiprocessorCount != 14 {
		t.Errorf("1c.3g.20gb attributes %+v, %v", a, r)
	}
	_, r = m0.GetPciInfo()
	wantRet(t, "GetPciInfo on a MIG device", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.GetGpuInstanceId()
	wantRet(t, "GetGpuInstanceId on a GPU", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.GetDeviceHandleFromMigDeviceHandle()
	wantRet(t, "parent of a GPU", r, nvml.ERROR_INVALID_ARGUMENT)

	// Destroy order: a GPU instance holding compute instances is in use.
	wantRet(t, "destroy 3g with CIs", gi3.Destroy(), nvml.ERROR_IN_USE)
	n.SetProcesses(5, []nvml.ProcessInfo{{Pid: 7, UsedGpuMemory: 1 << 30, GpuInstanceId: 1, ComputeInstanceId: 1}})
	wantRet(t, "destroy CI with a process", ciB.Destroy(), nvml.ERROR_IN_USE)
	m3 := m1c
	if procs, r := m3.GetComputeRunningProcesses(); r != nvml.SUCCESS || len(procs) != 1 || procs[0].Pid != 7 {
		t.Errorf("processes on 1/1: %v, %v", procs, r)
	}
	if mem, _ := m3.GetMemoryInfo(); mem.Used != 1<<30 || mem.Free != mem.Total-mem.Used {
		t.Errorf("memory of 1/1 with a 1 GiB process: %+v", mem)
	}
	if procs, _ := m0.GetComputeRunningProcesses(); len(procs) != 0 {
		t.Errorf("processes on 2/0: %v", procs)
	}
	n.SetProcesses(5, nil)
	wantRet(t, "destroy CI 0", ciA.Destroy(), nvml.SUCCESS)
	wantRet(t, "destroy CI 0 again", ciA.Destroy(), nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "destroy CI 1", ciB.Destroy(), nvml.SUCCESS)
	_, r = m3.GetUUID()
	wantRet(t, "stale MIG device handle", r, nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "destroy empty 3g", gi3.Destroy(), nvml.SUCCESS)
	_, r = gi3.GetInfo()
	wantRet(t, "stale GI handle", r, nvml.ERROR_INVALID_ARGUMENT)
	// The freed id 1 and slices 4-7 are reused.
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	if info, _ := gi.GetInfo(); info.Id != 1 {
		t.Errorf("re-created 3g has id %d, want 1", info.Id)
	}
}

func TestGIIDsLowestFree(t *testing.T) {
	n := newNode(t, "dgx-h100", WithMIGEnabled())
	d := handle(t, n, 0)
	var gis []nvml.GpuInstance
	for range 7 {
		gi, r := d.CreateGpuInstance(giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE))
		wantRet(t, "create 1g", r, nvml.SUCCESS)
		gis = append(gis, gi)
	}
	gis[1].Destroy() // id 2
	gis[4].Destroy() // id 5
	gi, _ := d.CreateGpuInstance(giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE))
	if info, _ := gi.GetInfo(); info.Id != 2 || info.Placement.Start != 1 {
		t.Errorf("new GI %+v, want id 2 at slice 1", info)
	}
}

func TestResetDestroysInstances(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 0)
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0)
	createFullCI(t, gi)
	m, _ := d.GetMigDeviceHandleByIndex(0)
	n.Reset(0)
	if _, r := gi.GetInfo(); r != nvml.ERROR_INVALID_ARGUMENT {
		t.Errorf("GI after reset: %v", r)
	}
	if _, r := m.GetUUID(); r != nvml.ERROR_INVALID_ARGUMENT {
		t.Errorf("MIG device after reset: %v", r)
	}
	if c, p, _ := d.GetMigMode(); c != 1 || p != 1 {
		t.Errorf("MIG mode after reset %d/%d", c, p)
	}
	createGI(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0)
}

func TestHardwareProfileIDs(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 0)
	info := giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if info.Id != 19 {
		t.Fatalf("1g.5gb id %d, want 19", info.Id)
	}
	gi, r := d.CreateGpuInstance(info)
	wantRet(t, "create by hardware id", r, nvml.SUCCESS)
	if gii, _ := gi.GetInfo(); gii.ProfileId != 19 {
		t.Errorf("GI ProfileId %d, want 19", gii.ProfileId)
	}
	_, r = d.CreateGpuInstance(&nvml.GpuInstanceProfileInfo{Id: nvml.GPU_INSTANCE_PROFILE_3_SLICE})
	wantRet(t, "create by enum value 2 (no such hardware id)", r, nvml.ERROR_INVALID_ARGUMENT)
}
