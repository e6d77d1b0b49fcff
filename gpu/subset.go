package gpu

import "slices"

// EmptyTopology describes n GPUs with nothing known between them: every
// pair at LevelSystem, no NVLink. It stands in where GPUs are known from a
// record (a checkpoint) rather than read.
func EmptyTopology(n int) *Topology {
	t := &Topology{
		Level:       make([][]LinkLevel, n),
		DirectLanes: make([][]int, n),
		SwitchLanes: make([]int, n),
		Fabric:      make([]int, n),
	}
	for i := range n {
		t.Level[i] = make([]LinkLevel, n)
		t.DirectLanes[i] = make([]int, n)
		for j := range n {
			t.Level[i][j] = LevelSystem
		}
		t.Level[i][i] = LevelInternal
		t.Fabric[i] = -1
	}
	return t
}

// Without returns a copy of inv lacking the GPUs with the given UUIDs, its
// topology cut to match (it is indexed by position in GPUs). inv itself is
// returned when none of them is in it.
func (inv *Inventory) Without(uuids []string) *Inventory {
	var keep []int
	for i, g := range inv.GPUs {
		if !slices.Contains(uuids, g.UUID) {
			keep = append(keep, i)
		}
	}
	if len(keep) == len(inv.GPUs) {
		return inv
	}
	out := *inv
	out.GPUs = make([]GPU, 0, len(keep))
	for _, i := range keep {
		out.GPUs = append(out.GPUs, inv.GPUs[i])
	}
	if t := inv.Topology; t != nil && t.Len() == len(inv.GPUs) {
		nt := &Topology{
			Level:       make([][]LinkLevel, len(keep)),
			DirectLanes: make([][]int, len(keep)),
			SwitchLanes: make([]int, len(keep)),
			Fabric:      make([]int, len(keep)),
		}
		for a, i := range keep {
			nt.Level[a] = make([]LinkLevel, len(keep))
			nt.DirectLanes[a] = make([]int, len(keep))
			for b, j := range keep {
				nt.Level[a][b] = t.Level[i][j]
				nt.DirectLanes[a][b] = t.DirectLanes[i][j]
			}
			nt.SwitchLanes[a] = t.SwitchLanes[i]
			nt.Fabric[a] = t.Fabric[i]
		}
		out.Topology = nt
	} else {
		out.Topology = EmptyTopology(len(keep))
	}
	return &out
}
