package dra

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// TaintUnhealthy is the device taint an unhealthy device carries: the
// scheduler gives it to no new claim that does not tolerate it.
const TaintUnhealthy = DriverName + "/unhealthy"

// busIDAttr is the GPU's PCI bus ID, under the name NVIDIA's driver uses.
const busIDAttr = "pcieBusID"

// Resources is what the kubelet plugin helper publishes for pool on
// nodeName: one pool named for the node, one slice with every device.
// Unhealthy devices carry the NoSchedule taint TaintUnhealthy, or, when
// taints is false (the API server drops them: the DRADeviceTaints feature
// is off), are left out.
func Resources(nodeName string, pool *Pool, generation int64, taints bool) resourceslice.DriverResources {
	devs := make([]resourceapi.Device, 0, len(pool.Devices))
	for _, d := range pool.Devices {
		if d.Unhealthy != "" && !taints {
			continue
		}
		devs = append(devs, apiDevice(d))
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Generation: generation, Slices: []resourceslice.Slice{{Devices: devs}}},
	}}
}

func apiDevice(d Device) resourceapi.Device {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: ptr.To(s)} }
	num := func(n int) resourceapi.DeviceAttribute {
		return resourceapi.DeviceAttribute{IntValue: ptr.To(int64(n))}
	}
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"type":                  str(d.Type),
		"uuid":                  str(d.UUID),
		"index":                 num(d.Index),
		"minor":                 num(d.Minor),
		"productName":           str(d.ProductName),
		"cudaComputeCapability": {VersionValue: ptr.To(fmt.Sprintf("%d.%d.0", d.CC.Major, d.CC.Minor))},
	}
	if d.Architecture != "" {
		attrs["architecture"] = str(d.Architecture)
	}
	if v, ok := semver(d.DriverVersion); ok {
		attrs["driverVersion"] = resourceapi.DeviceAttribute{VersionValue: ptr.To(v)}
	}
	if d.PCIBusID != "" {
		attrs[busIDAttr] = str(d.PCIBusID)
	}
	if d.Type == TypeMIG {
		attrs["profile"] = str(d.Profile)
		attrs["parentUUID"] = str(d.ParentUUID)
		attrs["parentIndex"] = num(d.ParentIndex)
		attrs["placementStart"] = num(d.Placement.Start)
		attrs["placementSize"] = num(d.Placement.Size)
	}
	out := resourceapi.Device{
		Name:       d.Name,
		Attributes: attrs,
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			"memory": {Value: *resource.NewQuantity(int64(d.MemoryBytes), resource.BinarySI)},
		},
	}
	if d.Unhealthy != "" {
		out.Taints = []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	return out
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
