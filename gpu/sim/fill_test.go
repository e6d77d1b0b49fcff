package sim

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
)

func TestFillNotSupported(t *testing.T) {
	tests := []struct {
		name string
		fill func() nvml.Return // fills a fresh mock and makes one call
	}{
		{"Interface", func() nvml.Return {
			m := &mock.Interface{}
			FillNotSupported(m)
			_, r := m.DeviceGetCount()
			return r
		}},
		{"Device", func() nvml.Return {
			m := &mock.Device{}
			FillNotSupported(m)
			_, r := m.GetName()
			return r
		}},
		{"Device two Returns", func() nvml.Return {
			m := &mock.Device{}
			FillNotSupported(m)
			a, r := m.SetMigMode(1)
			if a != r {
				return nvml.ERROR_UNKNOWN
			}
			return r
		}},
		{"GpuInstance", func() nvml.Return {
			m := &mock.GpuInstance{}
			FillNotSupported(m)
			_, r := m.GetInfo()
			return r
		}},
		{"ComputeInstance", func() nvml.Return {
			m := &mock.ComputeInstance{}
			FillNotSupported(m)
			return m.Destroy()
		}},
		{"EventSet", func() nvml.Return {
			m := &mock.EventSet{}
			FillNotSupported(m)
			_, r := m.Wait(0)
			return r
		}},
		{"GpmSample", func() nvml.Return {
			m := &mock.GpmSample{}
			FillNotSupported(m)
			return m.Free()
		}},
		{"Unit", func() nvml.Return {
			m := &mock.Unit{}
			FillNotSupported(m)
			_, r := m.GetTemperature(0)
			return r
		}},
		{"VgpuInstance", func() nvml.Return {
			m := &mock.VgpuInstance{}
			FillNotSupported(m)
			_, r := m.GetUUID()
			return r
		}},
		{"VgpuTypeId", func() nvml.Return {
			m := &mock.VgpuTypeId{}
			FillNotSupported(m)
			_, r := m.GetName()
			return r
		}},
	}
	for _, tt := range tests {
		if r := tt.fill(); r != nvml.ERROR_NOT_SUPPORTED {
			t.Errorf("%s: %v, want ERROR_NOT_SUPPORTED", tt.name, r)
		}
	}
}

func TestFillNotSupportedKeepsSetFieldsAndZeroes(t *testing.T) {
	m := &mock.Device{GetNameFunc: func() (string, nvml.Return) { return "kept", nvml.SUCCESS }}
	FillNotSupported(m)
	if name, r := m.GetName(); name != "kept" || r != nvml.SUCCESS {
		t.Errorf("preset GetName replaced: %q %v", name, r)
	}
	if procs, r := m.GetComputeRunningProcesses(); procs != nil || r != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("filled call: %v %v", procs, r)
	}
	iface := &mock.Interface{}
	FillNotSupported(iface)
	if ext := iface.Extensions(); ext != nil { // no Return in results: zero value
		t.Errorf("Extensions() = %v, want nil", ext)
	}
	if s := iface.ErrorString(nvml.SUCCESS); s != "" {
		t.Errorf("ErrorString = %q, want zero value", s)
	}
}

// Other packages build inventories from go-nvml's own DGX A100 mock, which
// leaves most calls nil; filled, it must answer instead of panicking.
func TestFillNotSupportedOnDGXA100Mock(t *testing.T) {
	server := dgxa100.New()
	FillNotSupported(&server.Interface)
	d, r := server.DeviceGetHandleByIndex(0)
	wantRet(t, "DeviceGetHandleByIndex", r, nvml.SUCCESS)
	dev := d.(*dgxa100.Device)
	FillNotSupported(&dev.Device)
	if name, r := d.GetName(); r != nvml.SUCCESS || name == "" {
		t.Errorf("modelled call broken: %q %v", name, r)
	}
	_, r = d.GetTopologyCommonAncestor(d)
	wantRet(t, "unmodelled call", r, nvml.ERROR_NOT_SUPPORTED)
}

func TestFillNotSupportedPanicsOnMisuse(t *testing.T) {
	for _, arg := range []any{nil, mock.Device{}, (*mock.Device)(nil), new(int)} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("FillNotSupported(%T) did not panic", arg)
				}
			}()
			FillNotSupported(arg)
		}()
	}
}
