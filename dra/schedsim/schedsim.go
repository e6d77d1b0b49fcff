// Package schedsim allocates ResourceClaims against what the DRA driver
// publishes, with the kube-scheduler's own allocator and CEL compiler
// (k8s.io/dynamic-resource-allocation/structured). Tests and benchmarks use it
// to check that claims as users write them allocate on gpu-agent's devices,
// and to see which devices the scheduler picks; `gpu-agent config validate
// --claims` to check a cluster's claims (Read) against a config.
package schedsim

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// ErrUnsatisfiable is Allocate's answer when the claims do not fit the node.
var ErrUnsatisfiable = errors.New("claims cannot be allocated on the node")

// features are those the scheduler has on in Kubernetes 1.36 (dra-facts):
// every field the driver may publish is understood.
var features = structured.Features{
	AdminAccess:            true,
	ConsumableCapacity:     true,
	DeviceBindingAndStatus: true,
	DeviceTaints:           true,
	PartitionableDevices:   true,
	PrioritizedList:        true,
}

// Node is one node's published pool and what is allocated on it.
type Node struct {
	name      string
	slices    []*resourceapi.ResourceSlice
	classes   classLister
	cache     *cel.Cache
	allocated structured.AllocatedState
}

// New makes the node nodeName, publishing res (what the driver hands the
// kubelet plugin helper) as the ResourceSlices the helper's controller would
// write, with the given DeviceClasses.
func New(nodeName, driver string, res resourceslice.DriverResources, classes []*resourceapi.DeviceClass) *Node {
	n := &Node{
		name:    nodeName,
		classes: classLister{},
		cache:   cel.NewCache(100, cel.Features{EnableConsumableCapacity: true}),
		allocated: structured.AllocatedState{
			AllocatedDevices:         sets.New[structured.DeviceID](),
			AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
			AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
		},
	}
	for _, c := range classes {
		n.classes[c.Name] = c
	}
	for _, poolName := range slices.Sorted(maps.Keys(res.Pools)) {
		pool := res.Pools[poolName]
		for i, s := range pool.Slices {
			// The controller names slices with a random suffix, and the
			// allocator visits a pool's slices by name: the order of slices
			// (unlike that of devices within one) carries no meaning.
			n.slices = append(n.slices, &resourceapi.ResourceSlice{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s-%d", nodeName, poolName, i)},
				Spec: resourceapi.ResourceSliceSpec{
					Driver:         driver,
					Pool:           resourceapi.ResourcePool{Name: poolName, Generation: pool.Generation, ResourceSliceCount: int64(len(pool.Slices))},
					NodeName:       ptr.To(nodeName),
					Devices:        s.Devices,
					SharedCounters: s.SharedCounters,
				},
			})
		}
	}
	return n
}

// Allocate allocates claims together, as the scheduler does for one pod, and
// records the result as allocated on the node. It returns ErrUnsatisfiable
// when they do not fit, and the allocator's error (a CEL runtime error such
// as a missing attribute) when it cannot evaluate them.
func (n *Node) Allocate(ctx context.Context, claims ...*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	a, err := structured.NewAllocator(ctx, features, n.allocated, n.classes, n.slices, n.cache)
	if err != nil {
		return nil, err
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name}}
	results, err := a.Allocate(ctx, node, claims)
	if err != nil {
		return nil, err
	}
	if results == nil {
		return nil, ErrUnsatisfiable
	}
	for _, r := range results {
		for _, d := range r.Devices.Results {
			id := structured.MakeDeviceID(d.Driver, d.Pool, d.Device)
			if d.ShareID != nil {
				// A share of a device that allows several allocations: what
				// it consumes of the device's capacity is counted, as the
				// scheduler counts it from the allocated claims.
				n.allocated.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, d.ShareID))
				n.allocated.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, d.ConsumedCapacity))
				continue
			}
			n.allocated.AllocatedDevices.Insert(id)
		}
	}
	return results, nil
}

// Hold marks device of pool as allocated, as if a claim held it.
func (n *Node) Hold(driver, pool, device string) {
	n.allocated.AllocatedDevices.Insert(structured.MakeDeviceID(driver, pool, device))
}

// Release frees every device.
func (n *Node) Release() {
	n.allocated.AllocatedDevices.Clear()
	n.allocated.AllocatedSharedDeviceIDs.Clear()
	n.allocated.AggregatedCapacity = structured.NewConsumedCapacityCollection()
}

type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	return slices.Collect(maps.Values(l)), nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	c, ok := l[name]
	if !ok {
		return nil, fmt.Errorf("device class %q not found", name)
	}
	return c, nil
}

// Default fills in what the API server defaults in a claim it stores (an
// exact count of 1), which the allocator expects.
func Default(c *resourceapi.ResourceClaim) {
	def := func(mode *resourceapi.DeviceAllocationMode, count *int64) {
		if *mode == "" {
			*mode = resourceapi.DeviceAllocationModeExactCount
		}
		if *mode == resourceapi.DeviceAllocationModeExactCount && *count == 0 {
			*count = 1
		}
	}
	for i := range c.Spec.Devices.Requests {
		r := &c.Spec.Devices.Requests[i]
		if r.Exactly != nil {
			def(&r.Exactly.AllocationMode, &r.Exactly.Count)
		}
		for j := range r.FirstAvailable {
			def(&r.FirstAvailable[j].AllocationMode, &r.FirstAvailable[j].Count)
		}
	}
}

// Validate refuses a claim the API server would not store in the ways the
// allocator, which trusts the API server's validation, cannot take: a
// request without exactly one of exactly and firstAvailable, a count below
// 1, a request without a name or a class. It is not the API server's whole
// validation. Call it after Default.
func Validate(c *resourceapi.ResourceClaim) error {
	reqs := c.Spec.Devices.Requests
	if len(reqs) > resourceapi.DeviceRequestsMaxSize {
		return fmt.Errorf("%d requests, more than %d", len(reqs), resourceapi.DeviceRequestsMaxSize)
	}
	names := sets.New[string]()
	for i, r := range reqs {
		if r.Name == "" {
			return fmt.Errorf("request %d: no name", i)
		}
		if names.Has(r.Name) {
			return fmt.Errorf("request %s: the name is given twice", r.Name)
		}
		names.Insert(r.Name)
		switch {
		case (r.Exactly == nil) == (len(r.FirstAvailable) == 0):
			return fmt.Errorf("request %s: want exactly one of exactly and firstAvailable", r.Name)
		case r.Exactly != nil:
			if err := validateMode(r.Exactly.DeviceClassName, r.Exactly.AllocationMode, r.Exactly.Count); err != nil {
				return fmt.Errorf("request %s: %w", r.Name, err)
			}
		case len(r.FirstAvailable) > resourceapi.FirstAvailableDeviceRequestMaxSize:
			return fmt.Errorf("request %s: %d subrequests, more than %d", r.Name, len(r.FirstAvailable), resourceapi.FirstAvailableDeviceRequestMaxSize)
		}
		subs := sets.New[string]()
		for j, s := range r.FirstAvailable {
			if s.Name == "" {
				return fmt.Errorf("request %s: subrequest %d: no name", r.Name, j)
			}
			if subs.Has(s.Name) {
				return fmt.Errorf("request %s/%s: the name is given twice", r.Name, s.Name)
			}
			subs.Insert(s.Name)
			if err := validateMode(s.DeviceClassName, s.AllocationMode, s.Count); err != nil {
				return fmt.Errorf("request %s/%s: %w", r.Name, s.Name, err)
			}
		}
	}
	return nil
}

func validateMode(class string, mode resourceapi.DeviceAllocationMode, count int64) error {
	if class == "" {
		return errors.New("no deviceClassName")
	}
	switch mode {
	case resourceapi.DeviceAllocationModeExactCount:
		// Above the claim's limit of 32 the allocator says so itself, and
		// a firstAvailable subrequest too large is passed over for the next.
		if count < 1 {
			return fmt.Errorf("count %d, want at least 1", count)
		}
	case resourceapi.DeviceAllocationModeAll:
		if count != 0 {
			return fmt.Errorf("count %d with allocationMode All", count)
		}
	default:
		return fmt.Errorf("allocationMode %q, want ExactCount or All", mode)
	}
	return nil
}
