// Package gpu turns an nvml.Interface (real NVML or a simulated node) into one
// immutable Inventory snapshot: GPUs, MIG instances and their topology. Every
// other part of gpu-agent reads the node through this snapshot, never through
// NVML directly, so one enumeration serves planning, serving and status.
package gpu

import "fmt"

// Inventory is an immutable snapshot of a node's GPUs. Callers must not modify it.
type Inventory struct {
	// DriverVersion as reported by NVML ("" when unknown).
	DriverVersion string `json:"driverVersion,omitempty"`
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
	// PCIDeviceID is NVML's PCI device id (device << 16 | vendor, 0x233010DE
	// for H100 SXM); 0 when unknown. MIG layouts filter GPU models by it.
	PCIDeviceID uint32 `json:"pciDeviceID,omitempty"`
	// Minor is N in /dev/nvidiaN.
	Minor int `json:"minor"`
	// NUMANode is -1 when unknown (single-socket machines report -1 in sysfs).
	NUMANode          int               `json:"numaNode"`
	ComputeCapability ComputeCapability `json:"computeCapability"`
	MIGCapable        bool              `json:"migCapable"`
	MIG               MIGMode           `json:"migMode"`
	// Instances are the MIG devices (GI + CI) on this GPU, ordered by GI then CI.
	Instances []MIGInstance `json:"instances,omitempty"`
}

// ComputeCapability is the CUDA compute capability, e.g. 8.0 for A100.
type ComputeCapability struct {
	Major int `json:"major"`
	Minor int `json:"minor"`
}

func (c ComputeCapability) String() string { return fmt.Sprintf("%d.%d", c.Major, c.Minor) }

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

// GPUByUUID returns the GPU with the given UUID.
func (inv *Inventory) GPUByUUID(uuid string) (GPU, bool) {
	for _, g := range inv.GPUs {
		if g.UUID == uuid {
			return g, true
		}
	}
	return GPU{}, false
}
