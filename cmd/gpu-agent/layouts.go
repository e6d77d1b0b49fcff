package main

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// gpuModel is one GPU model of a node and its GPUs.
type gpuModel struct {
	name string
	id   uint32 // PCI device id, what a device-filter names; 0 unknown
	mig  bool
	gpus []gpu.GPU
}

func (m gpuModel) String() string {
	s := m.name
	if m.id != 0 {
		s += fmt.Sprintf(", device-filter 0x%08X", m.id)
	}
	if !m.mig {
		s += ", no MIG"
	}
	return s
}

// nodeModels groups a node's GPUs by model, in GPU order.
func nodeModels(inv *gpu.Inventory) []gpuModel {
	var out []gpuModel
	for _, g := range inv.GPUs {
		i := slices.IndexFunc(out, func(m gpuModel) bool { return m.name == g.Name && m.id == g.PCIDeviceID })
		if i < 0 {
			out = append(out, gpuModel{name: g.Name, id: g.PCIDeviceID, mig: g.MIGCapable})
			i = len(out) - 1
		}
		out[i].gpus = append(out[i].gpus, g)
	}
	return out
}

func modelList(models []gpuModel) string {
	var s []string
	for _, m := range models {
		s = append(s, m.String())
	}
	return strings.Join(s, "; ")
}

// indexList writes GPU indices with runs as ranges: "0-3, 6".
func indexList(idx []int) string {
	idx = slices.Sorted(slices.Values(idx))
	var parts []string
	for i := 0; i < len(idx); {
		j := i
		for j+1 < len(idx) && idx[j+1] == idx[j]+1 {
			j++
		}
		switch {
		case j == i:
			parts = append(parts, strconv.Itoa(idx[i]))
		case j == i+1:
			parts = append(parts, strconv.Itoa(idx[i]), strconv.Itoa(idx[j]))
		default:
			parts = append(parts, fmt.Sprintf("%d-%d", idx[i], idx[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}

// reach is which entries of a MIG layout apply to which GPUs, by the
// planner's matching (mig.EntryOf: the first entry whose devices and
// device-filter match a GPU).
type reach struct {
	// byEntry lists each entry's GPUs.
	byEntry map[int][]int
	// enables: some entry enables MIG; enabling: some GPU gets one.
	enables, enabling bool
}

func reachOf(layout config.MigLayout, gpus []gpu.GPU) reach {
	r := reach{byEntry: map[int][]int{}}
	for _, e := range layout {
		r.enables = r.enables || e.MigEnabled
	}
	for _, g := range gpus {
		// A device-filter that is not a PCI id is the validator's error.
		if ei, err := mig.EntryOf(layout, g); err == nil && ei >= 0 {
			r.byEntry[ei] = append(r.byEntry[ei], g.Index)
			r.enabling = r.enabling || layout[ei].MigEnabled
		}
	}
	return r
}

// applies reports whether the layout does what it is for on these GPUs:
// an entry enabling MIG applies to one of them, or, for a layout that
// only disables MIG, any entry applies to one.
func (r reach) applies() bool { return r.enabling || !r.enables && len(r.byEntry) > 0 }

// unmatchedWhy says why entry i of layout applies to no GPU of the node.
func unmatchedWhy(e config.MigDeviceConfig, r reach, i int, models []gpuModel) string {
	named := false
	for _, m := range models {
		named = named || mig.FilterNames(e, m.id)
	}
	if len(e.DeviceFilter) > 0 && !named {
		return fmt.Sprintf("device-filter %s names another model", strings.Join(e.DeviceFilter, ", "))
	}
	if !e.Devices.All {
		var have []int
		for _, m := range models {
			for _, g := range m.gpus {
				if slices.Contains(e.Devices.Indices, g.Index) {
					have = append(have, g.Index)
				}
			}
		}
		if len(have) == 0 {
			return fmt.Sprintf("devices %s: no such GPU on this node", indexList(e.Devices.Indices))
		}
	}
	var earlier []string
	for j := range i {
		if len(r.byEntry[j]) > 0 {
			earlier = append(earlier, fmt.Sprintf("[%d]", j))
		}
	}
	return "its GPUs are taken by entries " + strings.Join(earlier, ", ")
}

// checkSelectedLayout refuses a selected layout that does nothing of what
// it is for on this node: no entry applies to any GPU, or no entry that
// enables MIG does (a device-filter for another model, the rest of the
// layout only disabling MIG). printMIG has already refused one the planner
// cannot plan.
func checkSelectedLayout(snap agent.Snapshot, d agent.Desired) error {
	sel, layout := snap.Selected, snap.Selected.MIGLayout
	models := nodeModels(snap.Inventory)
	if len(d.MIG) == 0 {
		return sel.MIGError(-1, "", fmt.Errorf("no entry applies to any GPU of this node (%s): it would change nothing; check each entry's device-filter and devices",
			modelList(models)))
	}
	r := reachOf(layout, snap.Inventory.GPUs)
	if r.applies() {
		return nil
	}
	var why []string
	var disabled []int
	for i, e := range layout {
		if e.MigEnabled {
			why = append(why, fmt.Sprintf("entry [%d]: %s", i, unmatchedWhy(e, r, i, models)))
		} else {
			disabled = append(disabled, r.byEntry[i]...)
		}
	}
	return sel.MIGError(-1, "", fmt.Errorf("no entry that enables MIG applies to any GPU of this node (%s; this node: %s): it would only disable MIG on GPUs %s; check each entry's device-filter and devices",
		strings.Join(why, "; "), modelList(models), indexList(disabled)))
}

// writeUnmatched lists the entries of the selected layout that apply to no
// GPU of the node, with why: a layout for several models has some.
func writeUnmatched(w io.Writer, snap agent.Snapshot) {
	layout := snap.Selected.MIGLayout
	r := reachOf(layout, snap.Inventory.GPUs)
	models := nodeModels(snap.Inventory)
	for i, e := range layout {
		if len(r.byEntry[i]) == 0 {
			fmt.Fprintln(w, snap.Selected.MIGError(i, "", errors.New("applies to no GPU of this node ("+unmatchedWhy(e, r, i, models)+")")))
		}
	}
}
