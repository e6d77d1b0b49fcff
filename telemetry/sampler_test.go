package telemetry

import (
	"context"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// series gathers the collector's DCGM series of GPU gpu: the whole GPU's
// by name, and its MIG instances' by name and GPU_I_ID.
func series(t *testing.T, c prometheus.Collector, gpu string) (whole map[string]float64, inst map[string]map[string]float64) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	whole, inst = map[string]float64{}, map[string]map[string]float64{}
	for _, f := range fams {
		if !strings.HasPrefix(f.GetName(), "DCGM_") {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["gpu"] != gpu {
				continue
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			if gi := l["GPU_I_ID"]; gi != "" {
				if inst[f.GetName()] == nil {
					inst[f.GetName()] = map[string]float64{}
				}
				inst[f.GetName()][gi] = v
			} else {
				whole[f.GetName()] = v
			}
		}
	}
	return whole, inst
}

// The dcgm-exporter series by group, for the table below.
var (
	seriesBase = []string{"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
		"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED",
		"DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
		"DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_XID_ERRORS"}
	seriesUtil  = []string{"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL"}
	seriesRemap = []string{"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
		"DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_PENDING"}
	seriesHBM    = []string{"DCGM_FI_DEV_MEMORY_TEMP"}
	seriesNVLink = []string{"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"}
	seriesEnc    = []string{"DCGM_FI_DEV_ENC_UTIL"}
	seriesDec    = []string{"DCGM_FI_DEV_DEC_UTIL"}
	// seriesProfMIG are the profiling series GPM gives per GPU instance too.
	seriesProfMIG = []string{"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY",
		"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
		"DCGM_FI_PROF_PIPE_FP32_ACTIVE", "DCGM_FI_PROF_PIPE_FP16_ACTIVE"}
	seriesProfGPU = []string{"DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
		"DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES"}
	seriesMIGFB = []string{"DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED"}
)

func join(groups ...[]string) []string {
	var out []string
	for _, g := range groups {
		out = append(out, g...)
	}
	slices.Sort(out)
	return out
}

func without(all []string, drop ...[]string) []string {
	d := join(drop...)
	return slices.DeleteFunc(slices.Clone(all), func(s string) bool { return slices.Contains(d, s) })
}

// TestSeriesPerModel pins which dcgm-exporter series each simulated model
// serves for a loaded GPU: every other one must be absent, not 0.
func TestSeriesPerModel(t *testing.T) {
	tests := []struct {
		name    string
		profile string
		opts    []sim.Option
		migs    int // 1g instances created per GPU
		whole   []string
		inst    []string // series of each MIG instance
	}{
		{name: "H100: GPM, HBM, NVLink, NVDEC without NVENC", profile: "dgx-h100",
			whole: join(seriesBase, seriesUtil, seriesRemap, seriesHBM, seriesNVLink, seriesDec, seriesProfMIG, seriesProfGPU)},
		{name: "A100: no GPM, so no profiling series", profile: "dgx-a100",
			whole: join(seriesBase, seriesUtil, seriesRemap, seriesHBM, seriesNVLink, seriesDec)},
		{name: "V100: no GPM, no row remapping", profile: "dgx1-v100",
			whole: join(seriesBase, seriesUtil, seriesHBM, seriesNVLink, seriesEnc, seriesDec)},
		{name: "L40S: GDDR (no memory temperature), no NVLink", profile: "pcie-4gpu",
			whole: join(seriesBase, seriesUtil, seriesRemap, seriesEnc, seriesDec)},
		{name: "H100 MIG: profiling per GPU and per instance", profile: "dgx-h100-mig",
			whole: join(seriesBase, seriesHBM, seriesNVLink, seriesProfMIG, seriesProfGPU),
			inst:  join(seriesMIGFB, seriesProfMIG)},
		{name: "A100 MIG: no utilization at all (no GPM, NVML refuses it)", profile: "dgx-a100", opts: []sim.Option{sim.WithMIGEnabled()}, migs: 2,
			whole: join(seriesBase, seriesHBM, seriesNVLink),
			inst:  seriesMIGFB},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := simtest.NewClock()
			n := simtest.Node(t, tt.profile, append(tt.opts, sim.WithClock(clk.Now))...)
			if tt.migs > 0 {
				simtest.CreateMIG(t, n, tt.migs)
			}
			must(t, n.SetUtilization(0, 60, 30))
			must(t, n.SetCodecUtilization(0, 5, 7))
			inv := simtest.Inventory(t, n)
			for _, in := range inv.GPUs[0].Instances {
				must(t, n.SetInstanceUtilization(0, in.GI, 40, 20))
			}
			s := newSampler(n, clk)
			s.SetInventory(inv)
			s.Sample()
			whole, inst := series(t, NewCollector(CollectorOptions{Samples: s}), "0")
			if got := slices.Sorted(maps.Keys(whole)); !slices.Equal(got, tt.whole) {
				t.Errorf("whole GPU series:\n got %v\nwant %v\n missing %v\n extra %v", got, tt.whole, without(tt.whole, got), without(got, tt.whole))
			}
			if got := slices.Sorted(maps.Keys(inst)); !slices.Equal(got, tt.inst) {
				t.Errorf("MIG instance series:\n got %v\nwant %v", got, tt.inst)
			}
			for name, byGI := range inst {
				if len(byGI) != len(inv.GPUs[0].Instances) {
					t.Errorf("%s: series for instances %v, want one per instance (%d)", name, slices.Sorted(maps.Keys(byGI)), len(inv.GPUs[0].Instances))
				}
			}
			if v, ok := inst["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]; ok {
				for gi, x := range v {
					if !near(x, 0.4) {
						t.Errorf("GPU instance %s engine activity %v, want 0.4", gi, x)
					}
				}
			}
		})
	}
}

func near(got, want float64) bool {
	return math.Abs(got-want) <= 1e-9*math.Max(1, math.Abs(want))
}

// TestGPMMetricMath checks what GPM reports against the load the GPU ran:
// ratios from percentages, bytes/s from MiB/s, averaged over the time
// between two passes, and the NVLink counter integrating the same load.
func TestGPMMetricMath(t *testing.T) {
	clk := simtest.NewClock()
	n := simtest.Node(t, "dgx-h100", sim.WithClock(clk.Now))
	must(t, n.SetUtilization(0, 80, 40))
	s := newSampler(n, clk)
	s.SetInventory(simtest.Inventory(t, n))
	s.Sample() // t0: first sample, then the second gpmFirstGap later

	// The load model's mix (gpu/sim/telemetry.go) at utilization u, memory
	// utilization m: engine u, SMs 0.85u, occupancy 0.4u, tensor 0.55u,
	// DRAM m, FP64/32/16 0.02u/0.25u/0.1u, PCIe 2 GiB/s out and 6 GiB/s in
	// at u=1, NVLink 30% of 18 lanes × 25 GB/s each way.
	want := func(u, m float64) map[Field]float64 {
		return map[Field]float64{
			FieldGrEngineActive: u, FieldSMActive: 0.85 * u, FieldSMOccupancy: 0.4 * u, FieldTensorActive: 0.55 * u,
			FieldDRAMActive: m, FieldFP64Active: 0.02 * u, FieldFP32Active: 0.25 * u, FieldFP16Active: 0.1 * u,
			FieldPCIeTxBytes: 2 * (1 << 30) * u, FieldPCIeRxBytes: 6 * (1 << 30) * u,
			FieldNVLinkTxBytes: 0.3 * 18 * 25e9 * u, FieldNVLinkRxBytes: 0.3 * 18 * 25e9 * u,
		}
	}
	check := func(pass string, w map[Field]float64) {
		t.Helper()
		v := &s.Snapshot().GPUs[0].Values
		for f, x := range w {
			if got, ok := v.Get(f); !ok || !near(got, x) {
				t.Errorf("%s: field %d = %v (sampled %v), want %v", pass, f, got, ok, x)
			}
		}
	}
	check("first pass (over its own 200ms)", want(0.8, 0.4))

	// 5s at 80%/40%, then 5s at 20%/10%: the next pass reports the mean.
	clk.Add(5 * time.Second)
	must(t, n.SetUtilization(0, 20, 10))
	clk.Add(5 * time.Second)
	s.Sample()
	check("second pass", want(0.5, 0.25))

	// The counter integrates from the first load on: 5.2s at 80%, 5s at 20%,
	// read at the pass's start (before its GPM sample), in KiB, both ways.
	kib := math.Floor(0.3 * 18 * 25e9 * (0.8*5.2 + 0.2*5) / 1024)
	if got, _ := s.Snapshot().GPUs[0].Values.Get(FieldNVLinkBandwidth); math.Abs(got-2*kib) > 2 {
		t.Errorf("NVLink bandwidth counter %v KiB, want %v", got, 2*kib)
	}
	// GPU 1 idled throughout: zeros, which are values, not absences.
	if got, ok := s.Snapshot().GPUs[1].Values.Get(FieldGrEngineActive); !ok || got != 0 {
		t.Errorf("idle GPU engine activity %v (sampled %v), want 0", got, ok)
	}
}

// TestGPMSamplesLifecycle: the first pass over a GPU or GPU instance takes
// its two GPM samples at once (one wait for all); later passes take one and
// wait for nothing; a new MIG layout starts its instances afresh; samples
// of GPUs gone from the inventory are freed, and all of them on release.
func TestGPMSamplesLifecycle(t *testing.T) {
	clk := simtest.NewClock()
	n := simtest.Node(t, "dgx-h100", sim.WithMIGEnabled(), sim.WithClock(clk.Now))
	simtest.CreateMIG(t, n, 1)
	must(t, n.SetInstanceUtilization(7, 1, 60, 30)) // createMIG's first instance is GI 1
	s := newSampler(n, clk)
	s.SetInventory(simtest.Inventory(t, n))

	s.Sample()
	if !slices.Equal(clk.Slept, []time.Duration{gpmFirstGap}) {
		t.Fatalf("first pass slept %v, want one %v", clk.Slept, gpmFirstGap)
	}
	if _, ok := s.Snapshot().GPUs[7].Instances[0].Values.Get(FieldGrEngineActive); !ok {
		t.Error("first pass has no per-instance engine activity")
	}
	// One sample kept per GPU and per GPU instance.
	if got := n.GPMSamplesAllocated(); got != 16 {
		t.Errorf("%d GPM samples held, want 16 (8 GPUs, 8 instances)", got)
	}
	// A pass right after (an inventory kick) takes no sample: it repeats
	// the last metrics rather than average over no time at all.
	first, _ := s.Snapshot().GPUs[7].Values.Get(FieldSMActive)
	if !near(first, 0.85*0.6/7) {
		t.Errorf("GPU 7 SM activity %v, want its one 1g instance's 0.85×60%% over 7 slices", first)
	}
	s.Sample()
	if again, ok := s.Snapshot().GPUs[7].Values.Get(FieldSMActive); !ok || again != first {
		t.Errorf("immediate pass: SM activity %v (sampled %v), want the last one, %v", again, ok, first)
	}
	if got := n.GPMSamplesAllocated(); got != 16 {
		t.Errorf("%d GPM samples held after an immediate pass, want 16", got)
	}
	clk.Add(10 * time.Second)
	s.Sample()
	if len(clk.Slept) != 1 {
		t.Errorf("steady passes slept: %v", clk.Slept)
	}

	// A second instance on GPU 0: a new layout, whose instances start over.
	dev, _ := n.DeviceGetHandleByIndex(0)
	info, _ := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	gi, r := dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: 1, Size: 1})
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	ci, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	inv := simtest.Inventory(t, n)
	s.SetInventory(inv)
	clk.Add(10 * time.Second)
	s.Sample()
	if len(clk.Slept) != 2 {
		t.Errorf("pass after a layout change slept %v, want a second wait", clk.Slept)
	}
	for k, in := range s.Snapshot().GPUs[0].Instances {
		if _, ok := in.Values.Get(FieldGrEngineActive); !ok {
			t.Errorf("GPU 0 instance %d (GI %d) has no engine activity after the layout change", k, in.GI)
		}
	}
	if got := n.GPMSamplesAllocated(); got != 17 {
		t.Errorf("%d GPM samples held, want 17", got)
	}

	inv.GPUs = inv.GPUs[:2]
	s.SetInventory(inv)
	s.Sample()
	if got := n.GPMSamplesAllocated(); got != 5 {
		t.Errorf("%d GPM samples held for 2 GPUs (3 instances), want 5", got)
	}
	s.release()
	if got := n.GPMSamplesAllocated(); got != 0 {
		t.Errorf("%d GPM samples held after release", got)
	}
}

// TestNotSupportedIsAbsent: a call NVML refuses leaves its series out, and
// the refusal is remembered (the call would succeed the second time here);
// any other error leaves the value out of that pass only.
func TestNotSupportedIsAbsent(t *testing.T) {
	tests := []struct {
		profile string
		call    string
		ret     nvml.Return
		gone    []Field // in the first pass
		back    bool    // in the second
		kept    []Field // in both
	}{
		{"dgx-h100", "GetPcieReplayCounter", nvml.ERROR_NOT_SUPPORTED, []Field{FieldPCIeReplays}, false, []Field{FieldGPUTemp}},
		{"dgx-h100", "GetPcieReplayCounter", nvml.ERROR_UNKNOWN, []Field{FieldPCIeReplays}, true, nil},
		{"dgx1-v100", "GetEncoderUtilization", nvml.ERROR_NOT_SUPPORTED, []Field{FieldEncUtil}, false, []Field{FieldDecUtil}},
		{"dgx-h100", "GetDecoderUtilization", nvml.ERROR_NOT_SUPPORTED, []Field{FieldDecUtil}, false, nil},
		{"dgx-h100", "GetFieldValues", nvml.ERROR_NOT_SUPPORTED, []Field{FieldMemTemp, FieldNVLinkBandwidth}, false, []Field{FieldPCIeReplays}},
		{"dgx-h100", "GetFieldValues", nvml.ERROR_TIMEOUT, []Field{FieldMemTemp, FieldNVLinkBandwidth}, true, nil},
		{"dgx-h100", "GetMemoryInfo_v2", nvml.ERROR_NOT_SUPPORTED, []Field{FieldFBReserved}, false, []Field{FieldFBUsed, FieldFBFree}},
		{"dgx-h100", "GpmQueryDeviceSupport", nvml.ERROR_NOT_SUPPORTED, []Field{FieldGrEngineActive, FieldNVLinkTxBytes}, false, []Field{FieldGPUUtil}},
		{"dgx-h100", "GpmSampleGet", nvml.ERROR_NOT_SUPPORTED, []Field{FieldGrEngineActive, FieldPCIeRxBytes}, false, nil},
		// The second sample of the first pass fails: the second pass
		// reports from the first sample on.
		{"dgx-h100", "GpmSampleGet", nvml.ERROR_UNKNOWN, []Field{FieldGrEngineActive}, true, nil},
	}
	for _, tt := range tests {
		t.Run(tt.profile+"/"+tt.call+"/"+tt.ret.String(), func(t *testing.T) {
			clk := simtest.NewClock()
			n := simtest.Node(t, tt.profile, sim.WithClock(clk.Now))
			must(t, n.SetUtilization(0, 50, 50))
			s := newSampler(n, clk)
			s.SetInventory(simtest.Inventory(t, n))
			must(t, n.FailCalls(0, tt.call, tt.ret, 1))
			s.Sample()
			for _, f := range tt.gone {
				if x, ok := s.Snapshot().GPUs[0].Values.Get(f); ok {
					t.Errorf("pass 1: field %d = %v, want absent", f, x)
				}
				if _, ok := s.Snapshot().GPUs[1].Values.Get(f); !ok {
					t.Errorf("pass 1: field %d absent on GPU 1 too", f)
				}
			}
			clk.Add(10 * time.Second)
			s.Sample()
			for _, f := range tt.gone {
				if _, ok := s.Snapshot().GPUs[0].Values.Get(f); ok != tt.back {
					t.Errorf("pass 2: field %d sampled %v, want %v", f, ok, tt.back)
				}
			}
			for _, f := range tt.kept {
				if _, ok := s.Snapshot().GPUs[0].Values.Get(f); !ok {
					t.Errorf("field %d lost with %s", f, tt.call)
				}
			}
		})
	}
}

// TestRunFirstPassComplete: Run's first pass after an inventory arrives
// already has every series, GPM's included, without waiting an interval.
func TestRunFirstPassComplete(t *testing.T) {
	clk := simtest.NewClock()
	n := simtest.Node(t, "dgx-h100", sim.WithClock(clk.Now))
	must(t, n.SetUtilization(3, 70, 10))
	inv := simtest.Inventory(t, n)
	ctx, cancel := context.WithCancel(context.Background())
	var once sync.Once
	s := NewSampler(n, SamplerOptions{
		Interval: 24 * time.Hour, // a pass that waited for the ticker would hang the test
		Now:      clk.Now,
		Sleep: func(d time.Duration) {
			clk.Add(d)
			once.Do(cancel) // Run returns once this pass is published
		},
	})
	s.SetInventory(inv)
	if err := s.Run(ctx); err != nil {
		t.Fatal(err)
	}
	g := s.Snapshot().GPUs[3]
	for _, f := range []Field{FieldGPUUtil, FieldGrEngineActive, FieldMemTemp, FieldFBReserved} {
		if _, ok := g.Values.Get(f); !ok {
			t.Errorf("first pass lacks field %d", f)
		}
	}
	if got := n.GPMSamplesAllocated(); got != 0 {
		t.Errorf("Run left %d GPM samples allocated", got)
	}
}

// licensedNode answers GetGridLicensableFeatures as a vGPU guest would.
type licensedNode struct {
	*sim.Node
	lic nvml.GridLicensableFeatures
}

type licensedDevice struct {
	nvml.Device
	lic nvml.GridLicensableFeatures
}

func (d licensedDevice) GetGridLicensableFeatures() (nvml.GridLicensableFeatures, nvml.Return) {
	return d.lic, nvml.SUCCESS
}

func (n licensedNode) DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return) {
	d, r := n.Node.DeviceGetHandleByUUID(uuid)
	if r != nvml.SUCCESS {
		return nil, r
	}
	return licensedDevice{d, n.lic}, r
}

func TestVGPULicense(t *testing.T) {
	feature := func(code nvml.GridLicenseFeatureCode, state uint32) nvml.GridLicensableFeature {
		return nvml.GridLicensableFeature{FeatureCode: uint32(code), FeatureState: state}
	}
	tests := []struct {
		name string
		lic  nvml.GridLicensableFeatures
		want float64 // -1: absent
	}{
		{"bare metal: licensing not supported", nvml.GridLicensableFeatures{}, -1},
		{"vGPU licensed", nvml.GridLicensableFeatures{IsGridLicenseSupported: 1, LicensableFeaturesCount: 2,
			GridLicensableFeatures: [3]nvml.GridLicensableFeature{feature(nvml.GRID_LICENSE_FEATURE_CODE_COMPUTE, 0), feature(nvml.GRID_LICENSE_FEATURE_CODE_VGPU, 1)}}, 1},
		{"vGPU unlicensed", nvml.GridLicensableFeatures{IsGridLicenseSupported: 1, LicensableFeaturesCount: 1,
			GridLicensableFeatures: [3]nvml.GridLicensableFeature{feature(nvml.GRID_LICENSE_FEATURE_CODE_VGPU, 0)}}, 0},
		{"a licensed feature beyond the count does not count", nvml.GridLicensableFeatures{IsGridLicenseSupported: 1, LicensableFeaturesCount: 1,
			GridLicensableFeatures: [3]nvml.GridLicensableFeature{feature(nvml.GRID_LICENSE_FEATURE_CODE_COMPUTE, 1), feature(nvml.GRID_LICENSE_FEATURE_CODE_VGPU, 1)}}, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := simtest.Node(t, "pcie-4gpu")
			clk := simtest.NewClock()
			s := newSampler(licensedNode{n, tt.lic}, clk)
			s.SetInventory(simtest.Inventory(t, n))
			s.Sample()
			got, ok := s.Snapshot().GPUs[0].Values.Get(FieldVGPULicense)
			if (tt.want < 0) == ok || (ok && got != tt.want) {
				t.Errorf("license status %v (sampled %v), want %v (-1: absent)", got, ok, tt.want)
			}
		})
	}
}

// Defect: /metrics lacked the DCGM series for a whole sampling interval
// after start (the first pass ran before the inventory arrived).
func TestSamplerSamplesAsSoonAsInventoryArrives(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	s := NewSampler(n, SamplerOptions{Interval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	s.SetInventory(simtest.Inventory(t, n))
	testwait.For(t, "a sample of every GPU", func() bool { return len(s.Snapshot().GPUs) == 4 })
}
