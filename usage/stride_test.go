package usage

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// driverWritten returns what go-nvml v0.13.3-1 hands back from a driver
// that writes nvmlProcessInfo_v3_t (32 bytes, with a protected-memory
// count) into its array of 24-byte entries: an array of twice the count,
// sliced to the count.
func driverWritten(procs []nvml.ProcessInfo, capacity int) []nvml.ProcessInfo {
	buf := make([]nvml.ProcessInfo, capacity)
	raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(buf))), len(buf)*goStride)
	for i, p := range procs {
		b := raw[i*driverStride:]
		binary.NativeEndian.PutUint32(b[0:], p.Pid)
		binary.NativeEndian.PutUint64(b[8:], p.UsedGpuMemory)
		binary.NativeEndian.PutUint32(b[16:], p.GpuInstanceId)
		binary.NativeEndian.PutUint32(b[20:], p.ComputeInstanceId)
		binary.NativeEndian.PutUint64(b[24:], 0) // usedGpuCcProtectedMemory
	}
	return buf[:len(procs)]
}

func TestCheckProcesses(t *testing.T) {
	whole := []nvml.ProcessInfo{
		{Pid: 4100, UsedGpuMemory: 3 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
		{Pid: 4200, UsedGpuMemory: 5 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
		{Pid: 4300, UsedGpuMemory: 7 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
	}
	mig := []nvml.ProcessInfo{
		{Pid: 4100, UsedGpuMemory: 1 << 30, GpuInstanceId: 3, ComputeInstanceId: 0},
		{Pid: 4200, UsedGpuMemory: 2 << 30, GpuInstanceId: 3, ComputeInstanceId: 0},
	}
	const mem = 80 << 30
	tests := []struct {
		name    string
		list    []nvml.ProcessInfo
		mig     bool
		want    []nvml.ProcessInfo
		garbled bool
	}{
		{"well formed", whole, false, whole, false},
		{"well formed, MIG", mig, true, mig, false},
		{"empty", nil, false, nil, false},
		{"one process, right at any stride", driverWritten(whole[:1], 2), false, whole[:1], false},
		{"driver stride, go-nvml's array", driverWritten(whole, 6), false, whole, false},
		{"driver stride, MIG", driverWritten(mig, 4), true, mig, false},
		// A slice capped at its length (as a copy would be) leaves no
		// bytes to read again: only the first entry can be trusted.
		{"driver stride, no room to read again", slices.Clip(driverWritten(whole, 6)), false, whole[:1], true},
		{"pid 0", []nvml.ProcessInfo{whole[0], {GpuInstanceId: noInstance, ComputeInstanceId: noInstance}}, false, whole[:1], true},
		{"pid twice", []nvml.ProcessInfo{whole[0], whole[0]}, false, whole[:1], true},
		{"more memory than the device", []nvml.ProcessInfo{whole[0], {Pid: 9, UsedGpuMemory: mem + 1, GpuInstanceId: noInstance, ComputeInstanceId: noInstance}}, false, whole[:1], true},
		{"MIG ids on a whole GPU", mig, false, nil, true},
		{"whole GPU ids on a MIG device", whole, true, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := checkProcesses(tt.list, mem, tt.mig)
			if !slices.Equal(got, tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			if errors.Is(err, errGarbled) != tt.garbled {
				t.Errorf("error %v, garbled %v", err, tt.garbled)
			}
		})
	}
}

// TestSampleGarbledList: the Sampler reads go-nvml's garbled answer right,
// through the same nvml.Device interface a real driver's handle has.
func TestSampleGarbledList(t *testing.T) {
	procs := []nvml.ProcessInfo{
		{Pid: 31, UsedGpuMemory: 1 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
		{Pid: 32, UsedGpuMemory: 2 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
		{Pid: 33, UsedGpuMemory: 3 << 30, GpuInstanceId: noInstance, ComputeInstanceId: noInstance},
	}
	dev := &mock.Device{
		GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
			return driverWritten(procs, 2*len(procs)), nvml.SUCCESS
		},
		GetMPSComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS },
		GetProcessUtilizationFunc: func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			return nil, nvml.ERROR_NOT_FOUND
		},
	}
	lib := &mock.Interface{DeviceGetHandleByUUIDFunc: func(string) (nvml.Device, nvml.Return) { return dev, nvml.SUCCESS }}
	inv := &gpu.Inventory{GPUs: []gpu.GPU{{UUID: "GPU-a", MemoryBytes: 16 << 30}}}
	got, err := NewSampler(lib).Sample(inv)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("%d processes, want 3: %+v", len(got), got)
	}
	for i, p := range got {
		if p.PID != procs[i].Pid || p.MemoryBytes != procs[i].UsedGpuMemory {
			t.Errorf("process %d: %+v, want %+v", i, p, procs[i])
		}
	}
}
