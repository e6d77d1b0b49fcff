package devicemodel

import (
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/gpu-agent/gpu-agent/mig"
)

// mixedPool is one node with each kind of device an API server feature may
// be needed for: gpu-0 shared (MPS, 4 shares), gpu-1 unhealthy, gpu-2
// plain, and GPU 3 with MIG devices on demand (gpu-3 whole, drawing on its
// counter set, and its partitions).
func mixedPool(t *testing.T) *Pool {
	t.Helper()
	n, inv := simInventory(t, "dgx-h100")
	pool := &Pool{}
	for _, d := range Devices(inv, nil, map[string]string{inv.GPUs[1].UUID: "XID 79"}) {
		switch d.Index {
		case 0:
			d.Shares, d.MPS = 4, true
		case 1, 2:
		default:
			continue
		}
		pool.Devices = append(pool.Devices, d)
	}
	dev, ret := n.DeviceGetHandleByIndex(3)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	profiles, err := mig.QueryProfiles(dev, inv.GPUs[3].MemoryBytes)
	if err != nil {
		t.Fatal(err)
	}
	devs, set := Partitions(Dynamic{GPU: inv.GPUs[3], Profiles: profiles, Whole: true}, Device{ProductName: inv.GPUs[3].Name})
	pool.Devices = append(pool.Devices, devs...)
	pool.CounterSets = []CounterSet{set}
	slices.SortFunc(pool.Devices, func(a, b Device) int { return strings.Compare(a.Name, b.Name) })
	return pool
}

// published sums up what a publish holds.
type published struct {
	devices []string // sorted
	// partitions: devices named "gpu-N-mig-<profile>-<start>"; counterSets,
	// consuming, shared, tainted: how many.
	partitions, counterSets, consuming, shared, tainted int
}

func summarize(res resourceslice.DriverResources) published {
	var p published
	for _, s := range res.Pools["node-a"].Slices {
		p.counterSets += len(s.SharedCounters)
		for _, d := range s.Devices {
			p.devices = append(p.devices, d.Name)
			if strings.HasPrefix(d.Name, "gpu-3-mig-") {
				p.partitions++
			}
			if len(d.ConsumesCounters) > 0 {
				p.consuming++
			}
			if d.AllowMultipleAllocations != nil {
				p.shared++
			}
			if len(d.Taints) > 0 {
				p.tainted++
			}
		}
	}
	slices.Sort(p.devices)
	return p
}

func (p published) has(name string) bool { _, ok := slices.BinarySearch(p.devices, name); return ok }

// Each feature the API server lacks leaves out what needs it, and only that.
func TestResourcesDropped(t *testing.T) {
	pool := mixedPool(t)
	partitions := len(pool.Devices) - 4
	if partitions < 20 {
		t.Fatalf("GPU 3 has %d partitions", partitions)
	}
	tests := []struct {
		name    string
		dropped Dropped
		// absent: devices left out; the rest of the pool is published.
		absent                                              []string
		partitions, counterSets, consuming, shared, tainted int
	}{
		{name: "nothing", partitions: partitions, counterSets: 1, consuming: partitions + 1, shared: 1, tainted: 1},
		{name: "taints", dropped: Dropped{Taints: true}, absent: []string{"gpu-1"},
			partitions: partitions, counterSets: 1, consuming: partitions + 1, shared: 1},
		{name: "partitions", dropped: Dropped{Partitions: true}, shared: 1, tainted: 1},
		{name: "sharing", dropped: Dropped{Sharing: true}, absent: []string{"gpu-0"},
			partitions: partitions, counterSets: 1, consuming: partitions + 1, tainted: 1},
		{name: "all three", dropped: Dropped{Taints: true, Partitions: true, Sharing: true}, absent: []string{"gpu-0", "gpu-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := summarize(Resources("node-a", pool, 1, tt.dropped))
			for _, d := range pool.Devices {
				want := !slices.Contains(tt.absent, d.Name) && !(d.Partition && tt.dropped.Partitions)
				if got.has(d.Name) != want {
					t.Errorf("%s published: %v, want %v", d.Name, got.has(d.Name), want)
				}
			}
			if got.partitions != tt.partitions || got.counterSets != tt.counterSets || got.consuming != tt.consuming ||
				got.shared != tt.shared || got.tainted != tt.tainted {
				t.Errorf("%d partitions, %d counter sets, %d consuming, %d shared, %d tainted; want %d, %d, %d, %d, %d",
					got.partitions, got.counterSets, got.consuming, got.shared, got.tainted,
					tt.partitions, tt.counterSets, tt.consuming, tt.shared, tt.tainted)
			}
		})
	}
}
