package sim

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// The per-process sample buffer. NVML does not say how often the driver
// samples per-process utilization or how many samples it keeps; the sim
// takes one sample per second per busy process and keeps the last minute,
// so an agent scraping every 10 s or 30 s loses none.
const (
	procSamplePeriod = time.Second
	procSampleBuffer = 60
)

// maxProcsPerGPU bounds the processes of one GPU, MIG devices and MPS
// clients included, so that a state file stays within maxStateBytes. MPS
// allows 48 clients per GPU (60 on Volta's successors' newer drivers).
const maxProcsPerGPU = 128

// maxCgroupBytes bounds Process.Cgroup, so that a node full of processes
// still fits its state file: a pod's container under cgroup v2 and the
// systemd driver is "0::/kubepods.slice/kubepods-burstable.slice/
// kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope", 170 bytes
// (16 GPUs of 128 such processes add 420 KB to the file).
const maxCgroupBytes = 200

// Process is a simulated compute process on a GPU or one of its MIG
// devices.
type Process struct {
	PID uint32
	// GI and CI place the process on a MIG device; both are NoInstance
	// on a GPU with MIG off.
	GI, CI uint32
	// MPS: the process is an MPS client. NVML lists it among the MPS
	// compute processes (GetMPSComputeRunningProcesses), not the others.
	MPS bool
	// MemoryBytes is the framebuffer it holds (ProcessInfo.UsedGpuMemory).
	MemoryBytes uint64
	// SM, Mem, Enc and Dec are the utilization (0-100) its samples
	// report: SM, frame-buffer memory, video encoder and decoder. A
	// process at 0 on all four has no samples, as NVML reports only
	// processes busy in a sample period.
	SM, Mem, Enc, Dec uint32
	// Cgroup, when set, is what /proc/<pid>/cgroup would hold for the
	// process ("0::/kubepods.slice/…"): a simulated process with a PID
	// no real process has still names its pod and container this way.
	// Empty: the PID is a real process's (as in e2e, where a workload
	// registers its own PID), to be read from the host's /proc.
	Cgroup string
}

// process is a Process with the time its load took effect: its samples in
// the buffer start there. Guarded by Node.mu.
type process struct {
	nvml.ProcessInfo
	mps               bool
	sm, mem, enc, dec uint32
	cgroup            string
	since             time.Time
}

func (p *process) export() Process {
	return Process{PID: p.Pid, GI: p.GpuInstanceId, CI: p.ComputeInstanceId, MPS: p.mps, MemoryBytes: p.UsedGpuMemory,
		SM: p.sm, Mem: p.mem, Enc: p.enc, Dec: p.dec, Cgroup: p.cgroup}
}

func (p *process) busy() bool { return p.sm|p.mem|p.enc|p.dec != 0 }

// StartProcess starts p on GPU gpu, or replaces the process of that PID on
// it: its placement, memory and load.
func (n *Node) StartProcess(gpu int, p Process) error {
	return n.update(gpu, func(g *gpuState) error { return n.startProcess(g, p) })
}

// startProcess is StartProcess; callers hold n.mu.
func (n *Node) startProcess(g *gpuState, p Process) error {
	procs := slices.Clone(g.procs)
	next := process{ProcessInfo: nvml.ProcessInfo{Pid: p.PID, UsedGpuMemory: p.MemoryBytes,
		GpuInstanceId: p.GI, ComputeInstanceId: p.CI}, mps: p.MPS, sm: p.SM, mem: p.Mem, enc: p.Enc, dec: p.Dec,
		cgroup: p.Cgroup, since: n.opts.now()}
	if i := slices.IndexFunc(procs, func(q process) bool { return q.Pid == p.PID }); i >= 0 {
		if procs[i].export() == p {
			return nil // unchanged: its samples go on
		}
		procs[i] = next
	} else {
		procs = append(procs, next)
	}
	if err := n.checkProcesses(g, procs); err != nil {
		return err
	}
	g.procs = procs
	return nil
}

// StopProcess ends the process pid on GPU gpu; its samples go with it.
func (n *Node) StopProcess(gpu int, pid uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		i := slices.IndexFunc(g.procs, func(q process) bool { return q.Pid == pid })
		if i < 0 {
			return fmt.Errorf("no process %d", pid)
		}
		g.procs = slices.Delete(slices.Clone(g.procs), i, i+1)
		return nil
	})
}

// ProcessCgroup returns the cgroup set for a simulated process (Process.Cgroup)
// on any GPU, and whether one is.
func (n *Node) ProcessCgroup(pid uint32) (string, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, g := range n.gpus {
		for i := range g.procs {
			if p := &g.procs[i]; p.Pid == pid && p.cgroup != "" {
				return p.cgroup, true
			}
		}
	}
	return "", false
}

// Processes returns the processes on GPU gpu, in the order they started.
func (n *Node) Processes(gpu int) ([]Process, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(gpu)
	if err != nil {
		return nil, err
	}
	out := make([]Process, 0, len(g.procs))
	for i := range g.procs {
		out = append(out, g.procs[i].export())
	}
	return out, nil
}

// SetProcesses sets the compute processes on the GPU, with no load. MIG
// processes carry their GpuInstanceId and ComputeInstanceId; whole-GPU ones
// NoInstance.
func (n *Node) SetProcesses(gpu int, procs []nvml.ProcessInfo) error {
	return n.update(gpu, func(g *gpuState) error {
		next := make([]process, 0, len(procs))
		for _, p := range procs {
			next = append(next, process{ProcessInfo: p, since: n.opts.now()})
		}
		if err := n.checkProcesses(g, next); err != nil {
			return err
		}
		g.procs = next
		return nil
	})
}

// checkProcesses says why procs cannot run on g: what neither NVML nor the
// state file can hold. Callers hold n.mu.
func (n *Node) checkProcesses(g *gpuState, procs []process) error {
	if len(procs) > maxProcsPerGPU {
		return fmt.Errorf("%d processes, at most %d per GPU", len(procs), maxProcsPerGPU)
	}
	enc, dec := n.spec.model.codecs()
	seen := make(map[uint32]bool, len(procs))
	var used uint64
	for i := range procs {
		p := &procs[i]
		if err := n.checkProcess(g, p, enc, dec); err != nil {
			return fmt.Errorf("process %d: %w", p.Pid, err)
		}
		if seen[p.Pid] {
			return fmt.Errorf("process %d listed twice", p.Pid)
		}
		seen[p.Pid] = true
		used += p.UsedGpuMemory
	}
	if usable := n.spec.model.usable(); used > usable {
		return fmt.Errorf("processes hold %d bytes, more than the %d not reserved", used, usable)
	}
	return nil
}

func (n *Node) checkProcess(g *gpuState, p *process, enc, dec bool) error {
	switch {
	case p.Pid == 0:
		return errors.New("pid 0")
	case len(p.cgroup) > maxCgroupBytes:
		// The state file holds it, within maxStateBytes.
		return fmt.Errorf("cgroup of %d bytes, more than %d", len(p.cgroup), maxCgroupBytes)
	case p.sm > 100 || p.mem > 100 || p.enc > 100 || p.dec > 100:
		return fmt.Errorf("utilization %d%%/%d%% (encoder %d%%, decoder %d%%) above 100%%", p.sm, p.mem, p.enc, p.dec)
	case p.enc > 0 && !enc:
		return fmt.Errorf("encoder utilization %d%%, but the %s has no encoder", p.enc, n.spec.model.name)
	case p.dec > 0 && !dec:
		return fmt.Errorf("decoder utilization %d%%, but the %s has no decoder", p.dec, n.spec.model.name)
	}
	whole := p.GpuInstanceId == NoInstance && p.ComputeInstanceId == NoInstance
	if whole {
		if g.migCurrent && len(g.gis) > 0 {
			return errors.New("on the whole GPU, but MIG instances exist: give its gi and ci")
		}
		return nil
	}
	if !g.migCurrent {
		return fmt.Errorf("on MIG device %d/%d, but MIG is off", p.GpuInstanceId, p.ComputeInstanceId)
	}
	for _, gi := range g.gis {
		if uint32(gi.id) != p.GpuInstanceId {
			continue
		}
		for _, ci := range gi.cis {
			if uint32(ci.id) == p.ComputeInstanceId {
				if total := gi.prof.memMiB * mib; p.UsedGpuMemory > total {
					return fmt.Errorf("holds %d bytes, more than its GPU instance's %d", p.UsedGpuMemory, total)
				}
				return nil
			}
		}
	}
	return fmt.Errorf("no MIG device %d/%d", p.GpuInstanceId, p.ComputeInstanceId)
}

// runningProcesses lists the processes of the handle, MPS clients or the
// others; callers hold n.mu.
func (d *device) runningProcesses(mps bool) []nvml.ProcessInfo {
	out := []nvml.ProcessInfo{}
	for _, p := range d.g.procs {
		if p.mps != mps {
			continue
		}
		if d.ci == nil || (p.GpuInstanceId == uint32(d.ci.gi.id) && p.ComputeInstanceId == uint32(d.ci.id)) {
			out = append(out, p.ProcessInfo)
		}
	}
	return out
}

// GetComputeRunningProcesses lists the GPU's compute processes but MPS
// clients; a MIG device handle, those of its GPU and compute instance.
func (d *device) GetComputeRunningProcesses() ([]nvml.ProcessInfo, nvml.Return) {
	return get(d, "GetComputeRunningProcesses", true, func() []nvml.ProcessInfo { return d.runningProcesses(false) })
}

// GetMPSComputeRunningProcesses lists the MPS clients, as
// GetComputeRunningProcesses lists the other processes.
func (d *device) GetMPSComputeRunningProcesses() ([]nvml.ProcessInfo, nvml.Return) {
	return get(d, "GetMPSComputeRunningProcesses", true, func() []nvml.ProcessInfo { return d.runningProcesses(true) })
}

// GetProcessUtilization returns the samples of busy processes newer than
// lastSeen (µs of the node's clock; 0: the whole buffer), oldest first, and
// ERROR_NOT_FOUND when there is none, as NVML does. NVML has no
// per-process utilization with MIG on: MIG-enabled GPUs and MIG device
// handles answer NOT_SUPPORTED. An MPS client's samples carry its own PID
// (the sim's choice: NVML does not document which PID it reports).
func (d *device) GetProcessUtilization(lastSeen uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
	r := d.lock("GetProcessUtilization", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	if d.g.migCurrent {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	now := d.n.opts.now().UnixMicro()
	period := procSamplePeriod.Microseconds()
	var out []nvml.ProcessUtilizationSample
	for i := range d.g.procs {
		p := &d.g.procs[i]
		if !p.busy() {
			continue
		}
		from := max(int64(lastSeen), p.since.UnixMicro(), now-procSampleBuffer*period)
		// Samples are taken at whole periods of the clock, after from.
		for t := (from/period + 1) * period; t <= now; t += period {
			out = append(out, nvml.ProcessUtilizationSample{Pid: p.Pid, TimeStamp: uint64(t),
				SmUtil: p.sm, MemUtil: p.mem, EncUtil: p.enc, DecUtil: p.dec})
		}
	}
	if len(out) == 0 {
		return nil, nvml.ERROR_NOT_FOUND
	}
	slices.SortStableFunc(out, func(a, b nvml.ProcessUtilizationSample) int {
		switch {
		case a.TimeStamp < b.TimeStamp:
			return -1
		case a.TimeStamp > b.TimeStamp:
			return 1
		}
		return 0
	})
	return out, nvml.SUCCESS
}
