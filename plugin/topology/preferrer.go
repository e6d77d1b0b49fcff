package topology

import (
	"fmt"
	"slices"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// Preferrer answers GetPreferredAllocation for one resource from a Scorer
// built once per inventory. It implements catalog.Preferrer.
type Preferrer struct {
	s *Scorer
	// pos maps a device ID to its GPU's topology position.
	pos map[string]int
	// byPos lists the device IDs on each position, sorted.
	byPos [][]string
	// shared is set when some GPU carries several devices (replicas, MIG):
	// then the policy decides how they are packed or spread.
	shared bool
}

var _ catalog.Preferrer = (*Preferrer)(nil)

// NewPreferrer adapts s to a resource whose devices live on the GPUs s
// describes (catalog.Device.GPU is the GPU's NVML index). With one device per
// GPU the answer is Best's exact optimum; with several per GPU the policy
// packs or spreads them (see Policy). Devices on GPUs the topology does not
// know are only offered when nothing else fits.
func NewPreferrer(s *Scorer, devices []catalog.Device) *Preferrer {
	p := &Preferrer{s: s, pos: make(map[string]int, len(devices)), byPos: make([][]string, s.n)}
	for _, d := range devices {
		i, ok := s.pos[d.GPU]
		if !ok {
			continue
		}
		if _, dup := p.pos[d.ID]; dup {
			continue
		}
		p.pos[d.ID] = i
		p.byPos[i] = append(p.byPos[i], d.ID)
	}
	for i := range p.byPos {
		slices.Sort(p.byPos[i])
		if len(p.byPos[i]) > 1 {
			p.shared = true
		}
	}
	return p
}

// NewGPUPreferrer is the Preferrer for whole GPUs (device ID = GPU UUID) of
// inv. Build it once per inventory snapshot: it precomputes the pair scores.
func NewGPUPreferrer(inv *gpu.Inventory, policy Policy) *Preferrer {
	devs := make([]catalog.Device, 0, len(inv.GPUs))
	for _, g := range inv.GPUs {
		devs = append(devs, catalog.Device{ID: g.UUID, GPU: g.Index, NUMANode: g.NUMANode})
	}
	return NewPreferrer(FromInventory(inv, policy), devs)
}

// Preferred returns size IDs from available, containing every ID in mustInclude.
func (p *Preferrer) Preferred(available, mustInclude []string, size int) ([]string, error) {
	avail := make(map[string]bool, len(available))
	var ids []string // available, deduplicated, in request order
	for _, id := range available {
		if !avail[id] {
			avail[id] = true
			ids = append(ids, id)
		}
	}
	must := make(map[string]bool, len(mustInclude))
	var mustIDs []string
	for _, id := range mustInclude {
		if !avail[id] {
			return nil, fmt.Errorf("must-include device %q is not available", id)
		}
		if !must[id] {
			must[id] = true
			mustIDs = append(mustIDs, id)
		}
	}
	switch {
	case size <= 0:
		return nil, fmt.Errorf("allocation size %d", size)
	case len(mustIDs) > size:
		return nil, fmt.Errorf("%d must-include devices exceed allocation size %d", len(mustIDs), size)
	case len(ids) < size:
		return nil, fmt.Errorf("%d devices available, %d requested", len(ids), size)
	}
	if p.shared {
		return p.preferShared(ids, mustIDs, size), nil
	}
	return p.preferWhole(ids, must, mustIDs, size)
}

// preferWhole runs the exact search over the known GPUs. IDs the catalog does
// not know (the kubelet's view can lag one update behind) have no position:
// must-include ones are kept, others only fill what the known ones cannot.
func (p *Preferrer) preferWhole(ids []string, must map[string]bool, mustIDs []string, size int) ([]string, error) {
	var availMask, mustMask uint64
	var out, unknown []string
	for _, id := range ids {
		i, ok := p.pos[id]
		switch {
		case !ok && must[id]:
			out = append(out, id)
		case !ok:
			unknown = append(unknown, id)
		default:
			availMask |= 1 << i
			if must[id] {
				mustMask |= 1 << i
			}
		}
	}
	want := size - len(out)
	if n := len(positions(availMask)); n < want {
		// Too few known GPUs: take all of them, then unknown IDs in order.
		for _, i := range positions(availMask) {
			out = append(out, p.byPos[i][0])
		}
		slices.Sort(unknown)
		return append(out, unknown[:size-len(out)]...), nil
	}
	if want == 0 {
		return out, nil
	}
	set, err := p.s.Best(availMask, mustMask, want)
	if err != nil {
		return nil, fmt.Errorf("must-include %v: %w", mustIDs, err)
	}
	for _, i := range set {
		out = append(out, p.byPos[i][0])
	}
	return out, nil
}

// preferShared picks devices one at a time: each from the GPU the policy
// ranks first, taking that GPU's smallest available ID.
func (p *Preferrer) preferShared(ids, mustIDs []string, size int) []string {
	n := p.s.n
	free := make([][]string, n) // available, not yet chosen, by position
	used := make([]int, n)      // devices on the GPU the kubelet did not offer: taken by others
	picked := make([]int, n)    // devices of this answer on the GPU
	conn := make([]int64, n)    // Σ pair score to the GPUs in this answer
	mustSet := make(map[string]bool, len(mustIDs))
	out := make([]string, 0, size)
	var unknown []string

	take := func(id string) {
		out = append(out, id)
		i, ok := p.pos[id]
		if !ok {
			return
		}
		if picked[i] == 0 {
			for j := range n {
				conn[j] += p.s.Pair(i, j)
			}
		}
		picked[i]++
	}
	for _, id := range mustIDs {
		mustSet[id] = true
		take(id)
	}
	offered := make(map[string]bool, len(ids))
	for _, id := range ids {
		offered[id] = true
		if mustSet[id] {
			continue
		}
		if i, ok := p.pos[id]; ok {
			free[i] = append(free[i], id)
		} else {
			unknown = append(unknown, id)
		}
	}
	for i, devs := range p.byPos {
		for _, id := range devs {
			if !offered[id] {
				used[i]++
			}
		}
		slices.Sort(free[i])
	}
	for len(out) < size {
		best := -1
		for i := range n {
			if len(free[i]) > 0 && (best < 0 || p.before(i, best, picked, used, conn)) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		take(free[best][0])
		free[best] = free[best][1:]
	}
	slices.Sort(unknown)
	return append(out, unknown[:size-len(out)]...)
}

// before reports whether the policy takes the next device from GPU i rather
// than from GPU j (ties go to the lower position).
func (p *Preferrer) before(i, j int, picked, used []int, conn []int64) bool {
	type key struct{ a, b, c int64 } // compared in order, larger first
	var ki, kj key
	switch p.s.policy {
	case PolicyDistributed:
		// A GPU not yet in the answer, then the least used, then the best connected.
		ki = key{-int64(picked[i]), -int64(used[i]), conn[i]}
		kj = key{-int64(picked[j]), -int64(used[j]), conn[j]}
	case PolicyPacked:
		// Stay on the GPUs already in the answer, then the fullest GPU.
		ki = key{int64(picked[i]), int64(used[i]), conn[i]}
		kj = key{int64(picked[j]), int64(used[j]), conn[j]}
	default:
		// Like packed, but spill onto the GPU best connected to the answer.
		ki = key{int64(picked[i]), conn[i], int64(used[i])}
		kj = key{int64(picked[j]), conn[j], int64(used[j])}
	}
	if ki.a != kj.a {
		return ki.a > kj.a
	}
	if ki.b != kj.b {
		return ki.b > kj.b
	}
	if ki.c != kj.c {
		return ki.c > kj.c
	}
	return i < j
}
