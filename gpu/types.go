// Package gpu turns an nvml.Interface (real NVML or a simulated node) into one
// immutable Inventory snapshot: GPUs, MIG instances and their topology. Every
// other part of gpu-agent reads the node through this snapshot, never through
// NVML directly, so one enumeration serves planning, serving and status.
package gpu

import (
	"fmt"
	"slices"
	"strings"
)

// Inventory is an immutable snapshot of a node's GPUs. Callers must not modify it.
type Inventory struct {
	// DriverVersion as reported by NVML ("" when unknown).
	DriverVersion string `json:"driverVersion,omitempty"`
	// CUDADriverVersion is the newest CUDA version the driver supports,
	// "<major>.<minor>" ("12.4"); "" when unknown.
	CUDADriverVersion string `json:"cudaDriverVersion,omitempty"`
	// GPUs ordered by NVML index. A GPU that failed mid-enumeration is absent
	// here and listed in Errors.
	GPUs []GPU `json:"gpus"`
	// Topology between the GPUs in GPUs, indexed by position in GPUs (which
	// equals the NVML index unless a GPU failed to enumerate).
	Topology *Topology `json:"topology,omitempty"`
	// Errors names every GPU (or call) that could not be read completely.
	Errors []DeviceError `json:"errors,omitempty"`
}

// DeviceError is an NVML failure for one GPU; it names the GPU and the call.
type DeviceError struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid,omitempty"`
	Call  string `json:"call"`
	Err   string `json:"error"`
	// Lost: NVML answered ERROR_GPU_IS_LOST for this GPU, which is final
	// until a reset (unlike other failures, which may pass).
	Lost bool `json:"lost,omitempty"`
}

func (e DeviceError) Error() string {
	if e.UUID != "" {
		return fmt.Sprintf("gpu %d (%s): %s: %s", e.Index, e.UUID, e.Call, e.Err)
	}
	return fmt.Sprintf("gpu %d: %s: %s", e.Index, e.Call, e.Err)
}

// GPU is one physical GPU.
type GPU struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid"`
	Name        string `json:"name"`
	MemoryBytes uint64 `json:"memoryBytes"`
	// PCIBusID in the canonical sysfs form, lower case: "0000:07:00.0".
	PCIBusID string `json:"pciBusID"`
	// PCIeRoot is the PCIe root complex the GPU hangs off, as the kernel
	// names it ("pci0000:00"): GPUs and NICs under one root share it, which
	// is what DRA's resource.kubernetes.io/pcieRoot aligns on. "" when
	// unknown. Without Options.PCIeRoot (a simulated node) it is derived
	// from the topology: GPUs on one host bridge or closer share a root.
	PCIeRoot string `json:"pcieRoot,omitempty"`
	// Brand is NVML's brand as NVIDIA's tools spell it ("Nvidia", "Tesla",
	// "GeForce"); "" when unknown.
	Brand string `json:"brand,omitempty"`
	// PCIDeviceID is NVML's PCI device id (device << 16 | vendor, 0x233010DE
	// for H100 SXM); 0 when unknown. MIG layouts filter GPU models by it.
	PCIDeviceID uint32 `json:"pciDeviceID,omitempty"`
	// Minor is N in /dev/nvidiaN.
	Minor int `json:"minor"`
	// NUMANode is -1 when unknown (single-socket machines report -1 in sysfs).
	NUMANode          int               `json:"numaNode"`
	ComputeCapability ComputeCapability `json:"computeCapability"`
	// MIGCapable and MIG are NVML's answer to GetMigMode; both are false
	// when NVML says the GPU has no MIG (NOT_SUPPORTED), and also, meaning
	// unknown, when Unread holds FactMIGMode.
	MIGCapable bool    `json:"migCapable"`
	MIG        MIGMode `json:"migMode"`
	// Instances are the MIG devices (GI + CI) on this GPU, ordered by GI then CI.
	Instances []MIGInstance `json:"instances,omitempty"`
	// GIsWithoutCI are the GPU instances that have no compute instance, by GI
	// id. No MIG device stands for one, so nothing can use or hold it, yet it
	// keeps its memory slices from every other instance. Only an interrupted
	// change (or a person halfway through nvidia-smi mig) leaves one.
	GIsWithoutCI []GPUInstance `json:"gisWithoutCI,omitempty"`
	// Fabric is the GPU's multi-node NVLink fabric attachment; nil when
	// it has none (NVML answers NOT_SUPPORTED) or, with FactFabric in
	// Unread, when NVML failed to say.
	Fabric *Fabric `json:"fabric,omitempty"`
	// Unread lists the facts that could not be read for this GPU in this
	// snapshot because an NVML call (or the Options.NUMANode lookup) failed,
	// in the order of the Fact constants; nil when the GPU was read
	// completely. NOT_SUPPORTED is an answer, not a failure (no MIG, no NUMA
	// node), and ERROR_GPU_IS_LOST leaves the GPU out of the snapshot
	// instead. The fields of an unread fact hold what could be read
	// (possibly nothing); each failure is in Inventory.Errors with the call
	// and NVML's error.
	//
	// A consumer must not take an unread fact's fields as the GPU's state.
	// Where it has an earlier record of the same UUID, it keeps that
	// record's fields for the fact (simplest: the whole earlier GPU record)
	// until a snapshot reads the fact again. Either way it never acts on
	// what the unread fields lack or say false: a MIG device missing from
	// Instances is not withdrawn, a GPU with FactMIGMode unread is not
	// offered as a whole GPU, and no MIG change is planned (mig.MakePlan
	// refuses a GPU whose MIGUnknown is true). Without an earlier record, a
	// GPU with FactMIGMode unread is withheld, or offered unhealthy, until a
	// snapshot reads it.
	Unread []Fact `json:"unread,omitempty"`
}

// Fact names a part of GPU that one snapshot may fail to read (GPU.Unread).
// A failure lists every fact it leaves unknown, so a consumer checks the one
// it needs without knowing which reads depend on which.
type Fact string

// The facts of GPU.Unread, in the order they are read and listed.
const (
	// FactComputeCapability: ComputeCapability is unknown (0.0).
	FactComputeCapability Fact = "computeCapability"
	// FactNUMANode: NUMANode is unknown (-1).
	FactNUMANode Fact = "numaNode"
	// FactBrand: Brand is unknown ("").
	FactBrand Fact = "brand"
	// FactMIGMode: MIGCapable and MIG are unknown (false). Instances and
	// GIsWithoutCI were not read at all, so their facts are listed too.
	FactMIGMode Fact = "migMode"
	// FactInstances: Instances lacks the MIG devices that could not be read
	// or describes one only in part; the ones it has are right as far as
	// they go, but a missing one may exist and may be held by a pod.
	FactInstances Fact = "instances"
	// FactGIsWithoutCI: GIsWithoutCI may lack GPU instances that exist.
	FactGIsWithoutCI Fact = "gisWithoutCI"
	// FactFabric: Fabric is unknown (nil); the GPU may be in a clique.
	FactFabric Fact = "fabric"
)

var factOrder = []Fact{FactComputeCapability, FactNUMANode, FactBrand, FactMIGMode, FactInstances, FactGIsWithoutCI, FactFabric}

// Unknown reports whether any of facts is in g.Unread.
func (g GPU) Unknown(facts ...Fact) bool {
	for _, f := range facts {
		if slices.Contains(g.Unread, f) {
			return true
		}
	}
	return false
}

// MIGUnknown reports whether g's MIG state (mode, MIG devices, GPU
// instances) was not read completely: what a MIG planner must not act on.
func (g GPU) MIGUnknown() bool {
	return g.Unknown(FactMIGMode, FactInstances, FactGIsWithoutCI)
}

// GPUInstance is a GPU instance seen without its MIG devices
// (GPU.GIsWithoutCI).
type GPUInstance struct {
	GI int `json:"gi"`
	// Profile is the GPU instance profile name, as in MIGInstance.
	Profile string `json:"profile"`
	// GIProfileID is the GPU_INSTANCE_PROFILE_* index, as in MIGInstance.
	GIProfileID int       `json:"giProfileID"`
	Placement   Placement `json:"placement"`
}

// ComputeCapability is the CUDA compute capability, e.g. 8.0 for A100.
type ComputeCapability struct {
	Major int `json:"major"`
	Minor int `json:"minor"`
}

func (c ComputeCapability) String() string { return fmt.Sprintf("%d.%d", c.Major, c.Minor) }

// Family names the GPU architecture of c in lower case, as GPU feature
// discovery's nvidia.com/gpu.family label does ("ampere", "hopper"); "" when
// unknown.
func (c ComputeCapability) Family() string {
	switch {
	case c.Major == 3:
		return "kepler"
	case c.Major == 5:
		return "maxwell"
	case c.Major == 6:
		return "pascal"
	case c.Major == 7 && c.Minor < 5:
		return "volta"
	case c.Major == 7:
		return "turing"
	case c.Major == 8 && c.Minor < 9:
		return "ampere"
	case c.Major == 8:
		return "ada-lovelace"
	case c.Major == 9:
		return "hopper"
	case c.Major == 10 || c.Major == 12:
		return "blackwell"
	}
	return ""
}

// Architecture names the GPU architecture of c as NVML and NVIDIA's DRA
// driver write it ("Ampere", "Ada Lovelace", "Hopper", "Blackwell"), so that
// claims written for that driver select the same GPUs; "" when unknown.
func (c ComputeCapability) Architecture() string {
	switch f := c.Family(); f {
	case "":
		return ""
	case "ada-lovelace":
		return "Ada Lovelace"
	default:
		return strings.ToUpper(f[:1]) + f[1:]
	}
}

// AtLeast reports whether c >= major.minor.
func (c ComputeCapability) AtLeast(major, minor int) bool {
	return c.Major > major || (c.Major == major && c.Minor >= minor)
}

// MIGMode is the current and pending MIG mode. Pending differs from Current
// after a mode change that still needs a GPU reset.
type MIGMode struct {
	Current bool `json:"current"`
	Pending bool `json:"pending"`
}

// MIGInstance is one MIG device: a GPU instance with one compute instance.
type MIGInstance struct {
	// UUID is the MIG device UUID ("MIG-...").
	UUID string `json:"uuid"`
	// Profile is the GPU instance profile name as users write it: "1g.10gb",
	// "1g.10gb+me". A compute instance smaller than its GPU instance is
	// written "1c.3g.40gb".
	Profile string `json:"profile"`
	// GIProfileID is the GPU_INSTANCE_PROFILE_* index of the profile (the value
	// GetGpuInstanceProfileInfo takes), not the id drivers report in GpuInstanceInfo.
	GIProfileID int       `json:"giProfileID"`
	GI          int       `json:"gi"`
	CI          int       `json:"ci"`
	Placement   Placement `json:"placement"`
	MemoryBytes uint64    `json:"memoryBytes"`
	// Index is the MIG device index under its parent GPU (GetMigDeviceHandleByIndex).
	Index int `json:"index"`
}

// Placement is where a GPU instance sits in the GPU's memory slices.
type Placement struct {
	Start int `json:"start"`
	Size  int `json:"size"`
}

// Overlaps reports whether p and q share a memory slice.
func (p Placement) Overlaps(q Placement) bool {
	return p.Start < q.Start+q.Size && q.Start < p.Start+p.Size
}

// GPUByUUID returns the GPU with the given UUID.
func (inv *Inventory) GPUByUUID(uuid string) (GPU, bool) {
	for _, g := range inv.GPUs {
		if g.UUID == uuid {
			return g, true
		}
	}
	return GPU{}, false
}

// ParentOf is the UUID of the GPU MIG device uuid is on ("" for anything
// else, a GPU included).
func (inv *Inventory) ParentOf(uuid string) string {
	if inv == nil {
		return ""
	}
	for _, g := range inv.GPUs {
		if slices.ContainsFunc(g.Instances, func(m MIGInstance) bool { return m.UUID == uuid }) {
			return g.UUID
		}
	}
	return ""
}

// HasDevice reports whether uuid is a GPU of the inventory or one of their
// MIG devices.
func (inv *Inventory) HasDevice(uuid string) bool {
	return slices.ContainsFunc(inv.GPUs, func(g GPU) bool { return g.HasDevice(uuid) })
}

// HasDevice reports whether uuid is g or one of its MIG devices.
func (g GPU) HasDevice(uuid string) bool {
	return g.UUID == uuid || slices.ContainsFunc(g.Instances, func(m MIGInstance) bool { return m.UUID == uuid })
}
