package sim

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
)

// NoInstance in Event.GI or Event.CI marks an event that concerns the whole
// GPU rather than one MIG instance (NVML's 0xFFFFFFFF).
const NoInstance = 0xFFFFFFFF

// xidFallenOffBus is the XID the driver logs when a GPU drops off the bus.
const xidFallenOffBus = 79

// Event is an NVML event to inject on one GPU.
type Event struct {
	GPU  int    // NVML index
	Type uint64 // one nvml.EventType* bit
	Data uint64 // the XID for EventTypeXidCriticalError
	GI   uint32 // GPU instance id, or NoInstance
	CI   uint32 // compute instance id, or NoInstance
}

// InjectXID delivers a GPU-wide XID critical error event on gpu.
func (n *Node) InjectXID(gpu int, xid uint64) error {
	return n.InjectEvent(Event{GPU: gpu, Type: nvml.EventTypeXidCriticalError, Data: xid, GI: NoInstance, CI: NoInstance})
}

// InjectEvent queues e on every event set that registered e.GPU for e.Type.
// The event's Device is the GPU's handle, also for MIG instance events.
func (n *Node) InjectEvent(e Event) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(e.GPU)
	if err != nil {
		return err
	}
	if e.Type == 0 {
		return fmt.Errorf("sim gpu %d (%s): inject event: type is 0", g.index, g.uuid)
	}
	// XID 48 is the driver reporting a double-bit ECC error: the counters
	// move with it, as on hardware (a reset clears the volatile one).
	if e.Type == nvml.EventTypeXidCriticalError && e.Data == 48 {
		err := n.change(g, func() error {
			g.ecc[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.VOLATILE_ECC]++
			g.ecc[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.AGGREGATE_ECC]++
			return nil
		})
		if err != nil {
			// Undelivered: an event whose counters did not move would
			// tell the agent something the state file does not hold.
			return err
		}
	}
	n.deliver(g.index, nvml.EventData{
		Device: g.handle, EventType: e.Type, EventData: e.Data,
		GpuInstanceId: e.GI, ComputeInstanceId: e.CI,
	})
	return nil
}

// SetLost makes every call on the GPU, its MIG devices and instances return
// ERROR_GPU_IS_LOST (lost=false undoes it without a reset). Losing a GPU
// also delivers XID 79 (fallen off the bus), as the driver reports it.
func (n *Node) SetLost(gpu int, lost bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(gpu)
	if err != nil {
		return err
	}
	wasLost := g.lost
	if err := n.change(g, func() error { g.lost = lost; return nil }); err != nil {
		return err
	}
	if lost && !wasLost {
		n.deliver(g.index, nvml.EventData{
			Device: g.handle, EventType: nvml.EventTypeXidCriticalError, EventData: xidFallenOffBus,
			GpuInstanceId: NoInstance, ComputeInstanceId: NoInstance,
		})
	}
	return nil
}

// Reset is a GPU reset: a pending MIG mode becomes current, MIG instances
// are destroyed (they do not survive a reset, so their handles turn
// invalid), the GPU is no longer lost, processes end, utilization and memory
// use drop to zero and volatile ECC counters clear.
func (n *Node) Reset(gpu int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(gpu)
	if err != nil {
		return err
	}
	g.advance(n)
	return n.change(g, func() error { g.reset(); return nil })
}

// reset is what a GPU reset does to g; callers hold n.mu.
func (g *gpuState) reset() {
	g.migCurrent = g.migPending
	g.destroyAll()
	g.lost = false
	g.procs = nil
	g.gpuUtil, g.memUtil, g.memUsed = 0, 0, 0
	g.encUtil, g.decUtil = 0, 0
	g.ecc[nvml.MEMORY_ERROR_TYPE_CORRECTED][nvml.VOLATILE_ECC] = 0
	g.ecc[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.VOLATILE_ECC] = 0
	g.recovery = nvml.GPU_RECOVERY_ACTION_NONE
	// Rows are remapped when the GPU resets; a failed remapping stays.
	g.remapPending = false
}

// Reboot is a reboot of the node: every GPU is reset (see Reset: pending
// MIG modes apply, MIG instances are gone, lost GPUs are back, volatile ECC
// counts, recovery actions and pending row remappings clear), the driver is
// loaded afresh (injected call failures and flakiness end, the energy
// counters start again) and the node gets a new boot id. What persists
// across a reboot on real GPUs stays: MIG modes, aggregate ECC counts,
// remapped rows and failed remappings. A process using the node goes on
// (a real reboot would have ended it); it sees the new boot id.
func (n *Node) Reboot() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	snaps := make([]gpuSnapshot, len(n.gpus))
	for i, g := range n.gpus {
		g.advance(n)
		snaps[i] = g.snapshot()
	}
	oldBoot := n.boot
	for _, g := range n.gpus {
		g.reset()
		g.energyMJ = 0
	}
	n.boot = uuid.NewString()
	if err := n.persist(); err != nil {
		for i, g := range n.gpus {
			g.rollback(snaps[i])
		}
		n.boot = oldBoot
		return fmt.Errorf("sim %s: reboot: %w", n.spec.name, err)
	}
	clear(n.failures)
	n.flakyRate, n.flakyRand = 0, nil
	n.opts.logger.Info("sim: node rebooted", "boot-id", n.boot)
	return nil
}

// BootID identifies the node's current boot, as Linux's
// /proc/sys/kernel/random/boot_id does: Reboot changes it. A node with a
// state file keeps it there; one without starts a new boot with each New,
// as its GPUs start afresh too.
func (n *Node) BootID() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.boot
}

// SetRecoveryAction sets what NVML's FI_DEV_GET_GPU_RECOVERY_ACTION field
// reports for the GPU (drivers set it with the XID that needs it); Reset
// clears it.
func (n *Node) SetRecoveryAction(gpu int, action nvml.DeviceGpuRecoveryAction) error {
	return n.update(gpu, func(g *gpuState) error {
		g.recovery = action
		return nil
	})
}

// update runs set on GPU gpu under the node lock and writes what it
// changed to the state file, if any (see change). The GPU's counters are
// brought up to now first, under the load in force until now.
func (n *Node) update(gpu int, set func(g *gpuState) error) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(gpu)
	if err != nil {
		return err
	}
	g.advance(n)
	return n.change(g, func() error {
		if err := set(g); err != nil {
			return fmt.Errorf("sim gpu %d (%s): %w", g.index, g.uuid, err)
		}
		return nil
	})
}

// SetUtilization sets GetUtilizationRates' percentages (0-100).
func (n *Node) SetUtilization(gpu int, gpuUtil, memUtil uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		if gpuUtil > 100 || memUtil > 100 {
			return fmt.Errorf("utilization %d%%/%d%% above 100%%", gpuUtil, memUtil)
		}
		g.gpuUtil, g.memUtil = gpuUtil, memUtil
		return nil
	})
}

// SetMemoryUsed sets the bytes processes use (GetMemoryInfo_v2's used;
// GetMemoryInfo adds the reserved memory); free follows.
func (n *Node) SetMemoryUsed(gpu int, bytes uint64) error {
	return n.update(gpu, func(g *gpuState) error {
		if usable := n.spec.model.usable(); bytes > usable {
			return fmt.Errorf("memory used %d bytes exceeds the %d not reserved", bytes, usable)
		}
		g.memUsed = bytes
		return nil
	})
}

// SetTemperature sets the GPU temperature in °C.
func (n *Node) SetTemperature(gpu int, celsius uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		if celsius > 200 {
			return fmt.Errorf("temperature %d°C is not plausible", celsius)
		}
		g.tempC = celsius
		return nil
	})
}

// SetPower sets the power draw in milliwatts; the energy counter integrates
// the old value up to now and the new one from now on.
func (n *Node) SetPower(gpu int, milliwatts uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		g.powerMW = milliwatts
		return nil
	})
}

// SetClocks sets the current SM (and graphics) and memory clocks in MHz,
// at most the model's maximum.
func (n *Node) SetClocks(gpu int, smMHz, memMHz uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		m := n.spec.model
		if smMHz > m.maxSMMHz || memMHz > m.maxMemMHz {
			return fmt.Errorf("clocks %d/%d MHz above the maximum %d/%d MHz", smMHz, memMHz, m.maxSMMHz, m.maxMemMHz)
		}
		g.smMHz, g.memMHz = smMHz, memMHz
		return nil
	})
}

// SetECC sets the corrected (single-bit) and uncorrected (double-bit) error
// counts, volatile and aggregate alike; Reset clears only the volatile ones.
func (n *Node) SetECC(gpu int, singleBit, doubleBit uint64) error {
	return n.update(gpu, func(g *gpuState) error {
		for _, c := range []nvml.EccCounterType{nvml.VOLATILE_ECC, nvml.AGGREGATE_ECC} {
			g.ecc[nvml.MEMORY_ERROR_TYPE_CORRECTED][c] = singleBit
			g.ecc[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][c] = doubleBit
		}
		return nil
	})
}

// SetRemappedRows sets what GetRemappedRows reports; GPUs older than Ampere
// do not remap rows and refuse it.
func (n *Node) SetRemappedRows(gpu int, corrected, uncorrected int, pending, failure bool) error {
	return n.update(gpu, func(g *gpuState) error {
		if !n.spec.model.rowRemap {
			return fmt.Errorf("%s does not remap rows", n.spec.model.name)
		}
		if corrected < 0 || uncorrected < 0 {
			return fmt.Errorf("negative remapped rows %d/%d", corrected, uncorrected)
		}
		g.remapCorr, g.remapUnc, g.remapPending, g.remapFailure = corrected, uncorrected, pending, failure
		return nil
	})
}
