package devicemodel_test

import (
	"slices"
	"testing"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel/devicemodeltest"
)

// Each feature the API server lacks leaves out what needs it, and only that.
func TestResourcesDropped(t *testing.T) {
	pool := devicemodeltest.MixedPool(t)
	partitions := len(pool.Devices) - 4
	if partitions != 19 {
		t.Fatalf("GPU 3 has %d partitions, want an H100's 19", partitions)
	}
	tests := []struct {
		name    string
		dropped devicemodel.Dropped
		// absent: devices left out; the rest of the pool is published.
		absent                                              []string
		partitions, counterSets, consuming, shared, tainted int
	}{
		{name: "nothing", partitions: partitions, counterSets: 1, consuming: partitions + 1, shared: 1, tainted: 1},
		{name: "taints", dropped: devicemodel.Dropped{Taints: true}, absent: []string{"gpu-1"},
			partitions: partitions, counterSets: 1, consuming: partitions + 1, shared: 1},
		{name: "partitions", dropped: devicemodel.Dropped{Partitions: true}, shared: 1, tainted: 1},
		{name: "sharing", dropped: devicemodel.Dropped{Sharing: true}, absent: []string{"gpu-0"},
			partitions: partitions, counterSets: 1, consuming: partitions + 1, tainted: 1},
		{name: "all three", dropped: devicemodel.Dropped{Taints: true, Partitions: true, Sharing: true}, absent: []string{"gpu-0", "gpu-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := devicemodeltest.Summarize(devicemodel.Resources("node-a", pool, 1, tt.dropped), "node-a")
			for _, d := range pool.Devices {
				want := !slices.Contains(tt.absent, d.Name) && !(d.Partition && tt.dropped.Partitions)
				if got.Has(d.Name) != want {
					t.Errorf("%s published: %v, want %v", d.Name, got.Has(d.Name), want)
				}
			}
			if got.Partitions != tt.partitions || got.CounterSets != tt.counterSets || got.Consuming != tt.consuming ||
				got.Shared != tt.shared || got.Tainted != tt.tainted {
				t.Errorf("%d partitions, %d counter sets, %d consuming, %d shared, %d tainted; want %d, %d, %d, %d, %d",
					got.Partitions, got.CounterSets, got.Consuming, got.Shared, got.Tainted,
					tt.partitions, tt.counterSets, tt.consuming, tt.shared, tt.tainted)
			}
		})
	}
}
