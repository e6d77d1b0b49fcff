package mig

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// failingLib makes chosen GPU instance calls of the applier fail: fail is
// asked for each call, by name, and answers the error to return instead of
// running it (SUCCESS: run).
type failingLib struct {
	Library
	fail func(call string) nvml.Return
}

func (l *failingLib) DeviceGetHandleByIndex(i int) (nvml.Device, nvml.Return) {
	d, ret := l.Library.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		return d, ret
	}
	return &failingDevice{Device: d, l: l}, ret
}

type failingDevice struct {
	nvml.Device
	l *failingLib
}

func (d *failingDevice) CreateGpuInstanceWithPlacement(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	gi, ret := d.Device.CreateGpuInstanceWithPlacement(info, pl)
	if ret != nvml.SUCCESS {
		return gi, ret
	}
	return &failingGI{GpuInstance: gi, l: d.l}, ret
}

type failingGI struct {
	nvml.GpuInstance
	l *failingLib
}

func (gi *failingGI) GetComputeInstanceProfileInfo(p, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	if r := gi.l.fail("GetComputeInstanceProfileInfo"); r != nvml.SUCCESS {
		return nvml.ComputeInstanceProfileInfo{}, r
	}
	return gi.GpuInstance.GetComputeInstanceProfileInfo(p, eng)
}

func (gi *failingGI) GetComputeInstances(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
	if r := gi.l.fail("GetComputeInstances"); r != nvml.SUCCESS {
		return nil, r
	}
	return gi.GpuInstance.GetComputeInstances(info)
}

// nth fails the n-th call (from 1) named call with ret.
func nth(call string, n int, ret nvml.Return) func(string) nvml.Return {
	seen := 0
	return func(c string) nvml.Return {
		if c != call {
			return nvml.SUCCESS
		}
		seen++
		if seen == n {
			return ret
		}
		return nvml.SUCCESS
	}
}

// TestCreateFailureIsNotAnAnswer: one failed NVML read while a create
// makes its compute instance fails the step with that error, and leaves no
// GPU instance without a compute instance behind.
func TestCreateFailureIsNotAnAnswer(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(string) nvml.Return
	}{
		// Right after the GPU instance is made, listing its compute
		// instances fails: whether it has one is unknown.
		{"listing compute instances", nth("GetComputeInstances", 1, nvml.ERROR_UNKNOWN)},
		// Listing them succeeds; then the one profile that spans the GPU
		// instance cannot be described. It is not "no profile spans it".
		{"describing the spanning profile", nth("GetComputeInstanceProfileInfo", nvml.COMPUTE_INSTANCE_PROFILE_COUNT+1, nvml.ERROR_UNKNOWN)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			p, _, err := MakePlan(r.gpu(0), r.profiles(0), want("1x1g.5gb"), nil)
			if err != nil {
				t.Fatal(err)
			}
			ap := NewApplier(&failingLib{Library: r.node, fail: tc.fail}, r.dir, slog.New(slog.DiscardHandler))
			st, err := ap.Apply(context.Background(), p, nil)
			if !errors.Is(err, nvml.ERROR_UNKNOWN) || st.Phase != PhaseFailed {
				t.Fatalf("apply: %+v %v, want the NVML failure", st, err)
			}
			if !strings.Contains(err.Error(), p.UUID) {
				t.Errorf("error %q does not name the GPU", err)
			}
			if bare := r.bareGIs(0); len(bare) > 0 {
				t.Fatalf("left %v", bare)
			}
			// The next pass, NVML answering again, gets there.
			if _, st := r.converge(0, want("1x1g.5gb"), nil); st.Phase != PhaseApplied {
				t.Fatalf("%+v", st)
			}
		})
	}
}
