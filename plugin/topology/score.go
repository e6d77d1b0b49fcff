// Package topology chooses which GPUs to offer the kubelet when a container
// asks for several: it scores GPU sets from the node's NVLink and PCIe
// topology and finds the best set exactly (branch and bound over bitmasks), so
// GetPreferredAllocation answers are optimal and take microseconds.
package topology

import (
	"fmt"
	"math/bits"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Policy is the allocation policy from config `allocation.policy`.
type Policy string

// Policies. They differ only for shared devices (time-slice replicas, MIG
// devices: several devices on one physical GPU). For whole GPUs every policy
// runs the exact topology search: one device per GPU leaves nothing to pack
// or spread, and the best-connected set is what both a packed and a
// distributed user wants from several whole GPUs.
const (
	// PolicyTopology picks the best-connected set; for shared devices it packs
	// and spills onto the GPU best connected to those already chosen.
	PolicyTopology Policy = "topology"
	// PolicyPacked fills one physical GPU before using the next, preferring
	// the fullest GPUs so that empty ones stay empty for whole-GPU work.
	PolicyPacked Policy = "packed"
	// PolicyDistributed spreads shared devices across physical GPUs,
	// preferring the least used ones, so co-tenants contend less.
	PolicyDistributed Policy = "distributed"
)

// ParsePolicy accepts the config spelling; "" means the default (topology).
func ParsePolicy(s string) (Policy, error) {
	switch Policy(s) {
	case "":
		return PolicyTopology, nil
	case PolicyTopology, PolicyPacked, PolicyDistributed:
		return Policy(s), nil
	}
	return "", fmt.Errorf("allocation policy %q: want %s, %s or %s", s, PolicyTopology, PolicyPacked, PolicyDistributed)
}

// MaxGPUs is the most GPU positions a Scorer handles: sets are uint64 masks.
const MaxGPUs = 64

// Weights of one GPU pair's score. A set's score is the sum over its pairs, so
// it is a lexicographic comparison of (NVLink lanes, PCIe proximity, same-NUMA
// pairs) summed over the set, because each weight exceeds the largest sum the
// terms below it can reach in any set of up to MaxGPUs GPUs (at most 2016
// pairs):
//
//   - NUMAWeight (1) per pair whose GPUs sit on the same known NUMA node.
//     Sums to at most 2016.
//   - PCIeWeight (2048 > 2016) per step of PCIe proximity: across sockets 0,
//     same NUMA node 1, host bridge 2, several switches 3, one switch 4, same
//     board 5. Sums to at most 2016·5·2048 < 2^25.
//   - LaneWeight (2^25) per effective NVLink lane (gpu.Topology.Lanes, which
//     counts an NVSwitch fabric as full connectivity between its GPUs).
//
// Why lexicographic: one NVLink lane moves more data than any PCIe path, so no
// amount of PCIe closeness may buy back a lost lane; among equal NVLink,
// a shorter PCIe path is what peer-to-peer traffic and staging use; NUMA only
// matters for host memory traffic, which is last. NVIDIA's best-effort policy
// adds 100 per lane and 10..60 per PCIe level instead, so enough PCIe pairs can
// outweigh an NVLink lane; here that cannot happen.
const (
	NUMAWeight int64 = 1
	PCIeWeight int64 = 2048
	LaneWeight int64 = 1 << 25
)

// pcieRank orders PCIe levels from far (0) to near (5).
func pcieRank(l gpu.LinkLevel) int64 {
	switch {
	case l <= gpu.LevelInternal:
		return 5
	case l <= gpu.LevelSingle:
		return 4
	case l <= gpu.LevelMultiple:
		return 3
	case l <= gpu.LevelHostBridge:
		return 2
	case l <= gpu.LevelNode:
		return 1
	}
	return 0
}

// Scorer holds the pair scores of one topology. It is built once per
// inventory and is safe for concurrent use: Best only reads it.
type Scorer struct {
	n      int
	policy Policy
	// w[i*n+j] is the score of the pair (i, j); w[i*n+i] is 0.
	w []int64
	// pos maps a GPU's NVML index to its position in the topology.
	pos map[int]int
}

// New precomputes pair scores from t; the result is then used for every
// request. NUMA locality is unknown here (gpu.Topology does not carry it);
// FromInventory adds it. An unknown policy is treated as PolicyTopology.
func New(t *gpu.Topology, policy Policy) *Scorer {
	return newScorer(t, nil, nil, policy)
}

// FromInventory builds the Scorer for an inventory snapshot: pair scores from
// its Topology with NUMA locality from its GPUs, and GPU indices mapped to
// topology positions (they differ when a GPU failed to enumerate).
func FromInventory(inv *gpu.Inventory, policy Policy) *Scorer {
	t := inv.Topology
	if t == nil {
		t = &gpu.Topology{}
	}
	numa := make([]int, len(inv.GPUs))
	index := make([]int, len(inv.GPUs))
	for i, g := range inv.GPUs {
		numa[i], index[i] = g.NUMANode, g.Index
	}
	return newScorer(t, numa, index, policy)
}

func newScorer(t *gpu.Topology, numa, index []int, policy Policy) *Scorer {
	if _, err := ParsePolicy(string(policy)); err != nil || policy == "" {
		policy = PolicyTopology
	}
	n := t.Len()
	s := &Scorer{n: n, policy: policy, w: make([]int64, n*n), pos: make(map[int]int, n)}
	for i := range n {
		s.pos[i] = i
	}
	if len(index) == n {
		clear(s.pos)
		for i, idx := range index {
			s.pos[idx] = i
		}
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			v := int64(t.Lanes(i, j))*LaneWeight + pcieRank(t.Level[i][j])*PCIeWeight
			if len(numa) == n && numa[i] >= 0 && numa[i] == numa[j] {
				v += NUMAWeight
			}
			s.w[i*n+j], s.w[j*n+i] = v, v
		}
	}
	return s
}

// Len is the number of GPU positions.
func (s *Scorer) Len() int { return s.n }

// Policy is the policy the Scorer was built with.
func (s *Scorer) Policy() Policy { return s.policy }

// Pair is the score of GPUs i and j (positions); 0 when i == j.
func (s *Scorer) Pair(i, j int) int64 { return s.w[i*s.n+j] }

// Score is the score of a set of positions: the sum of its pair scores.
func (s *Scorer) Score(set []int) int64 {
	var v int64
	for a, i := range set {
		for _, j := range set[a+1:] {
			v += s.w[i*s.n+j]
		}
	}
	return v
}

// ScoreMask is Score for a bitmask of positions.
func (s *Scorer) ScoreMask(set uint64) int64 {
	return s.Score(positions(set))
}

func positions(m uint64) []int {
	out := make([]int, 0, bits.OnesCount64(m))
	for m != 0 {
		i := bits.TrailingZeros64(m)
		out = append(out, i)
		m &= m - 1
	}
	return out
}
