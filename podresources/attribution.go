package podresources

import (
	"cmp"
	"maps"
	"slices"
	"strings"

	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Holder is a container that holds a device (or a replica of it).
type Holder struct {
	Namespace string
	Pod       string
	Container string
}

// Compare orders holders by namespace, pod, then container.
func (h Holder) Compare(o Holder) int {
	return cmp.Or(cmp.Compare(h.Namespace, o.Namespace), cmp.Compare(h.Pod, o.Pod), cmp.Compare(h.Container, o.Container))
}

// Attribution says which containers hold which devices; immutable. Device
// IDs are what the kubelet allocated: GPU or MIG UUIDs and replica IDs
// ("<uuid>::<n>"), which count for their device.
type Attribution struct {
	holders map[string][]Holder // by device UUID, sorted, distinct
	held    map[string]int      // by device UUID: distinct IDs (replicas) held
	byRes   map[string]map[Holder]int
	ids     map[string]map[string]Holder // resource → device ID as allocated → first holder
	// dra are the devices containers hold through DRA claims. They are
	// for metrics only: the ledger learns of claims from Prepare, so Same,
	// Holders and Held leave them out.
	dra []DRAHold
}

// DRAHold is one device a container holds through a DRA claim, as the
// kubelet lists it: the claim, and the driver, pool and device of one of
// its allocation results.
type DRAHold struct {
	Holder
	ClaimNamespace, ClaimName string
	Driver, Pool, Device      string
}

// Compare orders holds by holder, claim, then driver, pool and device.
func (d DRAHold) Compare(o DRAHold) int {
	return cmp.Or(d.Holder.Compare(o.Holder), cmp.Compare(d.ClaimNamespace, o.ClaimNamespace), cmp.Compare(d.ClaimName, o.ClaimName),
		cmp.Compare(d.Driver, o.Driver), cmp.Compare(d.Pool, o.Pool), cmp.Compare(d.Device, o.Device))
}

// NewAttribution indexes a pod-resources List answer. Resources other than
// those accepted by keep (nil: all) are left out.
func NewAttribution(pods []*podresourcesv1.PodResources, keep func(resource string) bool) *Attribution {
	a := &Attribution{holders: map[string][]Holder{}, held: map[string]int{}, byRes: map[string]map[Holder]int{},
		ids: map[string]map[string]Holder{}}
	seen := map[string]bool{}
	for _, p := range pods {
		for _, c := range p.GetContainers() {
			h := Holder{Namespace: p.GetNamespace(), Pod: p.GetName(), Container: c.GetName()}
			for _, dr := range c.GetDynamicResources() {
				for _, r := range dr.GetClaimResources() {
					a.dra = append(a.dra, DRAHold{Holder: h, ClaimNamespace: dr.GetClaimNamespace(), ClaimName: dr.GetClaimName(),
						Driver: r.GetDriverName(), Pool: r.GetPoolName(), Device: r.GetDeviceName()})
				}
			}
			for _, d := range c.GetDevices() {
				res := d.GetResourceName()
				if keep != nil && !keep(res) {
					continue
				}
				for _, id := range d.GetDeviceIds() {
					if a.ids[res] == nil {
						a.ids[res] = map[string]Holder{}
					}
					if _, ok := a.ids[res][id]; !ok {
						a.ids[res][id] = h
					}
					uuid, _, _ := strings.Cut(id, "::")
					if !slices.Contains(a.holders[uuid], h) {
						a.holders[uuid] = append(a.holders[uuid], h)
					}
					if !seen[id] {
						seen[id] = true
						a.held[uuid]++
					}
					if a.byRes[res] == nil {
						a.byRes[res] = map[Holder]int{}
					}
					a.byRes[res][h]++
				}
			}
		}
	}
	for _, hs := range a.holders {
		slices.SortFunc(hs, Holder.Compare)
	}
	// A device two requests of one claim share is listed twice.
	slices.SortFunc(a.dra, DRAHold.Compare)
	a.dra = slices.Compact(a.dra)
	return a
}

// DRAHolds lists the devices containers hold through DRA claims, of every
// driver, sorted; the caller picks its own driver and pool.
func (a *Attribution) DRAHolds() []DRAHold {
	if a == nil {
		return nil
	}
	return a.dra
}

// Same reports whether a and b attribute the same device IDs to the same
// containers.
func (a *Attribution) Same(b *Attribution) bool {
	if a == nil || b == nil {
		return a == b
	}
	return maps.EqualFunc(a.ids, b.ids, func(x, y map[string]Holder) bool { return maps.Equal(x, y) })
}

// HeldIDs returns the device IDs of resource that containers hold, exactly
// as the kubelet allocated them (replica IDs included), each with a holder.
func (a *Attribution) HeldIDs(resource string) map[string]Holder {
	if a == nil {
		return nil
	}
	return a.ids[resource]
}

// Resources lists the resources a container holds devices of, in order.
func (a *Attribution) Resources() []string {
	if a == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(a.ids))
}

// String names the holder as "namespace/pod (container)".
func (h Holder) String() string { return h.Namespace + "/" + h.Pod + " (" + h.Container + ")" }

// Holders returns the containers holding the device or any of its replicas,
// sorted; nil when none (or a is nil).
func (a *Attribution) Holders(uuid string) []Holder {
	if a == nil {
		return nil
	}
	return a.holders[uuid]
}

// Held returns how many distinct IDs of the device (replicas, or 1 for the
// device itself) are allocated.
func (a *Attribution) Held(uuid string) int {
	if a == nil {
		return 0
	}
	return a.held[uuid]
}

// Allocation is how many device IDs of one resource a container holds.
type Allocation struct {
	Resource string
	Holder   Holder
	Devices  int
}

// Allocations lists every container's holdings, by resource then holder.
func (a *Attribution) Allocations() []Allocation {
	if a == nil {
		return nil
	}
	var out []Allocation
	for res, hs := range a.byRes {
		for h, n := range hs {
			out = append(out, Allocation{Resource: res, Holder: h, Devices: n})
		}
	}
	slices.SortFunc(out, func(x, y Allocation) int {
		return cmp.Or(cmp.Compare(x.Resource, y.Resource), x.Holder.Compare(y.Holder))
	})
	return out
}

// IsGPUResource accepts NVIDIA's resource names and renamed shared ones
// ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared").
func IsGPUResource(name string) bool { return strings.HasPrefix(name, "nvidia.com/") }
