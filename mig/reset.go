package mig

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// Process is a process NVML lists on a GPU or on one of its MIG devices.
type Process struct {
	PID uint32
	// Device is the UUID of the GPU or MIG device it runs on.
	Device string
}

func (p Process) String() string { return fmt.Sprintf("process %d on %s", p.PID, p.Device) }

// ResetFunc resets one GPU: on a real node nvidia-smi (SMIReset), on a
// simulated one the sim's Reset.
type ResetFunc func(ctx context.Context, g gpu.GPU) error

// Resetter resets GPUs whose MIG mode change waits for a reset, and lists
// the processes that must be gone first. NVML has no call that resets a
// GPU (nvmlDeviceResetGpu is not in its API, nor in go-nvml), so the reset
// itself is a ResetFunc.
type Resetter struct {
	lib   nvml.Interface
	reset ResetFunc
}

// NewResetter returns a Resetter that reads processes through lib and
// resets through reset.
func NewResetter(lib nvml.Interface, reset ResetFunc) *Resetter {
	return &Resetter{lib: lib, reset: reset}
}

// Processes lists the compute and graphics processes on the GPU uuid and
// on each of its MIG devices. A reset ends every one of them: the caller
// resets only a GPU with none. A list NVML does not support on this GPU
// (ERROR_NOT_SUPPORTED) counts as empty; any other failure is an error,
// since an unread list may hide a process.
func (r *Resetter) Processes(uuid string) ([]Process, error) {
	dev, ret := r.lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu %s: DeviceGetHandleByUUID: %w", uuid, ret)
	}
	out, err := processesOf(dev, uuid)
	if err != nil {
		return nil, err
	}
	current, _, ret := dev.GetMigMode()
	switch {
	case ret == nvml.ERROR_NOT_SUPPORTED:
		return out, nil
	case ret != nvml.SUCCESS:
		return nil, fmt.Errorf("gpu %s: GetMigMode: %w", uuid, ret)
	case current != nvml.DEVICE_MIG_ENABLE:
		return out, nil
	}
	n, ret := dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu %s: GetMaxMigDeviceCount: %w", uuid, ret)
	}
	for i := range n {
		m, ret := dev.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("gpu %s: MIG device %d: %w", uuid, i, ret)
		}
		mu, ret := m.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("gpu %s: MIG device %d: GetUUID: %w", uuid, i, ret)
		}
		ps, err := processesOf(m, mu)
		if err != nil {
			return nil, err
		}
		out = append(out, ps...)
	}
	return out, nil
}

func processesOf(dev nvml.Device, uuid string) ([]Process, error) {
	var out []Process
	seen := map[uint32]bool{}
	for _, list := range []struct {
		name string
		get  func() ([]nvml.ProcessInfo, nvml.Return)
	}{
		{"GetComputeRunningProcesses", dev.GetComputeRunningProcesses},
		{"GetGraphicsRunningProcesses", dev.GetGraphicsRunningProcesses},
	} {
		ps, ret := list.get()
		if ret == nvml.ERROR_NOT_SUPPORTED {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("%s: %s: %w", uuid, list.name, ret)
		}
		for _, p := range ps {
			if !seen[p.Pid] {
				seen[p.Pid] = true
				out = append(out, Process{PID: p.Pid, Device: uuid})
			}
		}
	}
	return out, nil
}

// Reset resets g, after checking once more that no process runs on it:
// the caller's check and this call are apart by a catalog publish.
func (r *Resetter) Reset(ctx context.Context, g gpu.GPU) error {
	if r.reset == nil {
		return fmt.Errorf("gpu %d (%s): no way to reset a GPU in this agent", g.Index, g.UUID)
	}
	ps, err := r.Processes(g.UUID)
	if err != nil {
		return fmt.Errorf("gpu %d: %w", g.Index, err)
	}
	if len(ps) > 0 {
		return fmt.Errorf("gpu %d (%s): not reset: %w", g.Index, g.UUID, ProcessesError(ps))
	}
	if err := r.reset(ctx, g); err != nil {
		return fmt.Errorf("gpu %d (%s): reset: %w", g.Index, g.UUID, err)
	}
	return nil
}

// ProcessesError names the processes that keep a GPU from a reset.
func ProcessesError(ps []Process) error {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.String()
	}
	return errors.New(strings.Join(names, ", ") + " would end")
}

// SMIReset resets a GPU as NVIDIA's mig-manager does on a node whose
// driver is loaded: `nvidia-smi -r -i <PCI bus id>` (the UUID where the
// bus id is not known). It needs nvidia-smi in the agent's image or on a
// host path mounted into it, /dev/nvidiactl and the GPU's /dev/nvidiaN,
// and root (CAP_SYS_ADMIN): the chart's container is privileged.
// nvidia-smi refuses while any process has the GPU open, and on NVSwitch
// systems the fabric manager must be running.
func SMIReset(binary string) ResetFunc {
	return func(ctx context.Context, g gpu.GPU) error {
		id := g.PCIBusID
		if id == "" {
			id = g.UUID
		}
		out, err := exec.CommandContext(ctx, binary, "-r", "-i", id).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s -r -i %s: %w: %s", binary, id, err, strings.TrimSpace(string(out)))
		}
		return nil
	}
}
