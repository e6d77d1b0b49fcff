package devicemodel

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// CapacityShares is the capacity of a shared device: how many claims may
// share it (the config's time-slicing replicas); a claim takes one unless it
// asks for more.
const CapacityShares = "shares"

// TaintUnhealthy is the device taint an unhealthy device carries: the
// scheduler gives it to no new claim that does not tolerate it (NoSchedule),
// and with NoExecute the pods whose claims hold it are evicted.
const TaintUnhealthy = DriverName + "/unhealthy"

// TaintCordoned is the device taint of a device on a GPU an admin cordoned
// (the Node's gpu-agent.io/cordon annotation). It is a key of its own so
// that a claim tolerating unhealthy devices is not given a cordoned one,
// and it is always NoSchedule: a cordon takes a GPU from new work, it
// never evicts the pods that hold it.
const TaintCordoned = DriverName + "/cordoned"

// TaintClosing is the device taint of the partitions of a GPU that stops
// offering MIG devices on demand (a surplus spare): for a grace period
// before they leave the slices, the scheduler gives them to no new claim,
// and a claim it gave one of them just before is still counted against
// the GPU's counters, and prepared.
const TaintClosing = DriverName + "/closing"

// Attributes Kubernetes defines for every driver (KEP-4381's standard
// names, k8s.io/dynamic-resource-allocation/deviceattribute), so that a
// claim can align devices of different drivers, a GPU with a NIC under one
// PCIe root. NVIDIA's driver publishes the same names.
const (
	AttrPCIBusID resourceapi.QualifiedName = "resource.kubernetes.io/pciBusID"
	AttrPCIeRoot resourceapi.QualifiedName = "resource.kubernetes.io/pcieRoot"
	AttrNUMANode resourceapi.QualifiedName = "resource.kubernetes.io/numaNode"
)

// AttrNVLinkClique is gpu-agent's own: GPUs with one value have NVLink
// between every pair (gpu.Topology.NVLinkCliques).
const AttrNVLinkClique resourceapi.QualifiedName = "nvlinkClique"

// Limits of one ResourceSlice: devices (fewer when they consume counters or
// carry taints), and counter sets.
const (
	maxDevicesPerSlice        = 128
	maxCountingDevicesInSlice = 64
	maxCounterSetsPerSlice    = 8
)

// Dropped is what the API server has been seen to drop from ResourceSlices
// because the feature behind it is off. A device that needs a dropped field
// to be offered safely is left out instead of being published without it.
type Dropped struct {
	// Taints (DRADeviceTaints): unhealthy and cordoned devices are left
	// out, since without their taint the scheduler would hand them out.
	Taints bool
	// Partitions (DRAPartitionableDevices): shared counters and the devices'
	// consumption of them. Partition devices are left out, since without
	// counters the scheduler would give out overlapping placements, and so
	// are the counter sets; other devices are published without counters.
	Partitions bool
	// Sharing (DRAConsumableCapacity): allowMultipleAllocations and capacity
	// policies. Shared devices (Shares above 1) are left out, since without
	// them a time-sliced or MPS device could not be shared as the config
	// asks, and the one claim given it would get no share of its own.
	Sharing bool
}

// Withholds reports whether d must be left out of the slices, its needed
// fields being dropped.
func (x Dropped) Withholds(d Device) bool {
	return x.Taints && (d.Unhealthy != "" || d.Cordoned != "") || x.Partitions && d.Partition || x.Sharing && d.Shares > 1
}

// LeftOut is one feature off on the API server and what it leaves out.
type LeftOut struct {
	Feature string `json:"feature"`
	Devices string `json:"devices"`
}

// droppedFeatures are the features whose fields Dropped latches, in the
// order /status lists them.
var droppedFeatures = []string{"DRADeviceTaints", "DRAPartitionableDevices", "DRAConsumableCapacity"}

// LeftOut lists the latched features with what each leaves out (nil when
// none is).
func (x Dropped) LeftOut() []LeftOut {
	var out []LeftOut
	for _, f := range droppedFeatures {
		if flag, what := x.Flag(f); *flag {
			out = append(out, LeftOut{Feature: f, Devices: what})
		}
	}
	return out
}

// Flag is the field of x that the dropped fields of feature (as
// DroppedFieldsError.DisabledFeatures names it) set, and what that leaves
// out; nil for a feature whose fields the driver does not publish.
func (x *Dropped) Flag(feature string) (*bool, string) {
	switch feature {
	case "DRADeviceTaints":
		return &x.Taints, "unhealthy and cordoned devices, which cannot carry their taint"
	case "DRAPartitionableDevices":
		return &x.Partitions, "the counter sets and every MIG device made on demand, which without counters could be given out overlapping"
	case "DRAConsumableCapacity":
		return &x.Sharing, "devices shared by time-slicing or MPS, which cannot be shared by several claims"
	}
	return nil, ""
}

// Resources is what the kubelet plugin helper publishes for pool on
// nodeName: one pool named for the node; the GPUs' counter sets in slices
// of their own (a slice holds devices or counters, not both), then the
// devices, as many slices as the API's limits need. Unhealthy devices carry
// the taint TaintUnhealthy, cordoned ones TaintCordoned. What the API server drops (dropped)
// is left out, with the devices that need it.
func Resources(nodeName string, pool *Pool, generation int64, dropped Dropped) resourceslice.DriverResources {
	var out []resourceslice.Slice
	sets := pool.CounterSets
	if dropped.Partitions {
		sets = nil
	}
	for len(sets) > 0 {
		n := min(len(sets), maxCounterSetsPerSlice)
		var cs []resourceapi.CounterSet
		for _, set := range sets[:n] {
			cs = append(cs, resourceapi.CounterSet{Name: CounterSetName(set.GPU), Counters: apiCounters(set.Counters)})
		}
		out = append(out, resourceslice.Slice{SharedCounters: cs})
		sets = sets[n:]
	}
	var devs []Device
	limit := maxDevicesPerSlice
	emit := func(ds []Device) {
		api := make([]resourceapi.Device, 0, len(ds))
		for _, d := range sliceOrder(ds) {
			a := apiDevice(d)
			if d.Type == TypeMIG && pool.MIGAttributes != nil {
				keepAttributes(a.Attributes, pool.MIGAttributes)
			}
			api = append(api, a)
		}
		out = append(out, resourceslice.Slice{Devices: api})
	}
	flush := func() {
		if len(devs) > 0 {
			emit(devs)
		}
		devs, limit = nil, maxDevicesPerSlice
	}
	// One GPU's devices in one slice (a GPU's partitions and the counter
	// set they draw on stay together), each slice in sliceOrder.
	for _, group := range byGPU(pool.Devices, pool.GPUOrder) {
		var kept []Device
		counting := false
		for _, d := range group {
			if dropped.Withholds(d) {
				continue
			}
			if dropped.Partitions {
				// The whole GPU of a dynamic MIG GPU draws on its counters only
				// to exclude its partitions, which are left out.
				d.Consumes = nil
			}
			if dropped.Taints {
				// Without taints a closing partition is offered as it was
				// until it goes: leaving it out at once could drop one just
				// given to a claim.
				d.Closing = false
			}
			counting = counting || len(d.Consumes) > 0 || len(taints(d)) > 0
			kept = append(kept, d)
		}
		if counting {
			limit = maxCountingDevicesInSlice
		}
		if len(devs)+len(kept) > limit {
			flush()
			if counting {
				limit = maxCountingDevicesInSlice
			}
		}
		for len(kept) > limit { // a GPU with more devices than a slice holds
			emit(kept[:limit])
			kept = kept[limit:]
		}
		devs = append(devs, kept...)
	}
	flush()
	if len(out) == 0 {
		out = []resourceslice.Slice{{}} // an empty pool, still published: the node has none
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Generation: generation, Slices: out},
	}}
}

// byGPU groups devices by physical GPU, the GPUs in order (then the rest
// by index), each group in publishOrder.
func byGPU(devs []Device, order []int) [][]Device {
	groups := map[int][]Device{}
	for _, d := range devs {
		groups[d.ParentIndexOrSelf()] = append(groups[d.ParentIndexOrSelf()], d)
	}
	rank := func(idx int) int {
		if r := slices.Index(order, idx); r >= 0 {
			return r
		}
		return len(order) + idx
	}
	var out [][]Device
	for _, idx := range slices.SortedFunc(maps.Keys(groups), func(a, b int) int { return rank(a) - rank(b) }) {
		g := groups[idx]
		slices.SortStableFunc(g, publishOrder)
		out = append(out, g)
	}
	return out
}

// sliceOrder puts one slice's devices in the order the scheduler's
// allocator should walk them. For every claim on every node it evaluates
// the class's and the request's CEL selectors on each device in turn until
// one fits, and an evaluation (which builds a map of every attribute) is
// most of what a Filter call costs (docs/dra-devices.md, "Scale"). So each
// kind of device a claim may ask for comes early: the whole GPUs (in the
// slice's GPU order) alternate with the first device of each MIG profile
// (existing MIG devices from the smallest profile up, then partitions by
// profile), and the other MIG devices follow (or, where they are no more
// than the whole GPUs, each comes with the first of its profile). Within
// one kind the order stands: a claim is given the device it would be given
// in publishOrder, after fewer evaluations of devices of other kinds.
func sliceOrder(ds []Device) []Device {
	kind := func(d Device) int {
		switch {
		case d.Partition:
			return 2
		case d.Type == TypeMIG:
			return 1
		}
		return 0
	}
	var whole, mig []Device
	for _, d := range ds {
		if kind(d) == 0 {
			whole = append(whole, d)
		} else {
			mig = append(mig, d)
		}
	}
	slices.SortStableFunc(mig, func(a, b Device) int {
		if ka, kb := kind(a), kind(b); ka != kb {
			return ka - kb
		}
		if kind(a) == 1 {
			if c := a.Placement.Size - b.Placement.Size; c != 0 {
				return c
			}
		}
		return strings.Compare(a.Profile, b.Profile)
	})
	// groups: the MIG devices of one kind and profile each.
	var groups [][]Device
	for i, d := range mig {
		if i == 0 || kind(d) != kind(mig[i-1]) || d.Profile != mig[i-1].Profile {
			groups = append(groups, nil)
		}
		groups[len(groups)-1] = append(groups[len(groups)-1], d)
	}
	// Where MIG devices are no more than the whole GPUs (a spare layout
	// beside whole GPUs), each profile's devices come together: a claim for
	// the second of one does not walk every whole GPU first, and a whole
	// GPU claim walks at most as many MIG devices as there are whole GPUs.
	together := len(mig) <= len(whole)
	var rest []Device
	out := make([]Device, 0, len(ds))
	for i := range max(len(whole), len(groups)) {
		if i < len(whole) {
			out = append(out, whole[i])
		}
		if i >= len(groups) {
			continue
		}
		if together {
			out = append(out, groups[i]...)
		} else {
			out = append(out, groups[i][0])
			rest = append(rest, groups[i][1:]...)
		}
	}
	return append(out, rest...)
}

// publishOrder: existing devices first (whole GPU, then MIG devices), then
// the partitions by profile and, for one profile, from the highest
// placement down. The scheduler takes the first free placement in this
// order, so small instances fill a GPU from its top and leave the low
// placements, which the large profiles need, free: in test/bench's
// mig-fragmentation runs on an H100 this fails 8% of the 4-slice requests
// that have room, against 34% lowest-first.
func publishOrder(a, b Device) int {
	if a.Partition != b.Partition {
		if a.Partition {
			return 1
		}
		return -1
	}
	if !a.Partition {
		if a.Type != b.Type {
			return strings.Compare(a.Type, b.Type) // "gpu" before "mig"
		}
		return strings.Compare(a.Name, b.Name)
	}
	if a.Profile != b.Profile {
		return strings.Compare(a.Profile, b.Profile)
	}
	return b.Placement.Start - a.Placement.Start
}

func apiCounters(c map[string]int64) map[string]resourceapi.Counter {
	out := make(map[string]resourceapi.Counter, len(c))
	for name, v := range c {
		out[name] = resourceapi.Counter{Value: *resource.NewQuantity(v, resource.DecimalSI)}
	}
	return out
}

func apiDevice(d Device) resourceapi.Device {
	out := resourceapi.Device{Name: d.Name, Attributes: attributes(d), Capacity: capacities(d)}
	if d.Shares > 1 {
		one, n := resource.NewQuantity(1, resource.DecimalSI), resource.NewQuantity(int64(d.Shares), resource.DecimalSI)
		out.AllowMultipleAllocations = ptr.To(true)
		// Every capacity of a shared device is consumed by its claims, all
		// of it unless its policy says less: time-sliced claims share the
		// memory and the engines, so each takes none of them unless it asks.
		zero := resource.NewQuantity(0, resource.BinarySI)
		for name, c := range out.Capacity {
			c.RequestPolicy = &resourceapi.CapacityRequestPolicy{Default: zero, ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: zero}}
			if name == "memory" && d.MPS {
				c.RequestPolicy = mpsMemoryPolicy(d.MemoryBytes, d.Shares)
			}
			out.Capacity[name] = c
		}
		out.Capacity[CapacityShares] = resourceapi.DeviceCapacity{Value: *n, RequestPolicy: &resourceapi.CapacityRequestPolicy{
			Default: one, ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: one, Max: n, Step: one},
		}}
	}
	if len(d.Consumes) > 0 {
		out.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{
			CounterSet: CounterSetName(d.ParentIndexOrSelf()), Counters: apiCounters(d.Consumes),
		}}
	}
	out.Taints = taints(d)
	return out
}

// taints are the device taints d is published with (nil: none).
func taints(d Device) []resourceapi.DeviceTaint {
	var out []resourceapi.DeviceTaint
	if d.Unhealthy != "" {
		effect := resourceapi.DeviceTaintEffectNoSchedule
		if d.Evict {
			effect = resourceapi.DeviceTaintEffectNoExecute
		}
		out = append(out, resourceapi.DeviceTaint{Key: TaintUnhealthy, Effect: effect})
	}
	if d.Cordoned != "" {
		out = append(out, resourceapi.DeviceTaint{Key: TaintCordoned, Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	if d.Closing {
		out = append(out, resourceapi.DeviceTaint{Key: TaintClosing, Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	return out
}

// attributes are the device's attributes, under NVIDIA's driver's names
// where it has the attribute (README, "DRA attributes and capacities").
// At most maxAttributes: the scheduler decodes each device's attributes
// into a Go map, whose table doubles past 14 entries (7/8 of 16 slots),
// and one attribute more costs every node's every device half again its
// decoded size (6.7 KB instead of 4.5 for a MIG device).
func attributes(d Device) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: ptr.To(s)} }
	num := func(n int) resourceapi.DeviceAttribute {
		return resourceapi.DeviceAttribute{IntValue: ptr.To(int64(n))}
	}
	ver := func(v string) resourceapi.DeviceAttribute {
		return resourceapi.DeviceAttribute{VersionValue: ptr.To(v)}
	}
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"type":                  str(d.Type),
		"productName":           str(d.ProductName),
		"cudaComputeCapability": ver(fmt.Sprintf("%d.%d.0", d.CC.Major, d.CC.Minor)),
	}
	// A MIG device made on demand has no UUID or index until it exists, as
	// in NVIDIA's driver: an empty value would only cost every node's
	// slices bytes.
	if d.UUID != "" {
		attrs["uuid"] = str(d.UUID)
	}
	if d.Index >= 0 {
		attrs["index"] = num(d.Index)
	}
	optional := func(name resourceapi.QualifiedName, v string) {
		if v != "" {
			attrs[name] = str(v)
		}
	}
	optional("architecture", d.Architecture)
	optional("brand", d.Brand)
	optional(AttrPCIBusID, d.PCIBusID)
	optional(AttrPCIeRoot, d.PCIeRoot)
	if v, ok := semver(d.DriverVersion); ok {
		attrs["driverVersion"] = ver(v)
	}
	if v, ok := semver(d.CUDADriverVersion); ok {
		attrs["cudaDriverVersion"] = ver(v)
	}
	if d.NUMANode >= 0 {
		attrs[AttrNUMANode] = num(d.NUMANode)
	}
	if d.Type == TypeMIG {
		attrs["profile"] = str(d.Profile)
		attrs["parentUUID"] = str(d.ParentUUID)
		return attrs
	}
	attrs["minor"] = num(d.Minor)
	if d.NVLinkClique >= 0 {
		attrs[AttrNVLinkClique] = num(d.NVLinkClique)
	}
	return attrs
}

// keepAttributes deletes from attrs all but type, profile and keep (the
// config's dra.migDeviceAttributes, names as published).
func keepAttributes(attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, keep []string) {
	for name := range attrs {
		if name != "type" && name != "profile" && !slices.Contains(keep, string(name)) {
			delete(attrs, name)
		}
	}
}

// maxAttributes is the most attributes a device carries (see attributes).
const maxAttributes = 14

// capacities are the device's memory and, where known, its engines, under
// NVIDIA's driver's names: claims written for it select MIG devices with
// e.g. device.capacity['gpu.nvidia.com'].multiprocessors.
func capacities(d Device) map[resourceapi.QualifiedName]resourceapi.DeviceCapacity {
	count := func(n int64) resourceapi.DeviceCapacity {
		return resourceapi.DeviceCapacity{Value: *resource.NewQuantity(n, resource.DecimalSI)}
	}
	out := map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
		"memory": {Value: *resource.NewQuantity(int64(d.MemoryBytes), resource.BinarySI)},
	}
	if e := d.Engines; e != nil {
		out["multiprocessors"] = count(e.Multiprocessors)
		out["copyEngines"] = count(e.CopyEngines)
		out["decoders"] = count(e.Decoders)
		out["encoders"] = count(e.Encoders)
		out["jpegEngines"] = count(e.JPEGEngines)
		out["ofaEngines"] = count(e.OFAEngines)
	}
	return out
}

// mpsMemoryPolicy is the memory policy of a device shared by shares MPS
// clients, whose memory is pinned (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): an
// equal part by default, in whole MiB, at least one. The API server rejects
// the whole slice unless min <= default and min + step <= the capacity, so a
// device whose equal part is under 1 MiB gets no policy (nil): each claim
// then takes all of the memory unless it asks for less, which never
// over-commits it.
func mpsMemoryPolicy(memoryBytes uint64, shares int) *resourceapi.CapacityRequestPolicy {
	const mib = 1 << 20
	part := memoryBytes / uint64(shares) / mib * mib
	if part < mib {
		return nil
	}
	step := resource.NewQuantity(mib, resource.BinarySI)
	return &resourceapi.CapacityRequestPolicy{
		Default:    resource.NewQuantity(int64(part), resource.BinarySI),
		ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: step, Step: step},
	}
}

// semver turns NVML's driver version ("550.54.15", "535.104") into the
// semantic version a version attribute needs ("550.54.15", "535.104.0").
func semver(v string) (string, bool) {
	var major, minor, patch int
	n, _ := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &patch)
	if n < 2 {
		return "", false
	}
	return fmt.Sprintf("%d.%d.%d", major, minor, patch), true
}

// Footprint is what a pool costs once published: its devices, the MIG
// devices among them and those of them made on demand, its counter sets and
// their counters, and the bytes of its ResourceSlices as JSON (what the API
// server stores and every scheduler reads, node by node, at each scheduling
// attempt).
type Footprint struct {
	Devices, MIG, Partitions, CounterSets, Counters, Consumptions, Slices, Bytes int
}

// FootprintOf is pool's Footprint as published for nodeName.
func FootprintOf(nodeName string, pool *Pool) (Footprint, error) {
	var f Footprint
	if pool == nil {
		return f, nil
	}
	for _, d := range pool.Devices {
		f.Devices++
		if d.Type == TypeMIG {
			f.MIG++
		}
		if d.Partition {
			f.Partitions++
		}
		f.Consumptions += len(d.Consumes)
	}
	for _, s := range pool.CounterSets {
		f.CounterSets++
		f.Counters += len(s.Counters)
	}
	res := Resources(nodeName, pool, 1, Dropped{})
	for _, s := range res.Pools[nodeName].Slices {
		spec := resourceapi.ResourceSliceSpec{
			Driver: DriverName, NodeName: ptr.To(nodeName),
			Pool:    resourceapi.ResourcePool{Name: nodeName, Generation: 1, ResourceSliceCount: int64(len(res.Pools[nodeName].Slices))},
			Devices: s.Devices, SharedCounters: s.SharedCounters,
		}
		b, err := json.Marshal(resourceapi.ResourceSlice{Spec: spec})
		if err != nil {
			return f, fmt.Errorf("ResourceSlice of %s: %w", nodeName, err)
		}
		f.Slices++
		f.Bytes += len(b)
	}
	return f, nil
}
