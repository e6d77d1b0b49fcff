package topology

import (
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/plugin/topology/topotest"
)

func scorerFor(t *testing.T, p topotest.Profile) *Scorer {
	t.Helper()
	return FromInventory(p.Inventory(), PolicyTopology)
}

// oracle holds P(x) for every subset x of one availability mask, indexed by
// the subset compressed onto the mask's positions, for brute-force optima.
type oracle struct {
	pos []int
	p   []int64
}

func newOracle(s *Scorer, avail uint64) *oracle {
	o := &oracle{pos: positions(avail)}
	a := len(o.pos)
	o.p = make([]int64, 1<<a)
	for x := 1; x < 1<<a; x++ {
		low := bits.TrailingZeros(uint(x))
		rest := x & (x - 1)
		v := o.p[rest]
		for r := rest; r != 0; r &= r - 1 {
			v += s.Pair(o.pos[low], o.pos[bits.TrailingZeros(uint(r))])
		}
		o.p[x] = v
	}
	return o
}

func (o *oracle) compress(m uint64) int {
	x := 0
	for k, i := range o.pos {
		if m&(1<<i) != 0 {
			x |= 1 << k
		}
	}
	return x
}

// optimum is the best (set score, leftover score) over every set of size k
// that contains must: the objective Best promises, found by enumeration.
func (o *oracle) optimum(must uint64, k int) (p, left int64) {
	full := 1<<len(o.pos) - 1
	mc := o.compress(must)
	free := full &^ mc
	found := false
	for t := free; ; t = (t - 1) & free {
		if x := mc | t; bits.OnesCount(uint(x)) == k {
			sp, sl := o.p[x], o.p[full&^x]
			if !found || sp > p || (sp == p && sl > left) {
				p, left, found = sp, sl, true
			}
		}
		if t == 0 {
			break
		}
	}
	return p, left
}

// checkBest runs Best and compares it with the brute-force optimum.
func checkBest(t *testing.T, s *Scorer, o *oracle, avail, must uint64, k int) {
	t.Helper()
	got, exact, err := s.best(avail, must, k, searchBudget)
	if err != nil {
		t.Fatalf("avail %v must %v size %d: %v", positions(avail), positions(must), k, err)
	}
	var gm uint64
	for _, i := range got {
		gm |= 1 << i
	}
	if len(got) != k || bits.OnesCount64(gm) != k || gm&^avail != 0 || must&^gm != 0 || !slices.IsSorted(got) {
		t.Fatalf("avail %v must %v size %d: invalid answer %v", positions(avail), positions(must), k, got)
	}
	if !exact {
		return
	}
	wantP, wantL := o.optimum(must, k)
	full := 1<<len(o.pos) - 1
	gotP, gotL := o.p[o.compress(gm)], o.p[full&^o.compress(gm)]
	if gotP != wantP || gotL != wantL {
		t.Fatalf("avail %v must %v size %d: got %v scoring (%d, leftover %d), optimum (%d, leftover %d)",
			positions(avail), positions(must), k, got, gotP, gotL, wantP, wantL)
	}
}

// Every availability mask of the 8-GPU nodes, every size, every must-include
// set that fits.
func TestBestExhaustive8(t *testing.T) {
	for _, p := range topotest.Profiles() {
		if p.Topology.Len() != 8 {
			continue
		}
		t.Run(p.Name, func(t *testing.T) {
			s := scorerFor(t, p)
			cases := 0
			for avail := uint64(1); avail < 1<<8; avail++ {
				o := newOracle(s, avail)
				for must := avail; ; must = (must - 1) & avail {
					for k := max(1, bits.OnesCount64(must)); k <= bits.OnesCount64(avail); k++ {
						checkBest(t, s, o, avail, must, k)
						cases++
					}
					if must == 0 {
						break
					}
				}
			}
			if cases != 23801 { // Σ over (avail, must ⊆ avail) of valid sizes
				t.Fatalf("checked %d cases", cases)
			}
		})
	}
}

func randomSubset(r *rand.Rand, m uint64, n int) uint64 {
	pos := positions(m)
	r.Shuffle(len(pos), func(i, j int) { pos[i], pos[j] = pos[j], pos[i] })
	var out uint64
	for _, i := range pos[:min(n, len(pos))] {
		out |= 1 << i
	}
	return out
}

// Random masks on the 16-GPU node (plus the all-free node), every size, with
// and without must-include.
func TestBestRandom16(t *testing.T) {
	p := topotest.TwoIslands16()
	s := scorerFor(t, p)
	r := rand.New(rand.NewPCG(1, 2))
	masks := []uint64{1<<16 - 1}
	for range 3000 {
		masks = append(masks, r.Uint64()&(1<<16-1))
	}
	for range 100 { // dense: mostly free nodes are where search is hardest
		masks = append(masks, (1<<16-1)&^randomSubset(r, 1<<16-1, r.IntN(4)))
	}
	for _, avail := range masks {
		if avail == 0 {
			continue
		}
		o := newOracle(s, avail)
		for k := 1; k <= bits.OnesCount64(avail); k++ {
			checkBest(t, s, o, avail, 0, k)
			checkBest(t, s, o, avail, randomSubset(r, avail, 1+r.IntN(k)), k)
		}
	}
}

// The counterexample to NVIDIA's best-effort policy and the size-1
// rule: the lone GPU taken is the one whose loss hurts the rest least.
func TestBestExamples(t *testing.T) {
	mask := func(ps ...int) uint64 {
		var m uint64
		for _, p := range ps {
			m |= 1 << p
		}
		return m
	}
	tests := []struct {
		name        string
		p           topotest.Profile
		avail, must uint64
		size        int
		want        []int
	}{
		{"dgx1 must 1 takes its 2-lane peer", topotest.DGX1V100(), mask(1, 2, 3, 4), mask(1), 2, []int{1, 2}},
		{"dgx1 pair with most lanes", topotest.DGX1V100(), mask(0, 1, 2, 3, 4, 5, 6, 7), 0, 2, nil},
		{"pcie size 1 keeps the switch pair", topotest.PCIe8GPU(), mask(0, 1, 2), 0, 1, []int{2}},
		{"pcie size 2 takes the switch pair", topotest.PCIe8GPU(), mask(0, 2, 3, 4), 0, 2, []int{2, 3}},
		{"pcie size 2 keeps a switch pair free", topotest.PCIe8GPU(), mask(0, 1, 2, 3, 4), 0, 2, nil},
		{"a100 fabric then PCIe pair", topotest.DGXA100(), mask(0, 2, 3, 5), 0, 2, []int{2, 3}},
		{"islands size 8 is one island", topotest.TwoIslands16(), 1<<16 - 1, 0, 8, nil},
		{"islands must 9 stays on island 2", topotest.TwoIslands16(), 1<<16 - 1, mask(9), 4, nil},
		{"must fills the size", topotest.DGX1V100(), mask(0, 5, 6), mask(5, 0), 2, []int{0, 5}},
		{"everything", topotest.DGX1V100(), mask(0, 5, 6), 0, 3, []int{0, 5, 6}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := scorerFor(t, tt.p)
			got, err := s.Best(tt.avail, tt.must, tt.size)
			if err != nil {
				t.Fatal(err)
			}
			if tt.want != nil && !slices.Equal(got, tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			// Cases without a fixed answer are checked by property.
			switch tt.name {
			case "dgx1 pair with most lanes":
				if s.Pair(got[0], got[1])/LaneWeight != 2 {
					t.Fatalf("got %v with %d lanes, want a 2-lane pair", got, s.Pair(got[0], got[1])/LaneWeight)
				}
			case "pcie size 2 keeps a switch pair free":
				// {0,1} and {2,3} are both switch pairs; taking one must leave the
				// other, so 4 (alone on its switch) stays out of the answer.
				if !slices.Equal(got, []int{0, 1}) && !slices.Equal(got, []int{2, 3}) {
					t.Fatalf("got %v, want a switch pair", got)
				}
			case "islands size 8 is one island":
				if got[0]/8 != got[7]/8 {
					t.Fatalf("got %v, crosses islands", got)
				}
			case "islands must 9 stays on island 2":
				for _, g := range got {
					if g < 8 {
						t.Fatalf("got %v, crosses islands", got)
					}
				}
			}
		})
	}
}

func TestBestErrors(t *testing.T) {
	s := New(topotest.DGX1V100().Topology, PolicyTopology)
	tests := []struct {
		name        string
		avail, must uint64
		size        int
		want        string
	}{
		{"size zero", 0xff, 0, 0, "allocation size 0"},
		{"must too large", 0xff, 0b111, 2, "3 must-include GPUs exceed allocation size 2"},
		{"must unavailable", 0b0011, 0b0100, 2, "must-include GPUs [2] are not available"},
		{"not enough", 0b0011, 0, 3, "2 GPUs available, 3 requested"},
		{"outside topology", 0x1ff, 0, 1, "available GPUs [8] are not in the topology"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.Best(tt.avail, tt.must, tt.size)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
		})
	}
}

func TestPairWeights(t *testing.T) {
	v100, a100, pcie := topotest.DGX1V100(), topotest.DGXA100(), topotest.PCIe8GPU()
	tests := []struct {
		name string
		p    topotest.Profile
		i, j int
		want int64
	}{
		{"2 lanes, one switch, same numa", v100, 0, 3, 2*LaneWeight + 2*PCIeWeight + NUMAWeight},
		{"1 lane across sockets", v100, 2, 6, LaneWeight},
		{"switch pair without nvlink", pcie, 0, 1, 4*PCIeWeight + NUMAWeight},
		{"same numa node", pcie, 0, 2, PCIeWeight + NUMAWeight},
		{"across sockets", pcie, 0, 7, 0},
		{"nvswitch fabric counts its lanes", a100, 0, 7, 12 * LaneWeight},
		{"nvswitch pair behind switches", a100, 0, 1, 12*LaneWeight + 3*PCIeWeight + NUMAWeight},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := scorerFor(t, tt.p)
			if got := s.Pair(tt.i, tt.j); got != tt.want || s.Pair(tt.j, tt.i) != got {
				t.Fatalf("Pair(%d,%d) = %d, want %d", tt.i, tt.j, got, tt.want)
			}
		})
	}
	// Lexicographic: the largest possible PCIe and NUMA total of a 64-GPU set
	// stays below one lane, and the NUMA total below one PCIe step.
	pairs := int64(MaxGPUs * (MaxGPUs - 1) / 2)
	if pairs*5*PCIeWeight+pairs*NUMAWeight >= LaneWeight || pairs*NUMAWeight >= PCIeWeight {
		t.Fatal("weights are not lexicographic")
	}
	// Board-level PCIe is closest; NVML levels above SYS count as SYS.
	if pcieRank(gpu.LevelInternal) != 5 || pcieRank(gpu.LinkLevel(60)) != 0 {
		t.Fatal("pcieRank ends")
	}
}

// bigTopology is n GPUs in DGX-1 islands of 8 (no NVLink between islands).
func bigTopology(n int) *gpu.Topology {
	isl := topotest.DGX1V100().Topology
	t := &gpu.Topology{Level: make([][]gpu.LinkLevel, n), DirectLanes: make([][]int, n),
		SwitchLanes: make([]int, n), Fabric: make([]int, n)}
	for i := range n {
		t.Level[i] = make([]gpu.LinkLevel, n)
		t.DirectLanes[i] = make([]int, n)
		t.Fabric[i] = -1
		for j := range n {
			switch {
			case i/8 == j/8:
				t.Level[i][j] = isl.Level[i%8][j%8]
				t.DirectLanes[i][j] = isl.DirectLanes[i%8][j%8]
			default:
				t.Level[i][j] = gpu.LevelSystem
			}
		}
	}
	return t
}

// Above ExactLimit the search is budgeted: answers stay valid, and any answer
// reported exact is optimal (checked where brute force is affordable).
func TestBestAboveExactLimit(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	s := New(bigTopology(20), PolicyTopology)
	for range 10 {
		avail := (1<<20 - 1) &^ randomSubset(r, 1<<20-1, r.IntN(4))
		o := newOracle(s, avail)
		for _, k := range []int{1, 2, 3, bits.OnesCount64(avail) - 1} {
			checkBest(t, s, o, avail, 0, k)
			checkBest(t, s, o, avail, randomSubset(r, avail, 1), k)
		}
	}
	big := New(bigTopology(64), PolicyTopology)
	for _, budget := range []int{1, 50, searchBudget} {
		for _, k := range []int{1, 8, 17, 32, 63} {
			got, _, err := big.best(^uint64(0), 1<<40, k, budget)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != k || !slices.Contains(got, 40) {
				t.Fatalf("budget %d size %d: invalid %v", budget, k, got)
			}
			if k == 8 && budget == searchBudget && got[0] != 40 {
				// must 40 with 7 more: its own island (40..47) is the only
				// set with every cube-mesh lane.
				t.Fatalf("size 8 must 40: got %v, want island 40-47", got)
			}
		}
	}
}
