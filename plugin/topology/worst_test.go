package topology

import (
	"math/bits"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/plugin/topology/topotest"
)

func TestWorstTmp(t *testing.T) {
	for _, p := range topotest.Profiles() {
		s := FromInventory(p.Inventory(), PolicyTopology)
		n := p.Topology.Len()
		var worst time.Duration
		var wa uint64
		var wk int
		step := uint64(1)
		if n == 16 {
			step = 7
		}
		for avail := uint64(1); avail < 1<<n; avail += step {
			for k := 1; k <= bits.OnesCount64(avail); k++ {
				d := time.Hour
				for range 5 {
					st := time.Now()
					s.Best(avail, 0, k)
					d = min(d, time.Since(st))
				}
				if d > worst {
					worst, wa, wk = d, avail, k
				}
			}
		}
		t.Logf("%s worst %v avail %x size %d", p.Name, worst, wa, wk)
	}
}
