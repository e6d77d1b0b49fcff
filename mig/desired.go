package mig

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// Want is the desired MIG state of one GPU.
type Want struct {
	MIGEnabled bool `json:"migEnabled"`
	// Counts maps a GPU instance profile name to how many instances to have.
	// Profiles not listed are wanted zero times.
	Counts map[string]int `json:"counts,omitempty"`
	// Entry is the index of the layout entry this came from, for messages.
	Entry int `json:"entry"`
}

// Equal reports whether two wants ask for the same end state.
func (w Want) Equal(o Want) bool {
	if w.MIGEnabled != o.MIGEnabled {
		return false
	}
	for k, v := range w.Counts {
		if o.Counts[k] != v {
			return false
		}
	}
	for k, v := range o.Counts {
		if w.Counts[k] != v {
			return false
		}
	}
	return true
}

func (w Want) String() string {
	if !w.MIGEnabled {
		return "mig disabled"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(w.Counts)) {
		if w.Counts[k] > 0 {
			parts = append(parts, fmt.Sprintf("%dx %s", w.Counts[k], k))
		}
	}
	if len(parts) == 0 {
		return "mig enabled, no instances"
	}
	return strings.Join(parts, ", ")
}

// ErrLayout marks an error that says a layout does not fit a GPU, or is
// malformed: a config asking for it does not fit the node, and is refused
// before anything changes. Other planning errors (a GPU read partly,
// profiles not read) are the node's state, not the config's.
var ErrLayout = errors.New("MIG layout does not fit")

// Desired picks, for every GPU of the inventory, the first layout entry that
// matches it by index and device filter (mig-parted's rule) and returns what
// that entry wants. GPUs no entry matches are absent: the agent leaves them
// alone. Device filters match gpu.GPU.PCIDeviceID; an entry with a device
// filter never matches a GPU whose id is unknown (0).
func Desired(layout config.MigLayout, inv *gpu.Inventory) (map[int]Want, error) {
	out := map[int]Want{}
	for _, g := range inv.GPUs {
		ei, err := EntryOf(layout, g)
		if err != nil {
			return nil, err
		}
		if ei < 0 {
			continue
		}
		w, field, err := wantOf(ei, layout[ei], g)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrLayout, &EntryError{Entry: ei, Field: field,
				Err: fmt.Errorf("gpu %d (%s): %w", g.Index, g.UUID, err)})
		}
		if w != nil {
			out[g.Index] = *w
		}
	}
	return out, nil
}

// EntryOf is the index of the first entry of layout that matches g by
// index and device filter, the one that applies to it (mig-parted's rule);
// -1 for none.
func EntryOf(layout config.MigLayout, g gpu.GPU) (int, error) {
	for ei, e := range layout {
		ok, err := entryMatches(e, g)
		if err != nil {
			return -1, fmt.Errorf("%w: %w", ErrLayout, &EntryError{Entry: ei, Field: "device-filter", Err: err})
		}
		if ok {
			return ei, nil
		}
	}
	return -1, nil
}

// FilterNames reports whether e's device-filter names the PCI device id
// id (a GPU model).
func FilterNames(e config.MigDeviceConfig, id uint32) bool {
	for _, f := range e.DeviceFilter {
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(f), "0x"), 16, 32)
		if err == nil && id != 0 && uint32(v) == id {
			return true
		}
	}
	return false
}

func entryMatches(e config.MigDeviceConfig, g gpu.GPU) (bool, error) {
	if !e.Devices.All && !slices.Contains(e.Devices.Indices, g.Index) {
		return false, nil
	}
	if len(e.DeviceFilter) == 0 {
		return true, nil
	}
	id, known := g.PCIDeviceID, g.PCIDeviceID != 0
	for _, f := range e.DeviceFilter {
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(f), "0x"), 16, 32)
		if err != nil {
			return false, fmt.Errorf("device-filter %q: not a hex PCI device id", f)
		}
		if known && uint32(v) == id {
			return true, nil
		}
	}
	return false, nil
}

// wantOf returns nil for a GPU without MIG that the entry wants MIG off on:
// there is nothing to do there, and "all" entries routinely cover such GPUs.
// A GPU whose MIG mode could not be read gets the entry's want either way:
// its false MIGCapable means unknown, not "no MIG", and MakePlan refuses to
// plan from it.
func wantOf(ei int, e config.MigDeviceConfig, g gpu.GPU) (w *Want, field string, err error) {
	noMIG := !g.MIGCapable && !g.Unknown(gpu.FactMIGMode)
	if !e.MigEnabled {
		if noMIG {
			return nil, "", nil
		}
		return &Want{Entry: ei}, "", nil
	}
	if noMIG {
		return nil, "mig-enabled", fmt.Errorf("%s does not support MIG", g.Name)
	}
	w = &Want{MIGEnabled: true, Entry: ei, Counts: map[string]int{}}
	for name, n := range e.MigDevices {
		switch {
		case n < 0:
			return nil, "mig-devices", fmt.Errorf("mig-devices %s: negative count %d", name, n)
		case strings.Contains(name, "c."):
			return nil, "mig-devices", fmt.Errorf("mig-devices %s: compute-instance profiles are not supported, use whole GPU instances", name)
		case n > 0:
			w.Counts[name] = n
		}
	}
	return w, "", nil
}

// EntryError is an error about entry Entry of a layout, at its field Field
// ("device-filter", "mig-enabled", "mig-devices"; "" for the entry), so
// that the caller can name the entry as its author wrote it
// (config.Selected.MIGError).
type EntryError struct {
	Entry int
	Field string
	Err   error
}

func (e *EntryError) Error() string { return fmt.Sprintf("mig layout entry %d: %v", e.Entry, e.Err) }

func (e *EntryError) Unwrap() error { return e.Err }
