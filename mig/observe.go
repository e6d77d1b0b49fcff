package mig

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Observer reads what MIG planning starts from: the inventory, and each GPU
// model's profiles and placements. It is the agent's only way to read the
// GPUs, so the loop and the planner never call NVML themselves.
type Observer struct {
	lib  nvml.Interface
	opts gpu.Options
}

// NewObserver reads through lib (initialised).
func NewObserver(lib nvml.Interface, opts gpu.Options) *Observer {
	return &Observer{lib: lib, opts: opts}
}

// Inventory takes a new snapshot of the GPUs.
func (o *Observer) Inventory() (*gpu.Inventory, error) { return gpu.New(o.lib, o.opts) }

// MIGProfiles queries g's GPU instance profiles and their placements.
func (o *Observer) MIGProfiles(g gpu.GPU) (Profiles, error) {
	dev, ret := o.lib.DeviceGetHandleByIndex(g.Index)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu %d (%s): DeviceGetHandleByIndex: %w", g.Index, g.UUID, ret)
	}
	if uuid, ret := dev.GetUUID(); ret != nvml.SUCCESS || uuid != g.UUID {
		// Indices move when a GPU falls off the bus: never read another
		// GPU's profiles under this one's name.
		return nil, fmt.Errorf("gpu %d (%s): index now answers as %q (%v)", g.Index, g.UUID, uuid, ret)
	}
	p, err := QueryProfiles(dev, g.MemoryBytes)
	if err != nil {
		return nil, fmt.Errorf("gpu %d (%s): %w", g.Index, g.UUID, err)
	}
	return p, nil
}
