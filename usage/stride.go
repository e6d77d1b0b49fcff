package usage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Some drivers (the 535 series that came with CUDA 12.2) fill the array of
// nvmlDeviceGetComputeRunningProcesses_v3, and its MPS twin, with a larger
// struct than the header declares: nvmlProcessInfo_v3_t, which has
// usedGpuCcProtectedMemory after the compute instance id, 32 bytes where
// go-nvml's nvml.ProcessInfo has 24. go-nvml (still in v0.13.3-1) reads
// the array at its own stride, so the first process comes back right and
// the others garbled (NVIDIA/go-nvml#75, #21; the PID of the second is
// usually 0). The driver does not overrun go-nvml's array: go-nvml doubles
// the count NVML asked for before its second call, and returns its array
// without copying it, so the bytes at the driver's stride are still there,
// within the returned slice's capacity.
const (
	goStride     = int(unsafe.Sizeof(nvml.ProcessInfo{}))
	driverStride = 32
)

// errGarbled marks a process list whose entries cannot all be true.
var errGarbled = errors.New("process list garbled by a struct size mismatch (go-nvml#75)")

// checkProcesses returns the entries of a running-process list that can be
// true, read again at the driver's stride when go-nvml's read them wrong.
// memBytes is the device's memory (0: unknown); mig says whether it is a
// MIG device, whose processes carry its instance ids, not noInstance.
// The error is errGarbled where only the first entry, always right, is kept.
func checkProcesses(list []nvml.ProcessInfo, memBytes uint64, mig bool) ([]nvml.ProcessInfo, error) {
	if plausible(list, memBytes, mig) {
		return list, nil
	}
	if again, ok := atDriverStride(list); ok && plausible(again, memBytes, mig) {
		return again, nil
	}
	if len(list) > 0 && plausible(list[:1], memBytes, mig) {
		return list[:1], fmt.Errorf("%w: kept the first of %d", errGarbled, len(list))
	}
	return nil, fmt.Errorf("%w: %d entries", errGarbled, len(list))
}

// plausible says whether every entry can be a process on the device: a PID
// other than 0, listed once, holding no more than the device's memory, with
// the instance ids NVML gives such a process (both noInstance on a whole
// GPU, ids below 64 on a MIG device).
func plausible(list []nvml.ProcessInfo, memBytes uint64, mig bool) bool {
	seen := make(map[uint32]bool, len(list))
	for _, p := range list {
		switch {
		case p.Pid == 0 || seen[p.Pid]:
			return false
		case memBytes > 0 && p.UsedGpuMemory > memBytes:
			return false
		case !mig && (p.GpuInstanceId != noInstance || p.ComputeInstanceId != noInstance):
			return false
		case mig && (p.GpuInstanceId >= 64 || p.ComputeInstanceId >= 64):
			return false
		}
		seen[p.Pid] = true
	}
	return true
}

// atDriverStride reads list's backing array as the driver wrote it, at
// driverStride, when the slice's capacity holds that many entries.
func atDriverStride(list []nvml.ProcessInfo) ([]nvml.ProcessInfo, bool) {
	n := len(list)
	if n < 2 {
		return nil, false
	}
	full := list[:cap(list)]
	if (n-1)*driverStride+goStride > len(full)*goStride {
		return nil, false
	}
	raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(full))), len(full)*goStride)
	out := make([]nvml.ProcessInfo, n)
	for i := range out {
		b := raw[i*driverStride:]
		// nvmlProcessInfo_v3_t: pid at 0, usedGpuMemory at 8 (aligned),
		// gpuInstanceId at 16, computeInstanceId at 20.
		out[i] = nvml.ProcessInfo{
			Pid:               binary.NativeEndian.Uint32(b[0:]),
			UsedGpuMemory:     binary.NativeEndian.Uint64(b[8:]),
			GpuInstanceId:     binary.NativeEndian.Uint32(b[16:]),
			ComputeInstanceId: binary.NativeEndian.Uint32(b[20:]),
		}
	}
	return out, true
}
