package usage

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func newSim(tb testing.TB, profile string) (*sim.Node, *clock, *gpu.Inventory) {
	tb.Helper()
	clk := &clock{t: time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)}
	n, err := sim.New(profile, sim.WithClock(clk.now))
	if err != nil {
		tb.Fatal(err)
	}
	n.Init()
	tb.Cleanup(func() { n.Shutdown() })
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	return n, clk, inv
}

func must(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

func byPID(samples []ProcessSample) map[uint32]ProcessSample {
	out := map[uint32]ProcessSample{}
	for _, s := range samples {
		out[s.PID] = s
	}
	return out
}

// TestSampleWholeGPU: the means of the samples since the last pass, with
// memory; a pass with nothing new (NOT_FOUND) has utilization 0 and keeps
// when each process was last active.
func TestSampleWholeGPU(t *testing.T) {
	n, clk, inv := newSim(t, "pcie-8gpu")
	whole := func(p sim.Process) sim.Process { p.GI, p.CI = sim.NoInstance, sim.NoInstance; return p }
	must(t, n.StartProcess(2, whole(sim.Process{PID: 100, MemoryBytes: 1 << 30, SM: 40, Mem: 20, Enc: 4, Dec: 8})))
	must(t, n.StartProcess(2, whole(sim.Process{PID: 101, MemoryBytes: 2 << 30, MPS: true, SM: 10})))
	must(t, n.StartProcess(2, whole(sim.Process{PID: 102, MemoryBytes: 3 << 30})))
	s := NewSampler(n)
	clk.t = clk.t.Add(5 * time.Second)
	got, err := s.Sample(inv)
	must(t, err)
	if len(got) != 3 {
		t.Fatalf("%d samples, want 3: %+v", len(got), got)
	}
	gpuUUID := inv.GPUs[2].UUID
	last := time.UnixMicro(clk.t.UnixMicro() / 1e6 * 1e6)
	want := map[uint32]ProcessSample{
		100: {PID: 100, GPU: gpuUUID, Device: gpuUUID, MemoryBytes: 1 << 30, HasMemory: true, HasUtil: true,
			SM: 40, Mem: 20, Enc: 4, Dec: 8, Samples: 5, LastActive: last},
		101: {PID: 101, GPU: gpuUUID, Device: gpuUUID, MPS: true, MemoryBytes: 2 << 30, HasMemory: true, HasUtil: true,
			SM: 10, Samples: 5, LastActive: last},
		102: {PID: 102, GPU: gpuUUID, Device: gpuUUID, MemoryBytes: 3 << 30, HasMemory: true, HasUtil: true},
	}
	for pid, w := range want {
		g := byPID(got)[pid]
		sameTime := g.LastActive.Equal(w.LastActive)
		g.LastActive, w.LastActive = time.Time{}, time.Time{}
		if !sameTime || g != w {
			t.Errorf("pass 1, PID %d:\n got %+v\nwant %+v", pid, byPID(got)[pid], want[pid])
		}
	}

	// Nothing new: NVML answers NOT_FOUND.
	got, err = s.Sample(inv)
	must(t, err)
	p := byPID(got)[100]
	if !p.HasUtil || p.Samples != 0 || p.SM != 0 || !p.LastActive.Equal(last) {
		t.Errorf("pass 2 (nothing new), PID 100: %+v", p)
	}

	// Only the samples since pass 1 count, with the new load.
	must(t, n.StartProcess(2, whole(sim.Process{PID: 100, MemoryBytes: 1 << 30, SM: 80})))
	clk.t = clk.t.Add(2 * time.Second)
	got, err = s.Sample(inv)
	must(t, err)
	if p := byPID(got)[100]; p.Samples != 2 || p.SM != 80 || p.Mem != 0 {
		t.Errorf("pass 3, PID 100: %+v, want 2 samples at SM 80%%", p)
	}
	if p := byPID(got)[101]; p.Samples != 2 || p.SM != 10 {
		t.Errorf("pass 3, PID 101: %+v, want 2 samples at SM 10%%", p)
	}
}

// TestSamplePIDsComeAndGo: an ended process leaves at the next pass, and a
// new process with its PID does not inherit its past.
func TestSamplePIDsComeAndGo(t *testing.T) {
	n, clk, inv := newSim(t, "pcie-8gpu")
	p := sim.Process{PID: 7, GI: sim.NoInstance, CI: sim.NoInstance, SM: 50}
	must(t, n.StartProcess(0, p))
	s := NewSampler(n)
	clk.t = clk.t.Add(3 * time.Second)
	got, err := s.Sample(inv)
	must(t, err)
	if len(got) != 1 || got[0].LastActive.IsZero() {
		t.Fatalf("pass 1: %+v", got)
	}
	must(t, n.StopProcess(0, 7))
	got, err = s.Sample(inv)
	must(t, err)
	if len(got) != 0 {
		t.Fatalf("after the process ended: %+v", got)
	}
	p.SM = 0
	must(t, n.StartProcess(0, p))
	got, err = s.Sample(inv)
	must(t, err)
	if len(got) != 1 || !got[0].LastActive.IsZero() {
		t.Errorf("an idle process reusing PID 7: %+v, want no last activity", got)
	}
}

// TestSampleMIG: on MIG devices, memory per process and no utilization.
func TestSampleMIG(t *testing.T) {
	n, _, inv := newSim(t, "dgx-h100-mig")
	must(t, n.StartProcess(1, sim.Process{PID: 20, GI: 2, CI: 0, MemoryBytes: 4 << 30}))
	must(t, n.StartProcess(1, sim.Process{PID: 21, GI: 2, CI: 0, MPS: true, MemoryBytes: 1 << 30, SM: 90}))
	must(t, n.StartProcess(1, sim.Process{PID: 22, GI: 5, CI: 0, MemoryBytes: 2 << 30}))
	s := NewSampler(n)
	got, err := s.Sample(inv)
	must(t, err)
	g := inv.GPUs[1]
	devOf := map[int]string{}
	for _, in := range g.Instances {
		devOf[in.GI] = in.UUID
	}
	want := []ProcessSample{
		{PID: 20, GPU: g.UUID, Device: devOf[2], MemoryBytes: 4 << 30, HasMemory: true},
		{PID: 21, GPU: g.UUID, Device: devOf[2], MPS: true, MemoryBytes: 1 << 30, HasMemory: true},
		{PID: 22, GPU: g.UUID, Device: devOf[5], MemoryBytes: 2 << 30, HasMemory: true},
	}
	for _, w := range want {
		if byPID(got)[w.PID] != w {
			t.Errorf("PID %d:\n got %+v\nwant %+v", w.PID, byPID(got)[w.PID], w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d samples, want %d", len(got), len(want))
	}
}

// TestSampleFailures: NOT_SUPPORTED is remembered and no error; another
// failure names the device and leaves the other devices' samples.
func TestSampleFailures(t *testing.T) {
	n, clk, inv := newSim(t, "pcie-8gpu")
	for g := range 2 {
		must(t, n.StartProcess(g, sim.Process{PID: uint32(10 + g), GI: sim.NoInstance, CI: sim.NoInstance, MemoryBytes: 1 << 20, SM: 30}))
	}
	must(t, n.FailCalls(0, "GetProcessUtilization", nvml.ERROR_NOT_SUPPORTED, 1))
	must(t, n.FailCalls(1, "GetComputeRunningProcesses", nvml.ERROR_UNKNOWN, 1))
	s := NewSampler(n)
	clk.t = clk.t.Add(2 * time.Second)
	got, err := s.Sample(inv)
	if err == nil || !strings.Contains(err.Error(), inv.GPUs[1].UUID) || !strings.Contains(err.Error(), "GetComputeRunningProcesses") {
		t.Fatalf("error %v, want GPU 1's list named", err)
	}
	if !errors.Is(err, nvml.ERROR_UNKNOWN) {
		t.Errorf("error %v does not wrap NVML's", err)
	}
	if p := byPID(got)[10]; p.HasUtil || !p.HasMemory {
		t.Errorf("GPU 0 without per-process utilization: %+v", p)
	}
	if p := byPID(got)[11]; !p.HasUtil || p.HasMemory || p.Samples != 2 {
		t.Errorf("GPU 1 with its list failed: %+v, want its utilization alone", p)
	}
	clk.t = clk.t.Add(2 * time.Second)
	got, err = s.Sample(inv)
	must(t, err)
	if p := byPID(got)[10]; p.HasUtil {
		t.Errorf("GPU 0 asked again after NOT_SUPPORTED: %+v", p)
	}
	if p := byPID(got)[11]; !p.HasMemory {
		t.Errorf("GPU 1 on the next pass: %+v", p)
	}
}
