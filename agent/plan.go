package agent

import (
	"fmt"
	"maps"
	"slices"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// ResourceGPU is the whole-GPU resource name pods written for NVIDIA's stack request.
const ResourceGPU = "nvidia.com/gpu"

// Control device nodes every CUDA container needs besides its /dev/nvidiaN.
var controlDeviceNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// PlanInput is everything the catalog is derived from. It is a pure value: the
// same input always plans the same catalog.
type PlanInput struct {
	Inventory *gpu.Inventory
	// PassDeviceSpecs adds /dev/nvidia* device nodes to Allocate responses
	// (needed where the container runtime does not inject them itself).
	PassDeviceSpecs bool
	// Unhealthy maps a GPU UUID to the reason it is unhealthy.
	Unhealthy map[string]string
	// Failed are GPUs of an earlier inventory that the latest one could not
	// read (lost, NVML errors), keyed by UUID with the reason. They stay
	// offered, unhealthy: a device that vanishes from ListAndWatch looks to
	// the kubelet like a removal, not a failure, and nobody is told why.
	Failed map[string]FailedGPU
	// Preferred answers GetPreferredAllocation for whole GPUs (nil: plugin default).
	Preferred catalog.Preferrer
}

// FailedGPU is a GPU last seen in an earlier inventory.
type FailedGPU struct {
	GPU    gpu.GPU
	Reason string
}

// PlanCatalog decides what the node offers. MIG-enabled GPUs are not offered
// as whole GPUs: their memory and SMs belong to their instances, and handing
// the parent to a pod would give it a GPU it cannot use.
func PlanCatalog(in PlanInput) *catalog.Catalog {
	c := &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	if in.Inventory == nil {
		return c
	}
	whole := &catalog.Resource{Name: ResourceGPU, Preferred: in.Preferred}
	if in.PassDeviceSpecs {
		whole.Common.DeviceNodes = slices.Clone(controlDeviceNodes)
	}
	gpus := slices.Clone(in.Inventory.GPUs)
	unhealthy := in.Unhealthy
	if len(in.Failed) > 0 {
		unhealthy = maps.Clone(in.Unhealthy)
		if unhealthy == nil {
			unhealthy = map[string]string{}
		}
		for uuid, f := range in.Failed {
			gpus = append(gpus, f.GPU)
			unhealthy[uuid] = f.Reason
		}
	}
	for _, g := range gpus {
		if g.MIG.Current {
			continue
		}
		d := catalog.Device{
			ID:       g.UUID,
			Healthy:  true,
			NUMANode: g.NUMANode,
			GPU:      g.Index,
			Spec:     catalog.AllocateSpec{VisibleID: g.UUID},
		}
		if reason, bad := unhealthy[g.UUID]; bad {
			d.Healthy, d.Reason = false, reason
		}
		if in.PassDeviceSpecs {
			d.Spec.DeviceNodes = []string{fmt.Sprintf("/dev/nvidia%d", g.Minor)}
		}
		whole.Devices = append(whole.Devices, d)
	}
	if len(whole.Devices) > 0 {
		slices.SortFunc(whole.Devices, func(a, b catalog.Device) int {
			switch {
			case a.ID < b.ID:
				return -1
			case a.ID > b.ID:
				return 1
			}
			return 0
		})
		c.Resources[whole.Name] = whole
	}
	return c
}
