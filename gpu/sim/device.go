package sim

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/google/uuid"
)

const mib = 1 << 20

// device is a GPU handle or, with ci set, a MIG device handle. Its methods
// shadow the embedded mock's (one level deeper), which answer every call the
// sim does not model.
type device struct {
	mockDevice
	n    *Node
	g    *gpuState
	ci   *computeInstance // nil for a whole GPU
	uuid string           // MIG devices only; a GPU's is g.uuid
}

type mockDevice struct{ *mock.Device }

var _ nvml.Device = (*device)(nil)

func (n *Node) newDevice(g *gpuState, ci *computeInstance) *device {
	d := &device{mockDevice: mockDevice{&mock.Device{}}, n: n, g: g, ci: ci}
	if ci != nil {
		name := fmt.Sprintf("%s/gpu/%d/gi/%d/ci/%d", n.spec.name, g.index, ci.gi.id, ci.id)
		d.uuid = "MIG-" + uuid.NewSHA1(uuidNamespace, []byte(name)).String()
	}
	fillFuncs(d.Device, func(call string) nvml.Return {
		n.mu.Lock()
		defer n.mu.Unlock()
		if r := d.check(call, true); r != nvml.SUCCESS {
			return r
		}
		return nvml.ERROR_NOT_SUPPORTED
	})
	return d
}

// check is the common gate of every device call; callers hold n.mu. call
// is the nvml.Device method's name, which FailCalls matches; migOK says
// whether the call is modelled on MIG device handles.
func (d *device) check(call string, migOK bool) nvml.Return {
	if r := d.n.ready(); r != nvml.SUCCESS {
		return r
	}
	// An injected failure stands for the driver failing the call itself, so
	// it comes before the sim's own answers (lost GPU, stale handle).
	if r := d.n.injected(d.g, call); r != nvml.SUCCESS {
		return r
	}
	if d.g.lost {
		return nvml.ERROR_GPU_IS_LOST
	}
	if d.ci != nil {
		if d.ci.destroyed {
			// NVML: a MIG device handle is invalid once its CI is gone.
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if !migOK {
			return nvml.ERROR_NOT_SUPPORTED
		}
	}
	return nvml.SUCCESS
}

// lock takes the node lock, which the caller releases, and runs check.
func (d *device) lock(call string, migOK bool) nvml.Return {
	d.n.mu.Lock()
	return d.check(call, migOK)
}

func (d *device) model() *model { return d.n.spec.model }

// get answers a read-only NVML call: f runs under the node lock when the
// handle may answer (see check), else the zero value and check's code.
func get[T any](d *device, call string, migOK bool, f func() T) (T, nvml.Return) {
	r := d.lock(call, migOK)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		var zero T
		return zero, r
	}
	return f(), nvml.SUCCESS
}

// GetIndex is the NVML index; MIG device handles have none.
func (d *device) GetIndex() (int, nvml.Return) {
	return get(d, "GetIndex", false, func() int { return d.g.index })
}

// GetUUID returns "GPU-..." or, for a MIG device, "MIG-...".
func (d *device) GetUUID() (string, nvml.Return) {
	r := d.lock("GetUUID", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return "", r
	}
	if d.ci != nil {
		return d.uuid, nvml.SUCCESS
	}
	return d.g.uuid, nvml.SUCCESS
}

// GetName returns the product name; a MIG device appends " MIG <profile>".
func (d *device) GetName() (string, nvml.Return) {
	r := d.lock("GetName", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return "", r
	}
	if d.ci != nil {
		return d.model().name + " MIG " + d.ci.profileName(), nvml.SUCCESS
	}
	return d.model().name, nvml.SUCCESS
}

// GetPciInfo returns the GPU's PCI address and ids.
func (d *device) GetPciInfo() (nvml.PciInfo, nvml.Return) {
	return get(d, "GetPciInfo", false, func() nvml.PciInfo { return d.g.pci })
}

// GetMinorNumber is N in /dev/nvidiaN, the index on simulated nodes.
func (d *device) GetMinorNumber() (int, nvml.Return) {
	return get(d, "GetMinorNumber", false, func() int { return d.g.index })
}

// GetNumaNodeId returns the profile's NUMA node of the GPU.
func (d *device) GetNumaNodeId() (int, nvml.Return) {
	return get(d, "GetNumaNodeId", false, func() int { return d.g.numa })
}

// GetSerial is a stable 13-digit board serial derived from the UUID.
func (d *device) GetSerial() (string, nvml.Return) {
	r := d.lock("GetSerial", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return "", r
	}
	sum := uint64(0)
	for _, c := range d.g.uuid {
		sum = sum*31 + uint64(c)
	}
	return "132" + fmt.Sprintf("%010d", sum%10_000_000_000), nvml.SUCCESS
}

// GetCudaComputeCapability returns the model's compute capability.
func (d *device) GetCudaComputeCapability() (int, int, nvml.Return) {
	r := d.lock("GetCudaComputeCapability", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, 0, r
	}
	return d.model().ccMajor, d.model().ccMinor, nvml.SUCCESS
}

// GetArchitecture returns the model's architecture.
func (d *device) GetArchitecture() (nvml.DeviceArchitecture, nvml.Return) {
	return get(d, "GetArchitecture", true, func() nvml.DeviceArchitecture { return d.model().arch })
}

// GetBrand returns the model's brand.
func (d *device) GetBrand() (nvml.BrandType, nvml.Return) {
	return get(d, "GetBrand", true, func() nvml.BrandType { return d.model().brand })
}

// GetAttributes describes the whole GPU or, on a MIG device, its instance.
func (d *device) GetAttributes() (nvml.DeviceAttributes, nvml.Return) {
	r := d.lock("GetAttributes", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.DeviceAttributes{}, r
	}
	m := d.model()
	if d.ci == nil {
		a := nvml.DeviceAttributes{
			MultiprocessorCount: m.sms, SharedCopyEngineCount: m.copyEngines, MemorySizeMB: m.memMiB,
		}
		return a, nvml.SUCCESS
	}
	gp, cp := d.ci.gi.prof, d.ci.prof
	return nvml.DeviceAttributes{
		MultiprocessorCount:       cp.MultiprocessorCount,
		SharedCopyEngineCount:     gp.ce,
		SharedDecoderCount:        gp.dec,
		SharedEncoderCount:        gp.enc,
		SharedJpegCount:           gp.jpeg,
		SharedOfaCount:            gp.ofa,
		GpuInstanceSliceCount:     gp.slice,
		ComputeInstanceSliceCount: cp.SliceCount,
		MemorySizeMB:              gp.memMiB,
	}, nvml.SUCCESS
}

// GetEccMode: ECC is on, now and after reboot, on every simulated GPU.
func (d *device) GetEccMode() (nvml.EnableState, nvml.EnableState, nvml.Return) {
	r := d.lock("GetEccMode", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, 0, r
	}
	return nvml.FEATURE_ENABLED, nvml.FEATURE_ENABLED, nvml.SUCCESS
}

// peer resolves another handle of this node to its GPU; MIG handles and
// foreign handles are invalid arguments for topology queries.
func (d *device) peer(other nvml.Device) (*gpuState, nvml.Return) {
	o, ok := other.(*device)
	if !ok || o == nil || o.n != d.n || o.ci != nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if o.g.lost {
		return nil, nvml.ERROR_GPU_IS_LOST
	}
	return o.g, nvml.SUCCESS
}

// GetTopologyCommonAncestor returns the profile's PCIe level between the two
// GPUs; a GPU with itself is TOPOLOGY_INTERNAL.
func (d *device) GetTopologyCommonAncestor(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
	r := d.lock("GetTopologyCommonAncestor", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	o, r := d.peer(other)
	if r != nvml.SUCCESS {
		return 0, r
	}
	if o == d.g {
		return nvml.TOPOLOGY_INTERNAL, nvml.SUCCESS
	}
	return d.n.spec.level(d.g.index, o.index), nvml.SUCCESS
}

// GetTopologyNearestGpus returns the other GPUs at most level away.
func (d *device) GetTopologyNearestGpus(level nvml.GpuTopologyLevel) ([]nvml.Device, nvml.Return) {
	r := d.lock("GetTopologyNearestGpus", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	if level > nvml.TOPOLOGY_SYSTEM {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	var out []nvml.Device
	for _, g := range d.n.gpus {
		if g != d.g && d.n.spec.level(d.g.index, g.index) <= level {
			out = append(out, g.handle)
		}
	}
	return out, nvml.SUCCESS
}

// link checks an NVLink index: beyond NVML's maximum it is an invalid
// argument, beyond this GPU's lanes (or on a GPU without NVLink) unsupported.
func (d *device) link(link int) (linkEnd, nvml.Return) {
	if link < 0 || link >= nvml.NVLINK_MAX_LINKS {
		return linkEnd{}, nvml.ERROR_INVALID_ARGUMENT
	}
	if link >= len(d.g.links) {
		return linkEnd{}, nvml.ERROR_NOT_SUPPORTED
	}
	return d.g.links[link], nvml.SUCCESS
}

// GetNvLinkState: every wired lane is active.
func (d *device) GetNvLinkState(link int) (nvml.EnableState, nvml.Return) {
	r := d.lock("GetNvLinkState", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	if _, r := d.link(link); r != nvml.SUCCESS {
		return 0, r
	}
	return nvml.FEATURE_ENABLED, nvml.SUCCESS
}

// GetNvLinkVersion returns the model's NVLink generation.
func (d *device) GetNvLinkVersion(link int) (uint32, nvml.Return) {
	r := d.lock("GetNvLinkVersion", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	if _, r := d.link(link); r != nvml.SUCCESS {
		return 0, r
	}
	return d.model().nvlinkVersion, nvml.SUCCESS
}

// GetNvLinkRemoteDeviceType says whether the lane ends at a GPU or an NVSwitch.
func (d *device) GetNvLinkRemoteDeviceType(link int) (nvml.IntNvLinkDeviceType, nvml.Return) {
	r := d.lock("GetNvLinkRemoteDeviceType", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	end, r := d.link(link)
	if r != nvml.SUCCESS {
		return 0, r
	}
	if end.gpu < 0 {
		return nvml.NVLINK_DEVICE_TYPE_SWITCH, nvml.SUCCESS
	}
	return nvml.NVLINK_DEVICE_TYPE_GPU, nvml.SUCCESS
}

// GetNvLinkRemotePciInfo returns the PCI info of the GPU or NVSwitch at the
// far end of the lane.
func (d *device) GetNvLinkRemotePciInfo(link int) (nvml.PciInfo, nvml.Return) {
	r := d.lock("GetNvLinkRemotePciInfo", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.PciInfo{}, r
	}
	end, r := d.link(link)
	if r != nvml.SUCCESS {
		return nvml.PciInfo{}, r
	}
	if end.gpu < 0 {
		return d.n.switchPCI[end.sw], nvml.SUCCESS
	}
	return d.n.gpus[end.gpu].pci, nvml.SUCCESS
}

// GetUtilizationRates: NVML does not report utilization of MIG-enabled GPUs.
func (d *device) GetUtilizationRates() (nvml.Utilization, nvml.Return) {
	r := d.lock("GetUtilizationRates", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.Utilization{}, r
	}
	if d.g.migCurrent {
		return nvml.Utilization{}, nvml.ERROR_NOT_SUPPORTED
	}
	return nvml.Utilization{Gpu: d.g.gpuUtil, Memory: d.g.memUtil}, nvml.SUCCESS
}

// memory returns the total, reserved and used bytes of the GPU or of the MIG
// device's GPU instance. Used is what processes hold (SetMemoryUsed, or
// with MIG instances the sum over them, as NVML aggregates them on the
// GPU's handle); a GPU instance has nothing reserved.
func (d *device) memory() (total, reserved, used uint64) {
	if d.ci == nil {
		m := d.model()
		used = d.g.memUsed
		if d.g.migCurrent && len(d.g.gis) > 0 {
			used = 0
			for _, p := range d.g.procs {
				used += p.UsedGpuMemory
			}
		}
		return m.memMiB * mib, m.reservedMiB() * mib, min(used, m.usable())
	}
	for _, p := range d.g.procs {
		if p.GpuInstanceId == uint32(d.ci.gi.id) {
			used += p.UsedGpuMemory
		}
	}
	total = d.ci.gi.prof.memMiB * mib
	return total, 0, min(used, total)
}

// GetMemoryInfo counts reserved memory as used, as NVML's first version
// does; on a MIG device, its instance's memory.
func (d *device) GetMemoryInfo() (nvml.Memory, nvml.Return) {
	r := d.lock("GetMemoryInfo", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.Memory{}, r
	}
	total, reserved, used := d.memory()
	return nvml.Memory{Total: total, Used: used + reserved, Free: total - reserved - used}, nvml.SUCCESS
}

// GetMemoryInfo_v2 reports reserved memory apart from used.
func (d *device) GetMemoryInfo_v2() (nvml.Memory_v2, nvml.Return) {
	r := d.lock("GetMemoryInfo_v2", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.Memory_v2{}, r
	}
	total, reserved, used := d.memory()
	return nvml.Memory_v2{Version: 2, Total: total, Reserved: reserved, Used: used, Free: total - reserved - used}, nvml.SUCCESS
}

// GetTemperature knows the one sensor NVML defines, TEMPERATURE_GPU.
func (d *device) GetTemperature(sensor nvml.TemperatureSensors) (uint32, nvml.Return) {
	r := d.lock("GetTemperature", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	if sensor != nvml.TEMPERATURE_GPU {
		return 0, nvml.ERROR_INVALID_ARGUMENT
	}
	return d.g.tempC, nvml.SUCCESS
}

// GetPowerUsage returns milliwatts.
func (d *device) GetPowerUsage() (uint32, nvml.Return) {
	return get(d, "GetPowerUsage", false, func() uint32 { return d.g.powerMW })
}

// GetPowerManagementLimit returns the model's default limit in milliwatts.
func (d *device) GetPowerManagementLimit() (uint32, nvml.Return) {
	return get(d, "GetPowerManagementLimit", false, func() uint32 { return d.model().powerLimitMW })
}

// GetEnforcedPowerLimit equals the management limit on simulated GPUs.
func (d *device) GetEnforcedPowerLimit() (uint32, nvml.Return) {
	return get(d, "GetEnforcedPowerLimit", false, func() uint32 { return d.model().powerLimitMW })
}

// GetTotalEnergyConsumption is mJ since the node was built, the integral of
// the power readings over the injected clock.
func (d *device) GetTotalEnergyConsumption() (uint64, nvml.Return) {
	r := d.lock("GetTotalEnergyConsumption", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	d.g.advance(d.n)
	return uint64(d.g.energyMJ), nvml.SUCCESS
}

// GetClockInfo returns current clocks in MHz; graphics runs with SM.
func (d *device) GetClockInfo(t nvml.ClockType) (uint32, nvml.Return) {
	r := d.lock("GetClockInfo", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	switch t {
	case nvml.CLOCK_GRAPHICS, nvml.CLOCK_SM:
		return d.g.smMHz, nvml.SUCCESS
	case nvml.CLOCK_MEM:
		return d.g.memMHz, nvml.SUCCESS
	case nvml.CLOCK_VIDEO:
		return d.g.smMHz * 9 / 10, nvml.SUCCESS
	}
	return 0, nvml.ERROR_INVALID_ARGUMENT
}

// GetMaxClockInfo returns the model's maximum clocks in MHz.
func (d *device) GetMaxClockInfo(t nvml.ClockType) (uint32, nvml.Return) {
	r := d.lock("GetMaxClockInfo", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	m := d.model()
	switch t {
	case nvml.CLOCK_GRAPHICS, nvml.CLOCK_SM:
		return m.maxSMMHz, nvml.SUCCESS
	case nvml.CLOCK_MEM:
		return m.maxMemMHz, nvml.SUCCESS
	case nvml.CLOCK_VIDEO:
		return m.maxSMMHz * 9 / 10, nvml.SUCCESS
	}
	return 0, nvml.ERROR_INVALID_ARGUMENT
}

func (d *device) eccCount(e nvml.MemoryErrorType, c nvml.EccCounterType) (uint64, nvml.Return) {
	if e >= nvml.MEMORY_ERROR_TYPE_COUNT || c >= nvml.ECC_COUNTER_TYPE_COUNT {
		return 0, nvml.ERROR_INVALID_ARGUMENT
	}
	return d.g.ecc[e][c], nvml.SUCCESS
}

// GetTotalEccErrors returns the counters SetECC set; volatile ones clear on Reset.
func (d *device) GetTotalEccErrors(e nvml.MemoryErrorType, c nvml.EccCounterType) (uint64, nvml.Return) {
	r := d.lock("GetTotalEccErrors", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	return d.eccCount(e, c)
}

// GetMemoryErrorCounter puts every ECC error in device memory (DRAM); the
// other locations count none.
func (d *device) GetMemoryErrorCounter(e nvml.MemoryErrorType, c nvml.EccCounterType, loc nvml.MemoryLocation) (uint64, nvml.Return) {
	r := d.lock("GetMemoryErrorCounter", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	if loc >= nvml.MEMORY_LOCATION_COUNT {
		return 0, nvml.ERROR_INVALID_ARGUMENT
	}
	n, r := d.eccCount(e, c)
	if loc != nvml.MEMORY_LOCATION_DEVICE_MEMORY {
		n = 0
	}
	return n, r
}

// GetRemappedRows: Ampere and newer only, and (as NVML documents) not while
// MIG instances exist.
func (d *device) GetRemappedRows() (int, int, bool, bool, nvml.Return) {
	r := d.lock("GetRemappedRows", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, 0, false, false, r
	}
	if !d.model().rowRemap || (d.g.migCurrent && len(d.g.gis) > 0) {
		return 0, 0, false, false, nvml.ERROR_NOT_SUPPORTED
	}
	g := d.g
	return g.remapCorr, g.remapUnc, g.remapPending, g.remapFailure, nvml.SUCCESS
}

// GetFieldValues answers FI_DEV_GET_GPU_RECOVERY_ACTION (what the driver
// asks an admin to do after an error; cleared by a reset), the memory
// temperature (HBM models only), the PCIe replay counter, the energy
// counter and the NVLink throughput counters (KiB; scopeId a link or
// UINT_MAX for all of them; GPUs with NVLink only). Other fields are
// NOT_SUPPORTED, per value, as NVML reports them.
func (d *device) GetFieldValues(values []nvml.FieldValue) nvml.Return {
	r := d.lock("GetFieldValues", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return r
	}
	d.g.advance(d.n)
	for i := range values {
		values[i].Timestamp = d.n.opts.now().UnixMicro()
		d.fieldValue(&values[i])
	}
	return nvml.SUCCESS
}

// supportedEvents are the event types a data-center GPU reports on Linux.
const supportedEvents = nvml.EventTypeSingleBitEccError | nvml.EventTypeDoubleBitEccError |
	nvml.EventTypePState | nvml.EventTypeXidCriticalError | nvml.EventTypeClock

// GetSupportedEventTypes returns the mask RegisterEvents accepts.
func (d *device) GetSupportedEventTypes() (uint64, nvml.Return) {
	return get(d, "GetSupportedEventTypes", false, func() uint64 { return supportedEvents })
}

// RegisterEvents adds the GPU to set for eventTypes. As in NVML, a mask
// with any unsupported type registers nothing and returns NOT_SUPPORTED,
// and MIG device handles cannot register (events name their GI/CI instead).
func (d *device) RegisterEvents(eventTypes uint64, set nvml.EventSet) nvml.Return {
	r := d.lock("RegisterEvents", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return r
	}
	s, ok := set.(*eventSet)
	if !ok || s == nil || s.n != d.n || s.freed || eventTypes == 0 {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if eventTypes&^uint64(supportedEvents) != 0 {
		return nvml.ERROR_NOT_SUPPORTED
	}
	s.reg[d.g.index] |= eventTypes
	return nvml.SUCCESS
}
