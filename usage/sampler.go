package usage

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// noInstance is NVML's GPU and compute instance id of a process on a whole
// GPU (0xFFFFFFFF).
const noInstance = 0xFFFFFFFF

// ProcessSample is what NVML says of one process on one device in a pass.
type ProcessSample struct {
	PID uint32
	// GPU is the UUID of the GPU; Device that of the device the process
	// runs on: the GPU, or one of its MIG devices.
	GPU, Device string
	// MPS: NVML listed the process as an MPS client.
	MPS bool
	// MemoryBytes is the framebuffer the process holds. HasMemory is false
	// for a process that had utilization samples but was in neither list
	// (a graphics process, or one that ended between the two calls).
	MemoryBytes uint64
	HasMemory   bool
	// HasUtil says whether NVML reports per-process utilization for the
	// device: not on MIG, not where it answers NOT_SUPPORTED. Then SM,
	// Mem, Enc and Dec are the means (%) of the process's samples taken
	// since the last pass (in a first pass, of all the driver keeps),
	// Samples their count: 0 for a process idle all along, as NVML leaves
	// idle periods out.
	HasUtil           bool
	SM, Mem, Enc, Dec float64
	Samples           int
	// LastActive is the time of the newest sample of the process on this
	// device seen by this Sampler, in this pass or an earlier one; zero if
	// none. It is kept while the process stays on the device.
	LastActive time.Time
}

// handles is what the Sampler needs of NVML: nvml.Interface has it.
type handles interface {
	DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return)
}

// Sampler reads the processes of each GPU and MIG device through NVML. It
// carries the newest sample timestamp of each GPU between passes, so each
// pass reads only new samples, and remembers the calls a device answered
// NOT_SUPPORTED until its MIG layout changes. Not safe for concurrent use:
// one goroutine samples.
type Sampler struct {
	lib  handles
	devs map[string]*deviceState // by device UUID
}

// deviceState is what a Sampler keeps of one GPU or MIG device.
type deviceState struct {
	dev    nvml.Device
	layout string
	// lastSeen is the newest sample timestamp read (µs of the driver's
	// clock); 0 asks NVML for its whole buffer.
	lastSeen    uint64
	unsupported calls
	// active is the newest sample of each PID seen on the device, for
	// ProcessSample.LastActive; PIDs gone from the device are dropped.
	active map[uint32]uint64
	seen   bool // in this pass
}

// calls are the NVML calls a device answered NOT_SUPPORTED, as bits.
type calls uint8

const (
	callUtil calls = 1 << iota
	callCompute
	callMPS
)

// NewSampler returns a Sampler reading through lib (initialised).
func NewSampler(lib handles) *Sampler {
	return &Sampler{lib: lib, devs: map[string]*deviceState{}}
}

// Sample reads every GPU and MIG device of inv and returns their processes,
// by GPU, device and PID. A device NVML fails on is left out and named in
// the error, which joins them all; the others are still returned.
func (s *Sampler) Sample(inv *gpu.Inventory) ([]ProcessSample, error) {
	for _, st := range s.devs {
		st.seen = false
	}
	var out []ProcessSample
	var errs []error
	for _, g := range inv.GPUs {
		layout := layoutKey(g)
		if !g.MIG.Current {
			samples, err := s.device(g.UUID, g.UUID, layout, g.MemoryBytes, false)
			out = append(out, samples...)
			errs = append(errs, err)
			continue
		}
		for _, in := range g.Instances {
			samples, err := s.device(g.UUID, in.UUID, layout, in.MemoryBytes, true)
			out = append(out, samples...)
			errs = append(errs, err)
		}
	}
	for uuid, st := range s.devs {
		if !st.seen {
			delete(s.devs, uuid) // gone from the inventory, MIG devices destroyed with it
		}
	}
	slices.SortFunc(out, func(a, b ProcessSample) int {
		return cmp.Or(cmp.Compare(a.GPU, b.GPU), cmp.Compare(a.Device, b.Device), cmp.Compare(a.PID, b.PID))
	})
	return out, errors.Join(errs...)
}

// layoutKey changes when a GPU's MIG mode or devices change, which changes
// what NVML supports on it.
func layoutKey(g gpu.GPU) string {
	k := fmt.Sprint(g.MIG.Current)
	for _, in := range g.Instances {
		k += "," + in.UUID
	}
	return k
}

// device samples one GPU or MIG device; NVML has per-process utilization
// only for the first.
func (s *Sampler) device(gpuUUID, uuid, layout string, memBytes uint64, mig bool) ([]ProcessSample, error) {
	st := s.devs[uuid]
	if st == nil || st.layout != layout {
		st = &deviceState{layout: layout, active: map[uint32]uint64{}}
		s.devs[uuid] = st
	}
	st.seen = true
	if st.dev == nil {
		dev, ret := s.lib.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("device %s: handle: %w", uuid, ret)
		}
		st.dev = dev
	}
	procs := map[uint32]*ProcessSample{}
	var errs []error
	for _, l := range [...]struct {
		bit  calls
		mps  bool
		name string
		get  func() ([]nvml.ProcessInfo, nvml.Return)
	}{
		{callCompute, false, "GetComputeRunningProcesses", st.dev.GetComputeRunningProcesses},
		{callMPS, true, "GetMPSComputeRunningProcesses", st.dev.GetMPSComputeRunningProcesses},
	} {
		if st.unsupported&l.bit != 0 {
			continue
		}
		list, ret := l.get()
		if err := s.failed(st, l.bit, ret); err != nil {
			errs = append(errs, fmt.Errorf("device %s: %s: %w", uuid, l.name, err))
			continue
		}
		list, err := checkProcesses(list, memBytes, mig)
		if err != nil {
			errs = append(errs, fmt.Errorf("device %s: %s: %w", uuid, l.name, err))
		}
		for _, p := range list {
			ps := procs[p.Pid]
			if ps == nil {
				ps = &ProcessSample{PID: p.Pid, GPU: gpuUUID, Device: uuid}
				procs[p.Pid] = ps
			}
			// A PID in both lists is counted once, with the larger
			// figure: nvml.h does not say how the two relate.
			ps.MPS = ps.MPS || l.mps
			ps.MemoryBytes, ps.HasMemory = max(ps.MemoryBytes, p.UsedGpuMemory), true
		}
	}
	hasUtil := false
	if !mig && st.unsupported&callUtil == 0 {
		samples, ret := st.dev.GetProcessUtilization(st.lastSeen)
		switch {
		case ret == nvml.ERROR_NOT_FOUND:
			hasUtil = true // nothing new: every process idle since the last pass
		case ret == nvml.SUCCESS:
			hasUtil = true
			s.addUtil(st, procs, samples, gpuUUID, uuid)
		default:
			if err := s.failed(st, callUtil, ret); err != nil {
				errs = append(errs, fmt.Errorf("device %s: GetProcessUtilization: %w", uuid, err))
			}
		}
	}
	out := make([]ProcessSample, 0, len(procs))
	for pid, ps := range procs {
		ps.HasUtil = hasUtil
		if ps.Samples > 0 {
			n := float64(ps.Samples)
			ps.SM, ps.Mem, ps.Enc, ps.Dec = ps.SM/n, ps.Mem/n, ps.Enc/n, ps.Dec/n
		}
		if t, ok := st.active[pid]; ok {
			ps.LastActive = time.UnixMicro(int64(t))
		}
		out = append(out, *ps)
	}
	for pid := range st.active {
		if procs[pid] == nil {
			delete(st.active, pid) // ended, or its PID now another's
		}
	}
	return out, errors.Join(errs...)
}

// addUtil sums the samples newer than the device's last pass into procs
// (means are taken by the caller) and moves lastSeen to the newest.
func (s *Sampler) addUtil(st *deviceState, procs map[uint32]*ProcessSample, samples []nvml.ProcessUtilizationSample, gpuUUID, uuid string) {
	newest := st.lastSeen
	for _, x := range samples {
		// NVML returns only newer samples; a driver that does not is
		// not allowed to count one twice.
		if x.TimeStamp <= st.lastSeen || x.Pid == 0 {
			continue
		}
		ps := procs[x.Pid]
		if ps == nil {
			ps = &ProcessSample{PID: x.Pid, GPU: gpuUUID, Device: uuid}
			procs[x.Pid] = ps
		}
		ps.Samples++
		ps.SM += float64(x.SmUtil)
		ps.Mem += float64(x.MemUtil)
		ps.Enc += float64(x.EncUtil)
		ps.Dec += float64(x.DecUtil)
		newest = max(newest, x.TimeStamp)
		st.active[x.Pid] = max(st.active[x.Pid], x.TimeStamp)
	}
	st.lastSeen = newest
}

// failed turns an NVML return into the pass's error: none for success, and
// none for NOT_SUPPORTED, which is remembered so the call is not repeated.
// A lost GPU or stale handle drops the handle, to be looked up again.
func (s *Sampler) failed(st *deviceState, bit calls, ret nvml.Return) error {
	switch ret {
	case nvml.SUCCESS:
		return nil
	case nvml.ERROR_NOT_SUPPORTED:
		st.unsupported |= bit
		return nil
	case nvml.ERROR_GPU_IS_LOST, nvml.ERROR_INVALID_ARGUMENT:
		st.dev = nil
	}
	return ret
}
