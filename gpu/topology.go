package gpu

// LinkLevel is the PCIe path between two GPUs, with NVML's values
// (nvml.GpuTopologyLevel): lower is closer.
type LinkLevel int

// Values of nvmlGpuTopologyLevel_t.
const (
	LevelInternal   LinkLevel = 0  // same board (multi-GPU board)
	LevelSingle     LinkLevel = 10 // one PCIe switch
	LevelMultiple   LinkLevel = 20 // several PCIe switches, no host bridge
	LevelHostBridge LinkLevel = 30 // same host bridge
	LevelNode       LinkLevel = 40 // same NUMA node, across host bridges
	LevelSystem     LinkLevel = 50 // across NUMA nodes (SMP interconnect)
)

// String returns the short names nvidia-smi topo -m uses.
func (l LinkLevel) String() string {
	switch l {
	case LevelInternal:
		return "BOARD"
	case LevelSingle:
		return "PIX"
	case LevelMultiple:
		return "PXB"
	case LevelHostBridge:
		return "PHB"
	case LevelNode:
		return "NODE"
	case LevelSystem:
		return "SYS"
	}
	return "?"
}

// Topology describes how every pair of GPUs in an Inventory is connected. It is
// computed once per snapshot; allocation reads it per request.
type Topology struct {
	// Level[i][j] is the PCIe link level between GPUs i and j (positions in
	// Inventory.GPUs). Level[i][i] is LevelInternal.
	Level [][]LinkLevel `json:"level"`
	// DirectLanes[i][j] counts active NVLink lanes from GPU i that end at GPU j.
	DirectLanes [][]int `json:"directLanes"`
	// SwitchLanes[i] counts active NVLink lanes from GPU i that end at an NVSwitch.
	SwitchLanes []int `json:"switchLanes"`
	// Fabric[i] identifies the NVSwitch fabric GPU i is attached to (GPUs whose
	// lanes reach a common switch share a fabric); -1 when none.
	Fabric []int `json:"fabric"`
}

// Len is the number of GPUs described.
func (t *Topology) Len() int { return len(t.Level) }

// Lanes is the effective NVLink lane count between GPUs i and j: their direct
// lanes plus, when both sit on the same NVSwitch fabric, the lanes the slower
// of the two has into that fabric (a switch gives every pair on it full
// bandwidth, so it counts as that many lanes between each pair).
func (t *Topology) Lanes(i, j int) int {
	if i == j {
		return 0
	}
	n := t.DirectLanes[i][j]
	if t.Fabric[i] >= 0 && t.Fabric[i] == t.Fabric[j] {
		n += min(t.SwitchLanes[i], t.SwitchLanes[j])
	}
	return n
}

// NVLinkCliques partitions the GPUs into groups in which every pair has NVLink
// lanes (direct or through a shared NVSwitch fabric), and returns each
// position's group number, or -1 for a GPU with no NVLink at all. Any two
// GPUs of one group talk over NVLink, so a DRA claim that asks for GPUs with
// one value of it gets an NVLink-connected set.
//
// Groups are grown greedily in position order, each from its lowest free GPU,
// adding the free GPU linked to every member with the most lanes to them: on
// a DGX-1 cube-mesh that gives its two fully connected quads, on an NVSwitch
// system one group per fabric. Numbers follow positions, so equal nodes get
// equal numbers.
func (t *Topology) NVLinkCliques() []int {
	n := t.Len()
	out := make([]int, n)
	for i := range out {
		out[i] = -1
	}
	linked := func(i int) bool {
		for j := range n {
			if t.Lanes(i, j) > 0 {
				return true
			}
		}
		return false
	}
	next := 0
	for seed := range n {
		if out[seed] >= 0 || !linked(seed) {
			continue
		}
		members := []int{seed}
		out[seed] = next
		for {
			best, bestLanes := -1, 0
			for c := range n {
				if out[c] >= 0 {
					continue
				}
				lanes := 0
				for _, m := range members {
					l := t.Lanes(c, m)
					if l == 0 {
						lanes = 0
						break
					}
					lanes += l
				}
				if lanes > bestLanes {
					best, bestLanes = c, lanes
				}
			}
			if best < 0 {
				break
			}
			members = append(members, best)
			out[best] = next
		}
		next++
	}
	return out
}
