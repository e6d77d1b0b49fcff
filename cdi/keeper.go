package cdi

import (
	"errors"
	"sync"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Keeper keeps the node spec in step with the inventory. Caps is resolved
// on first need: a node without MIG devices never reads the driver's table.
type Keeper struct {
	W *Writer
	// DevRoot: see Host.
	DevRoot string
	// Caps returns the MIG capability table; a failure is retried at the next
	// sync. nil: the driver's numbering, for simulated nodes, which have no
	// table.
	Caps func() (CapMinors, error)
	// Exists: see Host.
	Exists func(path string) bool

	mu   sync.Mutex
	caps CapMinors
}

// Sync writes the spec of inv when want is set and removes it otherwise. It
// reports whether the file changed and how many CDI devices the spec names.
func (k *Keeper) Sync(inv *gpu.Inventory, want bool) (changed bool, devices int, err error) {
	if !want {
		changed, err = k.W.Write(NodeSpec, nil)
		return changed, 0, err
	}
	h := Host{DevRoot: k.DevRoot, Exists: k.Exists}
	var capsErr error
	if hasMIGDevices(inv) {
		h.Caps, capsErr = k.capMinors()
	}
	// A spec of what could be described is written even when some MIG
	// device could not: the error names what is missing.
	s, buildErr := Build(inv, h)
	if s != nil {
		devices = len(s.Devices)
	}
	changed, err = k.W.Write(NodeSpec, s)
	return changed, devices, errors.Join(capsErr, buildErr, err)
}

// Path is the node spec's file.
func (k *Keeper) Path() string { return k.W.Path(NodeSpec) }

func (k *Keeper) capMinors() (CapMinors, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.caps != nil {
		return k.caps, nil
	}
	if k.Caps == nil {
		return DriverNumbering{}, nil
	}
	c, err := k.Caps()
	if err != nil {
		return nil, err
	}
	k.caps = c
	return c, nil
}

func hasMIGDevices(inv *gpu.Inventory) bool {
	if inv == nil {
		return false
	}
	for _, g := range inv.GPUs {
		if g.MIG.Current && len(g.Instances) > 0 {
			return true
		}
	}
	return false
}
