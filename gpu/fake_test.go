package gpu_test

import (
	"slices"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// A fakeNode describes a node; lib turns it into go-nvml mocks. Failures are
// injected per GPU by call name (the names New records in DeviceError.Call).

type fakeLink struct {
	down bool
	typ  nvml.IntNvLinkDeviceType
	// typRet is what GetNvLinkRemoteDeviceType returns (SUCCESS when zero);
	// NOT_SUPPORTED plays an old driver.
	typRet nvml.Return
	remote string // remote PCI bus id, NVML form
	pciRet nvml.Return
}

type fakeMIG struct {
	slot       int
	uuid       string
	gi, ci     int
	giProfile  int
	ciProfile  int
	start, len int
	memMiB     uint64
}

// fakeGI is a GPU instance with no compute instance (GPU.GIsWithoutCI).
type fakeGI struct {
	gi, giProfile, start, len int
}

type fakeGPU struct {
	uuid, name string
	memMiB     uint64
	bus        string // NVML form, "00000000:07:00.0"
	minor      int
	numa       int
	cc         [2]int
	// mig is {current, pending}; nil means MIG is not supported.
	mig   *[2]bool
	links []fakeLink
	migs  []fakeMIG
	// bareGIs are GPU instances besides those of migs.
	bareGIs []fakeGI
	// fabric is what GetGpuFabricInfo answers; nil: NOT_SUPPORTED.
	fabric *nvml.GpuFabricInfo
	// fail maps a call name to the Return it gives instead of its answer.
	fail map[string]nvml.Return
}

type fakeNode struct {
	driver string
	gpus   []fakeGPU
	// level gives the PCIe level of a pair (by NVML index); nil: SYS.
	level func(i, j int) nvml.GpuTopologyLevel
	// countRet, when set, makes DeviceGetCount fail.
	countRet nvml.Return
}

func on(cur, pend bool) *[2]bool { return &[2]bool{cur, pend} }

// a100Profiles are the A100-SXM4-40GB GPU instance profiles NVML reports.
var a100Profiles = map[int]nvml.GpuInstanceProfileInfo{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE:      {Id: nvml.GPU_INSTANCE_PROFILE_1_SLICE, SliceCount: 1, MemorySizeMB: 4864},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: {Id: nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, SliceCount: 1, MemorySizeMB: 4864},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: {Id: nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, SliceCount: 1, MemorySizeMB: 9856},
	nvml.GPU_INSTANCE_PROFILE_2_SLICE:      {Id: nvml.GPU_INSTANCE_PROFILE_2_SLICE, SliceCount: 2, MemorySizeMB: 9856},
	nvml.GPU_INSTANCE_PROFILE_3_SLICE:      {Id: nvml.GPU_INSTANCE_PROFILE_3_SLICE, SliceCount: 3, MemorySizeMB: 19968},
	nvml.GPU_INSTANCE_PROFILE_4_SLICE:      {Id: nvml.GPU_INSTANCE_PROFILE_4_SLICE, SliceCount: 4, MemorySizeMB: 19968},
	nvml.GPU_INSTANCE_PROFILE_7_SLICE:      {Id: nvml.GPU_INSTANCE_PROFILE_7_SLICE, SliceCount: 7, MemorySizeMB: 40192},
}

// ciSlices is the slice count of each compute instance profile id.
var ciSlices = map[int]uint32{
	nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
	nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
	nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
	nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
	nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}

func pciInfo(bus string) nvml.PciInfo {
	var p nvml.PciInfo
	for i := 0; i < len(bus) && i < len(p.BusId)-1; i++ {
		p.BusId[i] = int8(bus[i])
	}
	return p
}

// lib builds the mocks. Every Func the inventory calls is set, so a call New
// should not make would panic in the mock.
func (n *fakeNode) lib(t *testing.T) nvml.Interface {
	t.Helper()
	devs := make([]*mock.Device, len(n.gpus))
	index := map[nvml.Device]int{}
	for i := range n.gpus {
		devs[i] = n.device(i, index)
		index[devs[i]] = i
	}
	return &mock.Interface{
		DeviceGetCountFunc: func() (int, nvml.Return) {
			if n.countRet != nvml.SUCCESS {
				return 0, n.countRet
			}
			return len(devs), nvml.SUCCESS
		},
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			if r, ok := n.gpus[i].fail["DeviceGetHandleByIndex"]; ok {
				return nil, r
			}
			return devs[i], nvml.SUCCESS
		},
		SystemGetDriverVersionFunc: func() (string, nvml.Return) {
			if n.driver == "" {
				return "", nvml.ERROR_NOT_SUPPORTED
			}
			return n.driver, nvml.SUCCESS
		},
		SystemGetCudaDriverVersionFunc: func() (int, nvml.Return) { return 12080, nvml.SUCCESS },
	}
}

func (n *fakeNode) device(i int, index map[nvml.Device]int) *mock.Device {
	g := &n.gpus[i]
	ret := func(call string) nvml.Return {
		if r, ok := g.fail[call]; ok {
			return r
		}
		return nvml.SUCCESS
	}
	link := func(l int) (fakeLink, nvml.Return) {
		if l < 0 || l >= nvml.NVLINK_MAX_LINKS {
			return fakeLink{}, nvml.ERROR_INVALID_ARGUMENT
		}
		if len(g.links) == 0 {
			return fakeLink{}, nvml.ERROR_NOT_SUPPORTED
		}
		if l >= len(g.links) {
			return fakeLink{}, nvml.ERROR_INVALID_ARGUMENT
		}
		return g.links[l], nvml.SUCCESS
	}
	d := &mock.Device{
		GetUUIDFunc:        func() (string, nvml.Return) { return g.uuid, ret("GetUUID") },
		GetNameFunc:        func() (string, nvml.Return) { return g.name, ret("GetName") },
		GetMinorNumberFunc: func() (int, nvml.Return) { return g.minor, ret("GetMinorNumber") },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: g.memMiB << 20}, ret("GetMemoryInfo")
		},
		GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) { return pciInfo(g.bus), ret("GetPciInfo") },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) {
			return g.cc[0], g.cc[1], ret("GetCudaComputeCapability")
		},
		GetNumaNodeIdFunc: func() (int, nvml.Return) { return g.numa, ret("GetNumaNodeId") },
		GetBrandFunc:      func() (nvml.BrandType, nvml.Return) { return nvml.BRAND_NVIDIA, ret("GetBrand") },
		GetGpuFabricInfoFunc: func() (nvml.GpuFabricInfo, nvml.Return) {
			if g.fabric == nil {
				return nvml.GpuFabricInfo{}, nvml.ERROR_NOT_SUPPORTED
			}
			return *g.fabric, ret("GetGpuFabricInfoV")
		},
		GetMigModeFunc: func() (int, int, nvml.Return) {
			if g.mig == nil {
				return 0, 0, nvml.ERROR_NOT_SUPPORTED
			}
			mode := func(b bool) int {
				if b {
					return nvml.DEVICE_MIG_ENABLE
				}
				return nvml.DEVICE_MIG_DISABLE
			}
			return mode(g.mig[0]), mode(g.mig[1]), ret("GetMigMode")
		},
		GetMaxMigDeviceCountFunc: func() (int, nvml.Return) { return 7, ret("GetMaxMigDeviceCount") },
		GetMigDeviceHandleByIndexFunc: func(k int) (nvml.Device, nvml.Return) {
			if r := ret("GetMigDeviceHandleByIndex"); r != nvml.SUCCESS {
				return nil, r
			}
			for _, m := range g.migs {
				if m.slot == k {
					return migDevice(m, ret), nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		GetGpuInstanceProfileInfoFunc: func(id int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
			p, ok := a100Profiles[id]
			if !ok {
				return p, nvml.ERROR_NOT_SUPPORTED
			}
			return p, ret("GetGpuInstanceProfileInfo")
		},
		GetGpuInstanceByIdFunc: func(id int) (nvml.GpuInstance, nvml.Return) {
			if r := ret("GetGpuInstanceById"); r != nvml.SUCCESS {
				return nil, r
			}
			for _, gi := range g.gpuInstances() {
				if gi.gi == id {
					return gpuInstance(g, gi, ret), nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		GetGpuInstancesFunc: func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
			if r := ret("GetGpuInstances"); r != nvml.SUCCESS {
				return nil, r
			}
			out := []nvml.GpuInstance{}
			for _, gi := range g.gpuInstances() {
				if uint32(gi.giProfile) == info.Id {
					out = append(out, gpuInstance(g, gi, ret))
				}
			}
			return out, nvml.SUCCESS
		},
		GetTopologyCommonAncestorFunc: func(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
			j, ok := index[other]
			if !ok {
				return 0, nvml.ERROR_INVALID_ARGUMENT
			}
			if r := ret("GetTopologyCommonAncestor"); r != nvml.SUCCESS {
				return 0, r
			}
			if n.level == nil {
				return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
			}
			return n.level(i, j), nvml.SUCCESS
		},
		GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
			fl, r := link(l)
			if r != nvml.SUCCESS {
				return 0, r
			}
			if fl.down {
				return nvml.FEATURE_DISABLED, ret("GetNvLinkState")
			}
			return nvml.FEATURE_ENABLED, ret("GetNvLinkState")
		},
		GetNvLinkRemoteDeviceTypeFunc: func(l int) (nvml.IntNvLinkDeviceType, nvml.Return) {
			fl, r := link(l)
			if r != nvml.SUCCESS {
				return 0, r
			}
			return fl.typ, fl.typRet
		},
		GetNvLinkRemotePciInfoFunc: func(l int) (nvml.PciInfo, nvml.Return) {
			fl, r := link(l)
			if r != nvml.SUCCESS {
				return nvml.PciInfo{}, r
			}
			return pciInfo(fl.remote), fl.pciRet
		},
	}
	return d
}

func migDevice(m fakeMIG, ret func(string) nvml.Return) nvml.Device {
	return &mock.Device{
		GetUUIDFunc:              func() (string, nvml.Return) { return m.uuid, nvml.SUCCESS },
		GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return m.gi, nvml.SUCCESS },
		GetComputeInstanceIdFunc: func() (int, nvml.Return) { return m.ci, nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			if m.memMiB == 0 {
				return nvml.Memory{}, nvml.ERROR_NOT_SUPPORTED
			}
			return nvml.Memory{Total: m.memMiB << 20}, nvml.SUCCESS
		},
	}
}

// gpuInstances lists g's GPU instances, those of its MIG devices and the
// bare ones, by id.
func (g *fakeGPU) gpuInstances() []fakeGI {
	out := slices.Clone(g.bareGIs)
	for _, m := range g.migs {
		if !slices.ContainsFunc(out, func(gi fakeGI) bool { return gi.gi == m.gi }) {
			out = append(out, fakeGI{gi: m.gi, giProfile: m.giProfile, start: m.start, len: m.len})
		}
	}
	slices.SortFunc(out, func(a, b fakeGI) int { return a.gi - b.gi })
	return out
}

// gpuInstance answers for GPU instance gi of g; its compute instances are
// g's MIG devices with that GI.
func gpuInstance(g *fakeGPU, gi fakeGI, ret func(string) nvml.Return) nvml.GpuInstance {
	var mine []fakeMIG
	for _, m := range g.migs {
		if m.gi == gi.gi {
			mine = append(mine, m)
		}
	}
	ci := func(m fakeMIG) nvml.ComputeInstance {
		return &mock.ComputeInstance{GetInfoFunc: func() (nvml.ComputeInstanceInfo, nvml.Return) {
			return nvml.ComputeInstanceInfo{Id: uint32(m.ci), ProfileId: uint32(m.ciProfile)}, nvml.SUCCESS
		}}
	}
	return &mock.GpuInstance{
		GetInfoFunc: func() (nvml.GpuInstanceInfo, nvml.Return) {
			return nvml.GpuInstanceInfo{
				Id:        uint32(gi.gi),
				ProfileId: uint32(gi.giProfile),
				Placement: nvml.GpuInstancePlacement{Start: uint32(gi.start), Size: uint32(gi.len)},
			}, nvml.SUCCESS
		},
		GetComputeInstanceByIdFunc: func(id int) (nvml.ComputeInstance, nvml.Return) {
			if r := ret("GetComputeInstanceById"); r != nvml.SUCCESS {
				return nil, r
			}
			for _, m := range mine {
				if m.ci == id {
					return ci(m), nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		GetComputeInstancesFunc: func(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
			if r := ret("GetComputeInstances"); r != nvml.SUCCESS {
				return nil, r
			}
			out := []nvml.ComputeInstance{}
			for _, m := range mine {
				if uint32(m.ciProfile) == info.Id {
					out = append(out, ci(m))
				}
			}
			return out, nvml.SUCCESS
		},
		GetComputeInstanceProfileInfoFunc: func(p, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
			s, ok := ciSlices[p]
			if !ok || eng != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
				return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
			}
			return nvml.ComputeInstanceProfileInfo{Id: uint32(p), SliceCount: s}, nvml.SUCCESS
		},
	}
}
