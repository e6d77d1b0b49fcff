// Package devicemodeltest holds what the tests of the DRA device model and
// of the DRA driver both build: a pool with each kind of device an API
// server feature may be needed for, and a summary of what a publish holds.
// It is imported by tests only.
package devicemodeltest

import (
	"slices"
	"strings"
	"testing"

	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
)

// MixedPool is one node with each kind of device an API server feature may
// be needed for: gpu-0 shared (MPS, 4 shares), gpu-1 unhealthy, gpu-2
// plain, and GPU 3 with MIG devices on demand (gpu-3 whole, drawing on its
// counter set, and its partitions).
func MixedPool(t testing.TB) *devicemodel.Pool {
	t.Helper()
	n, inv := simtest.NodeInventory(t, "dgx-h100")
	pool := &devicemodel.Pool{}
	for _, d := range devicemodel.Devices(inv, nil, map[string]string{inv.GPUs[1].UUID: "XID 79"}) {
		switch d.Index {
		case 0:
			d.Shares, d.MPS = 4, true
		case 1, 2:
		default:
			continue
		}
		pool.Devices = append(pool.Devices, d)
	}
	profiles := simtest.Profiles(t, n, inv.GPUs[3])
	devs, set := devicemodel.Partitions(devicemodel.Dynamic{GPU: inv.GPUs[3], Profiles: profiles, Whole: true}, devicemodel.Device{ProductName: inv.GPUs[3].Name})
	pool.Devices = append(pool.Devices, devs...)
	pool.CounterSets = []devicemodel.CounterSet{set}
	slices.SortFunc(pool.Devices, func(a, b devicemodel.Device) int { return strings.Compare(a.Name, b.Name) })
	return pool
}

// Published sums up what a publish holds for one pool.
type Published struct {
	Devices []string // sorted
	// Partitions: devices named "gpu-3-mig-<profile>-<start>" (MixedPool's
	// GPU 3); CounterSets, Consuming, Shared, Tainted: how many.
	Partitions, CounterSets, Consuming, Shared, Tainted int
}

// Summarize sums up pool's slices in res.
func Summarize(res resourceslice.DriverResources, pool string) Published {
	var p Published
	for _, s := range res.Pools[pool].Slices {
		p.CounterSets += len(s.SharedCounters)
		for _, d := range s.Devices {
			p.Devices = append(p.Devices, d.Name)
			if strings.HasPrefix(d.Name, "gpu-3-mig-") {
				p.Partitions++
			}
			if len(d.ConsumesCounters) > 0 {
				p.Consuming++
			}
			if d.AllowMultipleAllocations != nil {
				p.Shared++
			}
			if len(d.Taints) > 0 {
				p.Tainted++
			}
		}
	}
	slices.Sort(p.Devices)
	return p
}

// Has reports whether the device name was published.
func (p Published) Has(name string) bool { _, ok := slices.BinarySearch(p.Devices, name); return ok }
