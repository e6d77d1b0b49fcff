package devicemodel

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// DriverName is the DRA driver name, NVIDIA's, so that DeviceClasses and
// claims written for NVIDIA's driver can be reused unchanged.
const DriverName = "gpu.nvidia.com"

// CDIKind is the CDI vendor/class of the device names Prepare returns; the
// agent's CDI spec defines one CDI device per GPU and MIG UUID under it.
const CDIKind = "nvidia.com/gpu"

// Device types, the "type" attribute.
const (
	TypeGPU = "gpu"
	TypeMIG = "mig"
)

// Device is one device the node offers through DRA: a whole GPU (not in
// MIG mode) or an existing MIG device.
type Device struct {
	// Name is the device's name in the pool: "gpu-<index>" or
	// "gpu-<index>-mig-<gi>-<ci>"; a DNS label, unique on the node.
	Name string
	Type string
	UUID string
	// Index is the GPU's NVML index, or for a MIG device its index under
	// the parent; Minor is N in /dev/nvidiaN (of the parent for MIG).
	Index, Minor int
	ProductName  string
	// Architecture as NVIDIA's driver writes it ("Ampere", "Hopper").
	Architecture string
	Brand        string
	CC           gpu.ComputeCapability
	// DriverVersion is NVML's ("550.54.15"); CUDADriverVersion the CUDA
	// version the driver supports ("12.4").
	DriverVersion     string
	CUDADriverVersion string
	PCIBusID          string
	// PCIeRoot, NUMANode (-1: unknown) and NVLinkClique (-1: no NVLink;
	// gpu.Topology.NVLinkCliques) are what a claim aligns GPUs on with
	// matchAttribute; a MIG device has its GPU's.
	PCIeRoot     string
	NUMANode     int
	NVLinkClique int
	MemoryBytes  uint64
	// Engines are the device's compute and media engines, published as
	// capacities (nil: none published): a MIG device's from its GPU instance
	// profile, a whole GPU's only where its MIG devices are made on demand
	// (its largest profile's), as NVIDIA's driver does.
	Engines *Engines
	// MIG devices only.
	Profile     string
	ParentUUID  string
	ParentIndex int
	Placement   gpu.Placement
	// Unhealthy is why the device must not be used ("" when healthy): it is
	// published with a taint, NoSchedule unless Evict (NoExecute).
	Unhealthy string
	Evict     bool
	// Cordoned is why the device's GPU is out of service ("" when it is
	// not): an admin cordoned it. It is published with the NoSchedule taint
	// TaintCordoned, apart from Unhealthy, whatever the device's health.
	Cordoned string
	// Closing: a partition of a spare GPU found surplus (the config's
	// migOnDemand.spareGPUs), published with the NoSchedule taint
	// TaintClosing until it leaves the slices: no new claim is given it,
	// while one given it before the taint is still counted, and prepared.
	Closing bool
	// Partition: a MIG device that does not exist yet (dynamic MIG): Prepare
	// creates it at Placement with the GPU instance profile ProfileIndex.
	Partition    bool
	ProfileIndex int
	// Consumes are the counters of the GPU's counter set (CounterSetName of
	// the parent) the device uses while allocated; nil: none.
	Consumes map[string]int64
	// Shares, when above 1, lets that many claims share the device
	// (time-slicing, the config's replicas): it is published with
	// allowMultipleAllocations and a "shares" capacity each claim takes one
	// of by default.
	Shares int
	// MPS: the shares are MPS clients of the device's control daemon, so a
	// claim's memory is a hard limit: each takes an equal part of it by
	// default (time-sliced claims take none unless they ask).
	MPS bool
}

// Engines are the parts of a GPU a MIG profile gets, as NVML's GPU instance
// profile info counts them.
type Engines struct {
	Multiprocessors, CopyEngines, Decoders, Encoders, JPEGEngines, OFAEngines int64
}

// EnginesOf reads a GPU instance profile's engines.
func EnginesOf(info nvml.GpuInstanceProfileInfo) *Engines {
	return &Engines{
		Multiprocessors: int64(info.MultiprocessorCount),
		CopyEngines:     int64(info.CopyEngineCount),
		Decoders:        int64(info.DecoderCount),
		Encoders:        int64(info.EncoderCount),
		JPEGEngines:     int64(info.JpegCount),
		OFAEngines:      int64(info.OfaCount),
	}
}

// ParentIndexOrSelf is the index of the physical GPU the device is on.
func (d Device) ParentIndexOrSelf() int {
	if d.Type == TypeMIG {
		return d.ParentIndex
	}
	return d.Index
}

// CDIDevice is the fully qualified CDI device name a container that gets d
// is given.
func (d Device) CDIDevice() string {
	if d.Type == TypeMIG && strings.Contains(d.UUID, "/") {
		// An old driver's MIG UUID (MIG-GPU-<uuid>/<gi>/<ci>) is no CDI
		// name; the spec names the device by its indexes as well.
		return CDIKind + "=" + strconv.Itoa(d.ParentIndex) + ":" + strconv.Itoa(d.Index)
	}
	return CDIKind + "=" + d.UUID
}

// Pool is everything the node offers through DRA, ordered by name.
type Pool struct {
	Devices []Device
	// CounterSets are the shared counters of the GPUs whose MIG devices are
	// created on demand, by GPU index (see Partitions).
	CounterSets []CounterSet
	// GPUOrder lists GPU indexes in the order their devices are published
	// (PublishOrder); GPUs not in it follow in index order.
	GPUOrder []int
	// MIGAttributes, when not nil, are the only attributes MIG devices are
	// published with beside type and profile (the config's
	// dra.migDeviceAttributes).
	MIGAttributes []string
}

// CounterSet is one GPU's capacity that its devices draw on: the scheduler
// never allocates devices whose counters together exceed it.
type CounterSet struct {
	GPU      int
	Counters map[string]int64
}

// CounterSetName names GPU index's counter set.
func CounterSetName(index int) string { return fmt.Sprintf("gpu-%d-counters", index) }

// Device returns the device with the given name.
func (p *Pool) Device(name string) (Device, bool) {
	if p == nil {
		return Device{}, false
	}
	i, ok := slices.BinarySearchFunc(p.Devices, name, func(d Device, n string) int { return strings.Compare(d.Name, n) })
	if !ok {
		return Device{}, false
	}
	return p.Devices[i], true
}

// Equal reports whether p and q offer the same devices, the same way.
func (p *Pool) Equal(q *Pool) bool {
	if p == nil || q == nil {
		return p == q
	}
	return slices.EqualFunc(p.Devices, q.Devices, sameDevice) && slices.Equal(p.GPUOrder, q.GPUOrder) &&
		(p.MIGAttributes == nil) == (q.MIGAttributes == nil) && slices.Equal(p.MIGAttributes, q.MIGAttributes) && slices.EqualFunc(p.CounterSets, q.CounterSets, func(a, b CounterSet) bool {
		return a.GPU == b.GPU && maps.Equal(a.Counters, b.Counters)
	})
}

func sameDevice(a, b Device) bool { return reflect.DeepEqual(a, b) }

// GPUName and MIGName are the device names of a GPU and a MIG device.
func GPUName(index int) string { return fmt.Sprintf("gpu-%d", index) }

// MIGName names a MIG device by its parent and GPU/compute instance ids,
// which are unique on the GPU while the device exists.
func MIGName(parent, gi, ci int) string { return fmt.Sprintf("gpu-%d-mig-%d-%d", parent, gi, ci) }

// GPUBases returns, for each GPU of inv (by position), the attributes every
// device on it carries: identity, versions and where it sits (PCIe root,
// NUMA node, NVLink clique).
func GPUBases(inv *gpu.Inventory) []Device {
	if inv == nil {
		return nil
	}
	var cliques []int
	if t := inv.Topology; t != nil && t.Len() == len(inv.GPUs) {
		cliques = t.NVLinkCliques()
	}
	out := make([]Device, len(inv.GPUs))
	for i, g := range inv.GPUs {
		out[i] = Device{
			ProductName:       g.Name,
			Architecture:      g.ComputeCapability.Architecture(),
			Brand:             g.Brand,
			CC:                g.ComputeCapability,
			DriverVersion:     inv.DriverVersion,
			CUDADriverVersion: inv.CUDADriverVersion,
			PCIBusID:          g.PCIBusID,
			PCIeRoot:          g.PCIeRoot,
			NUMANode:          g.NUMANode,
			NVLinkClique:      -1,
			Minor:             g.Minor,
		}
		if cliques != nil {
			out[i].NVLinkClique = cliques[i]
		}
	}
	return out
}

// Devices lists what inv can offer through DRA, unhealthy ones marked with
// the reason unhealthy gives by UUID: every GPU not in MIG mode, and every
// MIG device, with its engines from its GPU model's profiles (by GPU name).
// A GPU whose MIG mode could not be read, or that is changing MIG mode
// (pending differs from current), is offered as neither: what it will be is
// not known.
func Devices(inv *gpu.Inventory, profiles map[string]mig.Profiles, unhealthy map[string]string) []Device {
	if inv == nil {
		return nil
	}
	bases := GPUBases(inv)
	var out []Device
	for i, g := range inv.GPUs {
		if g.Unknown(gpu.FactMIGMode) || g.MIG.Current != g.MIG.Pending {
			continue
		}
		base := bases[i]
		if !g.MIG.Current {
			d := base
			d.Name, d.Type, d.UUID, d.Index = GPUName(g.Index), TypeGPU, g.UUID, g.Index
			d.MemoryBytes, d.Unhealthy = g.MemoryBytes, unhealthy[g.UUID]
			out = append(out, d)
			continue
		}
		for _, m := range g.Instances {
			d := base
			d.Name, d.Type, d.UUID, d.Index = MIGName(g.Index, m.GI, m.CI), TypeMIG, m.UUID, m.Index
			d.MemoryBytes, d.Profile, d.Placement = m.MemoryBytes, m.Profile, m.Placement
			d.ParentUUID, d.ParentIndex = g.UUID, g.Index
			d.Engines = profileEngines(profiles[g.Name], m.GIProfileID)
			d.Unhealthy = unhealthy[m.UUID]
			if d.Unhealthy == "" {
				d.Unhealthy = unhealthy[g.UUID]
			}
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b Device) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// profileEngines finds the engines of GPU instance profile id among ps; nil
// when the model's profiles are not known.
func profileEngines(ps mig.Profiles, id int) *Engines {
	for _, p := range ps {
		if p.Index == id {
			return EnginesOf(p.Info)
		}
	}
	return nil
}
