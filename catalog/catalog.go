// Package catalog is the contract between the agent, which decides what the
// node offers, and the plugin servers, which serve it to the kubelet. A Catalog
// is a complete, immutable description: resource name → devices, each with its
// health, NUMA node and what a container that gets it receives.
package catalog

import (
	"maps"
	"slices"
)

// Catalog maps resource names ("nvidia.com/gpu") to what is offered under them.
type Catalog struct {
	Resources map[string]*Resource
}

// Resource is one extended resource served by one device plugin server.
type Resource struct {
	// Name is the full resource name, e.g. "nvidia.com/gpu".
	Name string
	// Devices ordered by ID.
	Devices []Device
	// Preferred answers GetPreferredAllocation; nil means the plugin's simple
	// default (must-include first, then available IDs in order).
	Preferred Preferrer
	// Common is added to every container that gets at least one device of
	// this resource (e.g. /dev/nvidiactl).
	Common AllocateSpec
	// MaxPerContainer refuses Allocate requests for more devices than this
	// per container when they include a replica (0: no limit). Shared
	// resources set it to 1 when asked to (failRequestsGreaterThanOne): two
	// replicas give no more GPU. Requests for whole devices only are not
	// limited, as in NVIDIA's plugin.
	MaxPerContainer int
	// Delivery is how Allocate tells a container its devices.
	Delivery Delivery
}

// Delivery is how a container is told its devices: NVIDIA's device list
// strategies. The zero value is envvar alone.
type Delivery struct {
	// Strategies are "envvar", "volume-mounts", "cdi-annotations" and
	// "cdi-cri", any of them (nil: envvar).
	Strategies []string
	// CDIAnnotationPrefix is the cdi-annotations key prefix ("": cdi.k8s.io/).
	CDIAnnotationPrefix string
}

// Has reports whether strategy s is one of d's.
func (d Delivery) Has(s string) bool {
	if len(d.Strategies) == 0 {
		return s == "envvar"
	}
	return slices.Contains(d.Strategies, s)
}

// CDIOnly reports whether the container learns its devices through CDI
// alone: then it gets no NVIDIA_VISIBLE_DEVICES and no device nodes from the
// response, only from the CDI spec, as with NVIDIA's plugin.
func (d Delivery) CDIOnly() bool {
	return !d.Has("envvar") && !d.Has("volume-mounts")
}

// Preferrer chooses which devices to offer the kubelet for a request.
type Preferrer interface {
	// Preferred returns size IDs from available, containing every ID in mustInclude.
	Preferred(available, mustInclude []string, size int) ([]string, error)
}

// Device is one schedulable unit: a whole GPU, a MIG device or a replica.
type Device struct {
	ID      string
	Healthy bool
	// NUMANode is -1 when unknown.
	NUMANode int
	// GPU is the index of the physical GPU this device lives on.
	GPU int
	// Reason says why the device is unhealthy ("" when healthy).
	Reason string
	// Replica marks a shared replica of a device (time-slicing): the
	// resource's MaxPerContainer applies to requests that hold one.
	Replica bool
	// Spec is what a container that gets this device receives.
	Spec AllocateSpec
}

// AllocateSpec is what a container receives for a device.
type AllocateSpec struct {
	// VisibleID goes into NVIDIA_VISIBLE_DEVICES: a GPU or MIG UUID. Replicas
	// of one GPU share it; Allocate lists each distinct VisibleID once.
	VisibleID string
	// RuntimeID, when set, is how the device is named to the container
	// runtime instead of VisibleID (NVIDIA's deviceIDStrategy index: the GPU
	// index "0" or the MIG device "<gpu>:<mig>"). VisibleID stays the UUID,
	// which is what identifies the device everywhere else (health, metrics).
	RuntimeID string
	// Env is extra environment (e.g. MPS limits). Later devices do not
	// override earlier ones with different values: that is an allocation error.
	Env map[string]string
	// DeviceNodes are host device paths mounted at the same path, read-write.
	DeviceNodes []string
	// Mounts are host paths bound into the container.
	Mounts []Mount
}

// RuntimeName is what NVIDIA_VISIBLE_DEVICES lists for the device:
// RuntimeID when set, else VisibleID.
func (s AllocateSpec) RuntimeName() string {
	if s.RuntimeID != "" {
		return s.RuntimeID
	}
	return s.VisibleID
}

// Mount is a bind mount for a container.
type Mount struct {
	HostPath      string
	ContainerPath string
	ReadOnly      bool
}

// Device returns the device with the given ID.
func (r *Resource) Device(id string) (Device, bool) {
	i, ok := slices.BinarySearchFunc(r.Devices, id, func(d Device, id string) int {
		switch {
		case d.ID < id:
			return -1
		case d.ID > id:
			return 1
		}
		return 0
	})
	if !ok {
		return Device{}, false
	}
	return r.Devices[i], true
}

// SameDevices reports whether a and b list the same devices with the same
// health, NUMA node and allocation spec: when it is false the kubelet must be
// told (ListAndWatch update).
func SameDevices(a, b *Resource) bool {
	if len(a.Devices) != len(b.Devices) {
		return false
	}
	for i := range a.Devices {
		if !sameDevice(a.Devices[i], b.Devices[i]) {
			return false
		}
	}
	return sameSpec(a.Common, b.Common) && a.MaxPerContainer == b.MaxPerContainer &&
		slices.Equal(a.Delivery.Strategies, b.Delivery.Strategies) && a.Delivery.CDIAnnotationPrefix == b.Delivery.CDIAnnotationPrefix
}

func sameDevice(a, b Device) bool {
	return a.ID == b.ID && a.Healthy == b.Healthy && a.NUMANode == b.NUMANode &&
		a.GPU == b.GPU && a.Reason == b.Reason && a.Replica == b.Replica && sameSpec(a.Spec, b.Spec)
}

func sameSpec(a, b AllocateSpec) bool {
	return a.VisibleID == b.VisibleID && a.RuntimeID == b.RuntimeID && maps.Equal(a.Env, b.Env) &&
		slices.Equal(a.DeviceNodes, b.DeviceNodes) && slices.Equal(a.Mounts, b.Mounts)
}

// Names returns the resource names in order.
func (c *Catalog) Names() []string {
	if c == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(c.Resources))
}
