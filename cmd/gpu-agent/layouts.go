package main

import (
	"errors"
	"fmt"
	"io"
	"maps"
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

// Verdicts of a named layout on one GPU model.
const (
	verdictFits   = "fits"
	verdictNotFit = "does not fit"
	verdictNone   = "applies to no GPU of"
	verdictUnread = "cannot be checked on"
)

// How bad an entry's verdicts are.
const (
	entryIsFine    = ""
	entryIsError   = "error"
	entryIsWarning = "warning"
)

// modelVerdict is what a named layout does on one model's GPUs.
type modelVerdict struct {
	model   gpuModel
	verdict string
	gpus    []int // the GPUs it applies to
	err     error
}

// entryReport is what a named layout (a mig-configs entry) would do on the
// node, model by model, and how bad that is.
type entryReport struct {
	name     string
	models   []modelVerdict
	noneWhy  string // why it applies to no GPU, when it does not
	severity string
	err      error // the error, naming the entry
}

// checkMigConfigs plans every entry of f's mig-configs on the node as the
// agent would with the node labelled nvidia.com/mig.config=<entry>, each
// GPU model on its own so that a verdict is said once per model. An entry
// that fits no model of the node is a warning (it may be meant for other
// nodes), unless its device-filter names a model it does not fit here:
// then it is an error.
func checkMigConfigs(f *config.File, s *selection, snap agent.Snapshot) ([]entryReport, error) {
	labels, err := parseLabels(s.labels)
	if err != nil {
		return nil, err
	}
	models := nodeModels(snap.Inventory)
	var out []entryReport
	for _, name := range slices.Sorted(maps.Keys(f.MigConfigs)) {
		labels[config.MIGConfigLabel] = name
		sel, err := f.Select(s.node, labels)
		if err != nil {
			return nil, err
		}
		rep := entryReport{name: name}
		fits, named := 0, ""
		for _, m := range models {
			v := modelVerdict{model: m}
			one := snap
			inv := *snap.Inventory
			inv.GPUs = m.gpus
			one.Inventory, one.Selected = &inv, sel
			planned, err := agent.PlanMIG(one)
			r := reachOf(sel.MIGLayout, m.gpus)
			switch {
			case errors.Is(err, mig.ErrLayout):
				v.verdict, v.err = verdictNotFit, err
			case err != nil:
				v.verdict, v.err = verdictUnread, err
			case len(planned) == 0 || !r.applies():
				v.verdict = verdictNone
			default:
				v.verdict = verdictFits
				for _, gm := range planned {
					v.gpus = append(v.gpus, gm.GPU)
				}
				fits++
			}
			if v.verdict == verdictNotFit || v.verdict == verdictNone {
				for _, e := range sel.MIGLayout {
					if named == "" && mig.FilterNames(e, m.id) {
						named = m.name
						rep.err = v.err
					}
				}
			}
			rep.models = append(rep.models, v)
		}
		rep.noneWhy = noneWhy(sel.MIGLayout, models)
		switch {
		case named != "" && rep.err != nil:
			rep.severity = entryIsError
			rep.err = fmt.Errorf("mig-configs entry %s does not fit the %s its device-filter names: %w", name, named, rep.err)
		case named != "":
			rep.severity = entryIsError
			rep.err = sel.MIGError(-1, "", fmt.Errorf("its device-filter names %s, but no entry of it that enables MIG applies to its GPUs (%s)",
				named, rep.noneWhy))
		case fits == 0 || slices.ContainsFunc(rep.models, func(v modelVerdict) bool { return v.verdict == verdictNotFit || v.verdict == verdictUnread }):
			rep.severity = entryIsWarning
		}
		out = append(out, rep)
	}
	return out, nil
}

// noneWhy says why no entry of layout that is for enabling MIG (or, in a
// layout that only disables it, no entry) applies to the node.
func noneWhy(layout config.MigLayout, models []gpuModel) string {
	var gpus []gpu.GPU
	for _, m := range models {
		gpus = append(gpus, m.gpus...)
	}
	r := reachOf(layout, gpus)
	var why []string
	for i, e := range layout {
		if (e.MigEnabled || !r.enables) && len(r.byEntry[i]) == 0 {
			why = append(why, fmt.Sprintf("entry [%d]: %s", i, unmatchedWhy(e, r, i, models)))
		}
	}
	return strings.Join(append(why, "this node: "+modelList(models)), "; ")
}

// writeMigConfigs writes each entry's verdicts on the node, one line per
// entry, why it does not fit said once per model.
func writeMigConfigs(w io.Writer, node string, reports []entryReport) {
	fmt.Fprintf(w, "Its mig-configs on %s, each as the node labelled %s=<entry> would apply it:\n", node, config.MIGConfigLabel)
	for _, rep := range reports {
		var parts []string
		none := 0
		for _, v := range rep.models {
			switch v.verdict {
			case verdictFits:
				parts = append(parts, fmt.Sprintf("fits %s (GPUs %s)", v.model.name, indexList(v.gpus)))
			case verdictNone:
				none++
				parts = append(parts, "applies to no GPU of "+v.model.name)
			default:
				parts = append(parts, fmt.Sprintf("%s %s: %v", v.verdict, v.model.name, v.err))
			}
		}
		if none == len(rep.models) {
			parts = []string{"applies to no GPU of this node (" + rep.noneWhy + ")"}
		}
		fmt.Fprintf(w, "  %s: %s\n", rep.name, strings.Join(parts, "; "))
	}
}

// migConfigsWarning is the one warning for the entries that fit no model
// of the node (or, on a node of several models, not every model it
// applies to): each is said on its line above.
func migConfigsWarning(reports []entryReport, models int) string {
	var names []string
	for _, rep := range reports {
		if rep.severity == entryIsWarning {
			names = append(names, rep.name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	const maxNamed = 12
	list := strings.Join(names[:min(len(names), maxNamed)], ", ")
	if len(names) > maxNamed {
		list += fmt.Sprintf(", ... (%d more)", len(names)-maxNamed)
	}
	which := "no GPU model of this node"
	if models > 1 {
		which = "not every GPU model of this node it applies to"
	}
	if len(names) == 1 {
		return fmt.Sprintf("mig-configs entry %s fits %s (above); fine if it is meant for other nodes", list, which)
	}
	return fmt.Sprintf("%d mig-configs entries fit %s (above): %s; fine if they are meant for other nodes", len(names), which, list)
}
