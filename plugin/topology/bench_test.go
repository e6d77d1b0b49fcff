package topology

import (
	"fmt"
	"testing"

	"github.com/gpu-agent/gpu-agent/plugin/topology/topotest"
)

// BenchmarkBest times one search per profile and size on a free node; the
// comparison with go-gpuallocator lives in test/bench.
func BenchmarkBest(b *testing.B) {
	for _, p := range topotest.Profiles() {
		s := FromInventory(p.Inventory(), PolicyTopology)
		n := p.Topology.Len()
		for size := 1; size <= n; size++ {
			b.Run(fmt.Sprintf("%s/size=%d", p.Name, size), func(b *testing.B) {
				for b.Loop() {
					if _, err := s.Best(1<<n-1, 0, size); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
