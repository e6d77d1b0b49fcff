package sim

import (
	"encoding/binary"
	"math"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// testClock is a settable clock for WithClock.
type testClock struct{ t time.Time }

func (c *testClock) now() time.Time      { return c.t }
func (c *testClock) add(d time.Duration) { c.t = c.t.Add(d) }

func newTestClock() *testClock { return &testClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

// fieldRet reads one field value of d: its value as uint64 and its return.
func fieldRet(t *testing.T, d nvml.Device, id, scope uint32) (uint64, nvml.Return) {
	t.Helper()
	fv := []nvml.FieldValue{{FieldId: id, ScopeId: scope}}
	if r := d.GetFieldValues(fv); r != nvml.SUCCESS {
		t.Fatalf("GetFieldValues: %v", r)
	}
	if fv[0].ValueType == uint32(nvml.VALUE_TYPE_UNSIGNED_INT) {
		return uint64(binary.NativeEndian.Uint32(fv[0].Value[:4])), nvml.Return(fv[0].NvmlReturn)
	}
	return binary.NativeEndian.Uint64(fv[0].Value[:]), nvml.Return(fv[0].NvmlReturn)
}

// TestTelemetryPerModel pins what each model supports of the calls behind
// dcgm-exporter's series.
func TestTelemetryPerModel(t *testing.T) {
	tests := []struct {
		profile     string
		gpm         bool
		enc, dec    nvml.Return
		memTemp     nvml.Return
		nvlink      nvml.Return
		reservedMiB uint64
		mig         bool // MIG capable: codecs are refused once MIG is on
	}{
		{profile: "dgx-h100", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 81559 - 81152, mig: true},
		{profile: "dgx-a100", enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 40960 - 40192, mig: true},
		{profile: "dgx-a100-80gb", enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 81920 - 80896, mig: true},
		{profile: "dgx-h200", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 143771 - 143104, mig: true},
		{profile: "dgx-b200", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 183359 - 182784, mig: true},
		{profile: "pcie-h100nvl-x2", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.ERROR_NOT_SUPPORTED, reservedMiB: 95830 - 95360, mig: true},
		{profile: "gh200", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.ERROR_NOT_SUPPORTED, reservedMiB: 97871 - 95232, mig: true},
		{profile: "gh200-144g", gpm: true, enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.ERROR_NOT_SUPPORTED, reservedMiB: 146511 - 145408, mig: true},
		{profile: "pcie-a30x4", enc: nvml.ERROR_NOT_SUPPORTED, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.ERROR_NOT_SUPPORTED, reservedMiB: 24576 - 24000, mig: true},
		{profile: "dgx1-v100", enc: nvml.SUCCESS, dec: nvml.SUCCESS, memTemp: nvml.SUCCESS, nvlink: nvml.SUCCESS, reservedMiB: 32768 / 128},
		{profile: "pcie-4gpu", enc: nvml.SUCCESS, dec: nvml.SUCCESS, memTemp: nvml.ERROR_NOT_SUPPORTED, nvlink: nvml.ERROR_NOT_SUPPORTED, reservedMiB: 46068 / 128},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			n := newNode(t, tt.profile, WithImmediateMIGModeChange())
			d := handle(t, n, 0)
			sup, r := d.GpmQueryDeviceSupport()
			wantRet(t, "GpmQueryDeviceSupport", r, nvml.SUCCESS)
			if (sup.IsSupportedDevice != 0) != tt.gpm {
				t.Errorf("GPM supported %d, want %v", sup.IsSupportedDevice, tt.gpm)
			}
			s, _ := n.GpmSampleAlloc()
			defer s.Free()
			wantGet := nvml.ERROR_NOT_SUPPORTED
			if tt.gpm {
				wantGet = nvml.SUCCESS
			}
			wantRet(t, "GpmSampleGet", n.GpmSampleGet(d, s), wantGet)
			must(t, n.SetCodecUtilization(0, 11, 22))
			e, _, r := d.GetEncoderUtilization()
			wantRet(t, "GetEncoderUtilization", r, tt.enc)
			if r == nvml.SUCCESS && e != 11 {
				t.Errorf("encoder utilization %d", e)
			}
			dec, _, r := d.GetDecoderUtilization()
			wantRet(t, "GetDecoderUtilization", r, tt.dec)
			if r == nvml.SUCCESS && dec != 22 {
				t.Errorf("decoder utilization %d", dec)
			}
			must(t, n.SetTemperature(0, 50))
			must(t, n.SetUtilization(0, 0, 40))
			temp, r := fieldRet(t, d, nvml.FI_DEV_MEMORY_TEMP, 0)
			wantRet(t, "memory temperature", r, tt.memTemp)
			if r == nvml.SUCCESS && temp != 57 {
				t.Errorf("memory temperature %d, want 57 (GPU 50 + 3 + 40%% memory load / 10)", temp)
			}
			_, r = fieldRet(t, d, nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, math.MaxUint32)
			wantRet(t, "NVLink throughput", r, tt.nvlink)
			m, r := d.GetMemoryInfo_v2()
			if r != nvml.SUCCESS || m.Reserved != tt.reservedMiB<<20 {
				t.Errorf("reserved %d MiB, %v; want %d MiB", m.Reserved>>20, r, tt.reservedMiB)
			}
			must(t, n.SetPCIeReplays(0, 9))
			if c, r := d.GetPcieReplayCounter(); r != nvml.SUCCESS || c != 9 {
				t.Errorf("PCIe replays %d, %v", c, r)
			}
			if tt.mig {
				if _, r := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); r != nvml.SUCCESS {
					t.Fatal(r)
				}
				_, _, r := d.GetDecoderUtilization()
				wantRet(t, "decoder utilization with MIG on", r, nvml.ERROR_NOT_SUPPORTED)
			}
		})
	}
}

// gpmGet computes metrics between s1 and s2.
func gpmGet(n *Node, s1, s2 nvml.GpmSample, ids ...nvml.GpmMetricId) (*nvml.GpmMetricsGetType, nvml.Return) {
	mg := &nvml.GpmMetricsGetType{NumMetrics: uint32(len(ids)), Sample1: s1, Sample2: s2}
	for i, id := range ids {
		mg.Metrics[i].MetricId = uint32(id)
	}
	return mg, n.GpmMetricsGet(mg)
}

func TestGPM(t *testing.T) {
	clk := newTestClock()
	n := newNode(t, "dgx-h100", WithImmediateMIGModeChange(), WithClock(clk.now))
	d0, d1 := handle(t, n, 0), handle(t, n, 1)
	alloc := func() nvml.GpmSample {
		t.Helper()
		s, r := n.GpmSampleAlloc()
		if r != nvml.SUCCESS {
			t.Fatal(r)
		}
		return s
	}
	a, b, c := alloc(), alloc(), alloc()
	if got := n.GPMSamplesAllocated(); got != 3 {
		t.Errorf("%d allocated, want 3", got)
	}
	must(t, n.SetUtilization(0, 60, 20))
	wantRet(t, "sample a", n.GpmSampleGet(d0, a), nvml.SUCCESS)
	wantRet(t, "sample b at the same time", n.GpmSampleGet(d0, b), nvml.SUCCESS)
	_, r := gpmGet(n, a, b, nvml.GPM_METRIC_GRAPHICS_UTIL)
	wantRet(t, "metrics over no time", r, nvml.ERROR_INVALID_ARGUMENT)

	clk.add(2 * time.Second)
	wantRet(t, "sample b", n.GpmSampleGet(d0, b), nvml.SUCCESS)
	mg, r := gpmGet(n, a, b, nvml.GPM_METRIC_GRAPHICS_UTIL, nvml.GPM_METRIC_DRAM_BW_UTIL, nvml.GPM_METRIC_PCIE_TX_PER_SEC,
		nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, nvml.GPM_METRIC_NVDEC_0_UTIL)
	wantRet(t, "metrics", r, nvml.SUCCESS)
	for i, want := range []struct {
		ret nvml.Return
		v   float64
	}{
		{nvml.SUCCESS, 60}, {nvml.SUCCESS, 20}, {nvml.SUCCESS, 0.6 * 2048},
		{nvml.SUCCESS, 0.3 * 0.6 * 18 * 25e9 / (1 << 20)}, {nvml.ERROR_NOT_SUPPORTED, 0},
	} {
		m := mg.Metrics[i]
		if nvml.Return(m.NvmlReturn) != want.ret || math.Abs(m.Value-want.v) > 1e-9*math.Max(1, want.v) {
			t.Errorf("metric %d: %v %v, want %v %v", m.MetricId, nvml.Return(m.NvmlReturn), m.Value, want.ret, want.v)
		}
	}
	wantRet(t, "sample c of another GPU", n.GpmSampleGet(d1, c), nvml.SUCCESS)
	_, r = gpmGet(n, a, c, nvml.GPM_METRIC_GRAPHICS_UTIL)
	wantRet(t, "samples of two GPUs", r, nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "MigGet with MIG off", n.GpmMigSampleGet(d0, 1, c), nvml.ERROR_NOT_SUPPORTED)

	// MIG: a GPU instance samples alike through its GPU's handle and a MIG
	// device handle; it has no PCIe or NVLink metrics of its own.
	if _, r := d1.SetMigMode(nvml.DEVICE_MIG_ENABLE); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	gi := createGI(t, d1, nvml.GPU_INSTANCE_PROFILE_2_SLICE, 0)
	createFullCI(t, gi)
	info, _ := gi.GetInfo()
	must(t, n.SetInstanceUtilization(1, int(info.Id), 70, 35))
	mig, r := d1.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG device", r, nvml.SUCCESS)
	wantRet(t, "MigGet of an unknown instance", n.GpmMigSampleGet(d1, 6, c), nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "MigGet on a MIG device handle", n.GpmMigSampleGet(mig, int(info.Id), c), nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "MigGet", n.GpmMigSampleGet(d1, int(info.Id), c), nvml.SUCCESS)
	whole := alloc()
	wantRet(t, "GPU sample", n.GpmSampleGet(d1, whole), nvml.SUCCESS)
	clk.add(time.Second)
	wantRet(t, "MIG device sample", n.GpmSampleGet(mig, b), nvml.SUCCESS)
	mg, r = gpmGet(n, c, b, nvml.GPM_METRIC_SM_UTIL, nvml.GPM_METRIC_PCIE_RX_PER_SEC, nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC)
	wantRet(t, "instance metrics", r, nvml.SUCCESS)
	if m := mg.Metrics[0]; math.Abs(m.Value-0.85*70) > 1e-9 {
		t.Errorf("instance SM utilization %v, want %v", m.Value, 0.85*70)
	}
	for _, m := range mg.Metrics[1:3] {
		wantRet(t, "instance link metric", nvml.Return(m.NvmlReturn), nvml.ERROR_NOT_SUPPORTED)
	}
	wantRet(t, "GPU sample", n.GpmSampleGet(d1, a), nvml.SUCCESS)
	mg, r = gpmGet(n, whole, a, nvml.GPM_METRIC_GRAPHICS_UTIL, nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC)
	wantRet(t, "GPU metrics with MIG on", r, nvml.SUCCESS)
	if m := mg.Metrics[0]; math.Abs(m.Value-70*2.0/7) > 1e-9 {
		t.Errorf("MIG GPU engine utilization %v, want its 2g instance's 70%% over 7 slices", m.Value)
	}
	if m := mg.Metrics[1]; nvml.Return(m.NvmlReturn) != nvml.SUCCESS || m.Value != 0 {
		t.Errorf("MIG GPU NVLink %v %v, want 0: MIG instances do not use NVLink", nvml.Return(m.NvmlReturn), m.Value)
	}

	for _, s := range []nvml.GpmSample{a, b, c, whole} {
		wantRet(t, "free", s.Free(), nvml.SUCCESS)
	}
	wantRet(t, "free twice", a.Free(), nvml.ERROR_INVALID_ARGUMENT)
	wantRet(t, "sample into a freed buffer", n.GpmSampleGet(d0, a), nvml.ERROR_INVALID_ARGUMENT)
	if got := n.GPMSamplesAllocated(); got != 0 {
		t.Errorf("%d allocated after freeing all", got)
	}
}

// TestNVLinkThroughput: the counters integrate the load over the clock, in
// KiB, per link or over all of them, data less than raw.
func TestNVLinkThroughput(t *testing.T) {
	clk := newTestClock()
	n := newNode(t, "dgx-a100", WithClock(clk.now))
	d := handle(t, n, 2)
	must(t, n.SetUtilization(2, 50, 0))
	clk.add(4 * time.Second)
	must(t, n.SetUtilization(2, 0, 0)) // idle from here: the counters stop
	clk.add(time.Hour)
	raw := 0.3 * 0.5 * 12 * 25e9 * 4 // bytes each way
	tests := []struct {
		name  string
		field uint32
		scope uint32
		ret   nvml.Return
		kib   uint64
	}{
		{"raw tx, all links", nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, math.MaxUint32, nvml.SUCCESS, uint64(raw / 1024)},
		{"raw rx, all links", nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_RX, math.MaxUint32, nvml.SUCCESS, uint64(raw / 1024)},
		{"data tx, all links", nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX, math.MaxUint32, nvml.SUCCESS, uint64(raw * 0.9 / 1024)},
		{"raw tx, link 3", nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, 3, nvml.SUCCESS, uint64(raw / 12 / 1024)},
		{"raw tx, link 12 of 12", nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, 12, nvml.ERROR_INVALID_ARGUMENT, 0},
		{"an unmodelled field", nvml.FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, 0, nvml.ERROR_NOT_SUPPORTED, 0},
	}
	for _, tt := range tests {
		got, r := fieldRet(t, d, tt.field, tt.scope)
		// ±1 KiB: whole KiB of a float integral.
		if r != tt.ret || (r == nvml.SUCCESS && (got+1 < tt.kib || got > tt.kib+1)) {
			t.Errorf("%s: %d KiB, %v; want %d KiB, %v", tt.name, got, r, tt.kib, tt.ret)
		}
	}
}

// The utilization endpoint sets a GPU instance's load.
func TestHTTPInstanceUtilization(t *testing.T) {
	n := newNode(t, "dgx-h100", WithMIGEnabled())
	gi := createGI(t, handle(t, n, 4), nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0)
	info, _ := gi.GetInfo()
	rec := httptest.NewRecorder()
	body := `{"gpu":4,"gi":` + strconv.Itoa(int(info.Id)) + `,"gpu_util":55,"mem_util":5}`
	n.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/sim/utilization", strings.NewReader(body)))
	if rec.Code != 200 {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if x := n.gpus[4].gis[0]; x.util != 55 || x.memUtil != 5 {
		t.Errorf("instance load %d%%/%d%%, want 55%%/5%%", x.util, x.memUtil)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
