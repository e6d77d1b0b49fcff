package telemetry

import (
	"context"
	"encoding/binary"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Field is one sampled value of a GPU or MIG device.
type Field int

// Sampled fields. Units are dcgm-exporter's: %, MiB, °C, W, mJ, MHz, counts;
// the profiling fields (GPM) are ratios (0-1) and bytes/s.
const (
	FieldGPUUtil Field = iota
	FieldMemCopyUtil
	FieldEncUtil
	FieldDecUtil
	FieldFBUsed
	FieldFBFree
	FieldFBReserved
	FieldGPUTemp
	FieldMemTemp
	FieldPower
	FieldEnergy
	FieldSMClock
	FieldMemClock
	FieldPCIeReplays
	// FieldNVLinkBandwidth is NVLink traffic in KiB, both directions and
	// protocol overhead included, since the driver was loaded.
	FieldNVLinkBandwidth
	// FieldVGPULicense is 1 when the vGPU feature is licensed (vGPU guests).
	FieldVGPULicense
	FieldECCSBEVolatile
	FieldECCDBEVolatile
	FieldECCSBEAggregate
	FieldECCDBEAggregate
	FieldRemappedCorrectable
	FieldRemappedUncorrectable
	FieldRemapFailure
	FieldRemapPending
	// Profiling fields, from NVML's GPU Performance Monitoring (Hopper and
	// newer): averages over the time between two samples.
	FieldGrEngineActive
	FieldSMActive
	FieldSMOccupancy
	FieldTensorActive
	FieldDRAMActive
	FieldFP64Active
	FieldFP32Active
	FieldFP16Active
	FieldPCIeTxBytes
	FieldPCIeRxBytes
	FieldNVLinkTxBytes
	FieldNVLinkRxBytes
	numFields
)

// Values holds sampled fields; a field NVML could not give is absent, never 0.
type Values struct {
	v   [numFields]float64
	has uint64
}

// Get returns a field and whether it was sampled.
func (v *Values) Get(f Field) (float64, bool) { return v.v[f], v.has&(1<<f) != 0 }

func (v *Values) set(f Field, x float64) { v.v[f], v.has = x, v.has|1<<f }

// merge sets the fields o has.
func (v *Values) merge(o *Values) {
	for f := range numFields {
		if x, ok := o.Get(f); ok {
			v.set(f, x)
		}
	}
}

// Snapshot is one sampling pass over the node; immutable once published.
type Snapshot struct {
	Time          time.Time
	DriverVersion string
	GPUs          []GPUSample
}

// GPUSample is a GPU's identity and sampled values.
type GPUSample struct {
	Index    int
	UUID     string
	Name     string
	PCIBusID string // NVML's form, "00000000:07:00.0"
	Minor    int
	MIG      gpu.MIGMode
	// Lost: NVML answered ERROR_GPU_IS_LOST; the GPU has no values.
	Lost      bool
	Values    Values
	Instances []MIGSample
}

// MIGSample is a MIG device's identity and the values NVML gives per
// instance: framebuffer, and the profiling fields where GPM samples GPU
// instances (Hopper and newer). The rest exists only for the whole GPU.
type MIGSample struct {
	UUID    string
	Profile string
	GI, CI  int
	Values  Values
}

// SamplerOptions tune a Sampler.
type SamplerOptions struct {
	// Interval between sampling passes (default 10s).
	Interval time.Duration
	Logger   *slog.Logger
	Now      func() time.Time
	// Sleep waits, within a pass, between the first two GPM samples of a
	// GPU or GPU instance (default time.Sleep); tests pass one that moves
	// their clock.
	Sleep func(time.Duration)
	// OnPass is called after each pass is published (an Exposition's
	// Kick); it must not block.
	OnPass func()
}

// gpmFirstGap is how long a pass waits between the first two GPM samples of
// a device, so that its first pass already has the profiling fields. NVML
// wants more than 100 ms between two samples (its refresh rate).
const gpmFirstGap = 200 * time.Millisecond

// Sampler reads telemetry from NVML into a cache on its own schedule, so a
// scrape costs the same however many scrapers there are and never waits for
// the driver. NVML calls a GPU answers NOT_SUPPORTED are remembered and not
// repeated until the GPU's MIG layout changes.
//
// Profiling fields come from GPM, which reports averages between two
// samples: each pass takes one sample per GPU and GPU instance and reports
// the metrics since the previous pass. A GPU or GPU instance seen for the
// first time gets its second sample within the same pass, gpmFirstGap
// later, so no pass publishes a GPU without them.
type Sampler struct {
	lib  nvml.Interface
	opts SamplerOptions
	snap atomic.Pointer[Snapshot]

	mu      sync.Mutex
	pendInv *gpu.Inventory
	// kick starts a pass at once when the inventory changes: the first
	// scrape after start must already have every series, not wait out an
	// interval after an empty first pass.
	kick chan struct{}

	// passMu serialises passes (Run and Sample); it guards what follows.
	passMu  sync.Mutex
	inv     *gpu.Inventory
	state   map[string]*sampledGPU
	symbols map[string]bool
	// warm are the GPM sources that got their first sample this pass.
	warm   []gpmWarm
	gpmReq nvml.GpmMetricsGetType
}

type sampledGPU struct {
	dev         nvml.Device
	migs        map[string]nvml.Device
	layout      string // MIG mode and instances; a change resets unsupported
	unsupported uint32 // bit per call (not per field)
	// gpm is the GPU's GPM source once NVML said it supports GPM; gpmGIs
	// its GPU instances', by id, for the current layout.
	gpm    *gpmSource
	gpmGIs map[int]*gpmSource
}

// gpmSource is a GPU (gi < 0) or one of its GPU instances, with its last
// GPM sample, when it was taken and the metrics it ended.
type gpmSource struct {
	gi   int
	prev nvml.GpmSample
	at   time.Time
	last Values
}

// gpmWarm is a GPM source waiting for its second sample in this pass, and
// where its metrics go.
type gpmWarm struct {
	run *sampleRun
	src *gpmSource
	to  gpmTarget
}

// gpmTarget is where a source's metrics go: a GPU of the snapshot, or the
// MIG devices of one GPU instance (one per compute instance).
type gpmTarget struct {
	gpu   int
	insts []int // nil: the GPU itself
}

func (t gpmTarget) apply(snap *Snapshot, v *Values) {
	g := &snap.GPUs[t.gpu]
	if t.insts == nil {
		g.Values.merge(v)
		return
	}
	for _, k := range t.insts {
		g.Instances[k].Values.merge(v)
	}
}

// gpmMetrics are the GPM metrics sampled and the fields they fill. GPM gives
// percentages and MiB/s; dcgm-exporter's profiling fields are ratios and
// bytes/s.
var gpmMetrics = [...]struct {
	id    nvml.GpmMetricId
	field Field
	pct   bool // else MiB/s
}{
	{nvml.GPM_METRIC_GRAPHICS_UTIL, FieldGrEngineActive, true},
	{nvml.GPM_METRIC_SM_UTIL, FieldSMActive, true},
	{nvml.GPM_METRIC_SM_OCCUPANCY, FieldSMOccupancy, true},
	// DCGM's tensor pipe field counts any tensor instruction.
	{nvml.GPM_METRIC_ANY_TENSOR_UTIL, FieldTensorActive, true},
	{nvml.GPM_METRIC_DRAM_BW_UTIL, FieldDRAMActive, true},
	{nvml.GPM_METRIC_FP64_UTIL, FieldFP64Active, true},
	{nvml.GPM_METRIC_FP32_UTIL, FieldFP32Active, true},
	{nvml.GPM_METRIC_FP16_UTIL, FieldFP16Active, true},
	{nvml.GPM_METRIC_PCIE_TX_PER_SEC, FieldPCIeTxBytes, false},
	{nvml.GPM_METRIC_PCIE_RX_PER_SEC, FieldPCIeRxBytes, false},
	{nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, FieldNVLinkTxBytes, false},
	{nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, FieldNVLinkRxBytes, false},
}

// Calls whose NOT_SUPPORTED is remembered, as bits of sampledGPU.unsupported.
const (
	callUtil = 1 << iota
	callMem
	callMemV2
	callTemp
	callPower
	callEnergy
	callSMClock
	callMemClock
	callECC
	callRemap
	callMIGMem
	callEnc
	callDec
	callPCIeReplay
	callMemTemp // field value
	callNVLink  // field values
	callGPM
	callMIGGPM
	callVGPULicense
)

// Field values read with one GetFieldValues call: memory temperature and
// the NVLink throughput counters summed over all links (scope UINT_MAX).
var fieldReqs = [...]struct {
	id, scope, bit uint32
}{
	{nvml.FI_DEV_MEMORY_TEMP, 0, callMemTemp},
	{nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, math.MaxUint32, callNVLink},
	{nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_RX, math.MaxUint32, callNVLink},
}

// NVML symbols newer than the oldest driver gpu-agent runs on: calling a
// function the library lacks would crash the process, so their presence is
// checked once.
const (
	symMemoryV2 = "nvmlDeviceGetMemoryInfo_v2"
	symGPM      = "nvmlGpmMetricsGet"
)

// NewSampler returns a sampler for lib (initialised).
func NewSampler(lib nvml.Interface, opts SamplerOptions) *Sampler {
	if opts.Interval <= 0 {
		opts.Interval = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Sleep == nil {
		opts.Sleep = time.Sleep
	}
	s := &Sampler{lib: lib, opts: opts, state: map[string]*sampledGPU{}, symbols: map[string]bool{}, kick: make(chan struct{}, 1)}
	s.snap.Store(&Snapshot{})
	return s
}

// SetInventory sets the GPUs and MIG devices to sample from the next pass on.
func (s *Sampler) SetInventory(inv *gpu.Inventory) {
	s.mu.Lock()
	s.pendInv = inv
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Snapshot returns the latest pass; safe from any goroutine.
func (s *Sampler) Snapshot() *Snapshot { return s.snap.Load() }

// Run samples every Interval until ctx is done.
func (s *Sampler) Run(ctx context.Context) error {
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	defer s.release()
	for {
		s.Sample()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-s.kick:
		}
	}
}

// Sample runs one pass now and publishes it.
func (s *Sampler) Sample() {
	s.passMu.Lock()
	defer s.passMu.Unlock()
	s.mu.Lock()
	if s.pendInv != nil {
		s.inv, s.pendInv = s.pendInv, nil
	}
	s.mu.Unlock()
	if s.inv == nil {
		return
	}
	snap := &Snapshot{Time: s.opts.Now(), DriverVersion: s.inv.DriverVersion, GPUs: make([]GPUSample, 0, len(s.inv.GPUs))}
	runs := make([]*sampleRun, len(s.inv.GPUs))
	for i, g := range s.inv.GPUs {
		var gs GPUSample
		gs, runs[i] = s.sampleGPU(g)
		snap.GPUs = append(snap.GPUs, gs)
	}
	s.sampleGPM(snap, runs)
	s.forget()
	s.snap.Store(snap)
	if s.opts.OnPass != nil {
		s.opts.OnPass()
	}
}

// release frees what the sampler holds in NVML (GPM samples).
func (s *Sampler) release() {
	s.passMu.Lock()
	defer s.passMu.Unlock()
	for _, st := range s.state {
		s.dropGPM(st, true)
	}
}

// forget drops the state of GPUs no longer in the inventory.
func (s *Sampler) forget() {
	if len(s.state) <= len(s.inv.GPUs) {
		return
	}
	keep := make(map[string]bool, len(s.inv.GPUs))
	for _, g := range s.inv.GPUs {
		keep[g.UUID] = true
	}
	for uuid, st := range s.state {
		if !keep[uuid] {
			s.dropGPM(st, true)
			delete(s.state, uuid)
		}
	}
}

// hasSymbol says, once per name, whether the driver's NVML has a function.
func (s *Sampler) hasSymbol(name string) bool {
	ok, seen := s.symbols[name]
	if !seen {
		ok = s.lib.Extensions().LookupSymbol(name) == nil
		s.symbols[name] = ok
	}
	return ok
}

func layoutKey(g gpu.GPU) string {
	b := make([]byte, 0, 2+len(g.Instances)*40)
	if g.MIG.Current {
		b = append(b, 'M')
	}
	for _, in := range g.Instances {
		b = append(b, in.UUID...)
	}
	return string(b)
}

// sampleGPU makes a GPU's NVML calls but GPM's; the run it returns is nil
// when the GPU has no handle.
func (s *Sampler) sampleGPU(g gpu.GPU) (GPUSample, *sampleRun) {
	out := GPUSample{Index: g.Index, UUID: g.UUID, Name: g.Name, PCIBusID: nvmlBusID(g.PCIBusID), Minor: g.Minor, MIG: g.MIG}
	st := s.state[g.UUID]
	if st == nil {
		st = &sampledGPU{migs: map[string]nvml.Device{}}
		s.state[g.UUID] = st
	}
	if key := layoutKey(g); key != st.layout {
		// NVML's answers depend on the MIG layout (utilization and remapped
		// rows are refused while MIG instances exist): ask again. GPU
		// instance ids are reused, so their GPM samples go too.
		st.layout, st.unsupported = key, 0
		st.migs = map[string]nvml.Device{}
		s.dropGPM(st, false)
	}
	if st.dev == nil {
		dev, ret := s.lib.DeviceGetHandleByUUID(g.UUID)
		if ret != nvml.SUCCESS {
			out.Lost = ret == nvml.ERROR_GPU_IS_LOST
			s.opts.Logger.Debug("sampling: no handle", "gpu", g.Index, "uuid", g.UUID, "error", ret.Error())
			return out, nil
		}
		st.dev = dev
	}
	r := &sampleRun{st: st, log: s.opts.Logger, g: &g}
	dev := st.dev
	v := &out.Values
	if u, ok := call(r, callUtil, func() (nvml.Utilization, nvml.Return) { return dev.GetUtilizationRates() }); ok {
		v.set(FieldGPUUtil, float64(u.Gpu))
		v.set(FieldMemCopyUtil, float64(u.Memory))
	}
	for _, c := range [...]struct {
		bit uint32
		f   Field
		get func() (uint32, uint32, nvml.Return)
	}{{callEnc, FieldEncUtil, dev.GetEncoderUtilization}, {callDec, FieldDecUtil, dev.GetDecoderUtilization}} {
		if x, ok := call(r, c.bit, func() (uint32, nvml.Return) { u, _, ret := c.get(); return u, ret }); ok {
			v.set(c.f, float64(x))
		}
	}
	s.sampleMemory(r, v)
	if x, ok := call(r, callTemp, func() (uint32, nvml.Return) { return dev.GetTemperature(nvml.TEMPERATURE_GPU) }); ok {
		v.set(FieldGPUTemp, float64(x))
	}
	if x, ok := call(r, callPower, func() (uint32, nvml.Return) { return dev.GetPowerUsage() }); ok {
		v.set(FieldPower, float64(x)/1000)
	}
	if x, ok := call(r, callEnergy, func() (uint64, nvml.Return) { return dev.GetTotalEnergyConsumption() }); ok {
		v.set(FieldEnergy, float64(x))
	}
	if x, ok := call(r, callSMClock, func() (uint32, nvml.Return) { return dev.GetClockInfo(nvml.CLOCK_SM) }); ok {
		v.set(FieldSMClock, float64(x))
	}
	if x, ok := call(r, callMemClock, func() (uint32, nvml.Return) { return dev.GetClockInfo(nvml.CLOCK_MEM) }); ok {
		v.set(FieldMemClock, float64(x))
	}
	if x, ok := call(r, callPCIeReplay, func() (int, nvml.Return) { return dev.GetPcieReplayCounter() }); ok {
		v.set(FieldPCIeReplays, float64(x))
	}
	sampleFields(r, v)
	// Only a vGPU guest has a license to report; elsewhere NVML answers
	// that licensing is not supported, which counts as NOT_SUPPORTED.
	if x, ok := call(r, callVGPULicense, func() (nvml.GridLicensableFeatures, nvml.Return) { return dev.GetGridLicensableFeatures() }); ok {
		if x.IsGridLicenseSupported == 0 {
			st.unsupported |= callVGPULicense
		}
		for _, f := range x.GridLicensableFeatures[:min(int(x.LicensableFeaturesCount), len(x.GridLicensableFeatures))] {
			if x.IsGridLicenseSupported != 0 && nvml.GridLicenseFeatureCode(f.FeatureCode) == nvml.GRID_LICENSE_FEATURE_CODE_VGPU {
				v.set(FieldVGPULicense, b2f(f.FeatureState != 0))
			}
		}
	}
	for _, e := range [...]struct {
		f   Field
		typ nvml.MemoryErrorType
		cnt nvml.EccCounterType
	}{
		{FieldECCSBEVolatile, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC},
		{FieldECCDBEVolatile, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC},
		{FieldECCSBEAggregate, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.AGGREGATE_ECC},
		{FieldECCDBEAggregate, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC},
	} {
		if x, ok := call(r, callECC, func() (uint64, nvml.Return) { return dev.GetTotalEccErrors(e.typ, e.cnt) }); ok {
			v.set(e.f, float64(x))
		}
	}
	type remap struct {
		corr, unc        int
		pending, failure bool
	}
	if x, ok := call(r, callRemap, func() (remap, nvml.Return) {
		c, u, p, f, ret := dev.GetRemappedRows()
		return remap{c, u, p, f}, ret
	}); ok {
		v.set(FieldRemappedCorrectable, float64(x.corr))
		v.set(FieldRemappedUncorrectable, float64(x.unc))
		v.set(FieldRemapFailure, b2f(x.failure))
		v.set(FieldRemapPending, b2f(x.pending))
	}
	if r.lost {
		s.lose(&out, st)
		return out, nil
	}
	if len(g.Instances) > 0 {
		out.Instances = make([]MIGSample, 0, len(g.Instances))
	}
	for _, in := range g.Instances {
		ms := MIGSample{UUID: in.UUID, Profile: in.Profile, GI: in.GI, CI: in.CI}
		if st.unsupported&callMIGMem == 0 {
			if mdev := s.migHandle(st, in.UUID); mdev != nil {
				if m, ok := call(r, callMIGMem, func() (nvml.Memory, nvml.Return) { return mdev.GetMemoryInfo() }); ok {
					ms.Values.set(FieldFBUsed, float64(m.Used>>20))
					ms.Values.set(FieldFBFree, float64(m.Free>>20))
				} else {
					delete(st.migs, in.UUID) // maybe destroyed: look it up again next time
				}
			}
		}
		out.Instances = append(out.Instances, ms)
	}
	return out, r
}

// lose marks a GPU NVML answered ERROR_GPU_IS_LOST for: no values, and its
// handle and GPM samples are gone (a GPU that comes back starts afresh).
func (s *Sampler) lose(out *GPUSample, st *sampledGPU) {
	out.Lost, out.Values, out.Instances = true, Values{}, nil
	st.dev = nil
	s.dropGPM(st, true)
}

// sampleMemory reads the framebuffer: GetMemoryInfo_v2 where the driver has
// it, since only it tells reserved memory apart from used.
func (s *Sampler) sampleMemory(r *sampleRun, v *Values) {
	dev := r.st.dev
	if s.hasSymbol(symMemoryV2) {
		if m, ok := call(r, callMemV2, func() (nvml.Memory_v2, nvml.Return) { return dev.GetMemoryInfo_v2() }); ok {
			v.set(FieldFBUsed, float64(m.Used>>20))
			v.set(FieldFBFree, float64(m.Free>>20))
			v.set(FieldFBReserved, float64(m.Reserved>>20))
			return
		}
		if r.st.unsupported&callMemV2 == 0 {
			return // failed this time; not a reason to ask the old way
		}
	}
	if m, ok := call(r, callMem, func() (nvml.Memory, nvml.Return) { return dev.GetMemoryInfo() }); ok {
		v.set(FieldFBUsed, float64(m.Used>>20))
		v.set(FieldFBFree, float64(m.Free>>20))
	}
}

// sampleFields reads fieldReqs in one GetFieldValues call; each value has
// its own return code, so one the GPU lacks leaves the others.
func sampleFields(r *sampleRun, v *Values) {
	var req [len(fieldReqs)]nvml.FieldValue
	var bits [len(fieldReqs)]uint32
	n, all := 0, uint32(0)
	for _, f := range fieldReqs {
		if r.st.unsupported&f.bit == 0 {
			req[n], bits[n] = nvml.FieldValue{FieldId: f.id, ScopeId: f.scope}, f.bit
			all |= f.bit
			n++
		}
	}
	if n == 0 || r.lost {
		return
	}
	if _, ok := call(r, all, func() (struct{}, nvml.Return) { return struct{}{}, r.st.dev.GetFieldValues(req[:n]) }); !ok {
		return
	}
	got := map[uint32]float64{}
	for i := range n {
		switch ret := nvml.Return(req[i].NvmlReturn); ret {
		case nvml.SUCCESS:
			if x, ok := fieldFloat(&req[i]); ok {
				got[req[i].FieldId] = x
			}
		case nvml.ERROR_NOT_SUPPORTED:
			r.st.unsupported |= bits[i]
		default:
			r.log.Debug("sampling failed", "gpu", r.g.Index, "uuid", r.g.UUID, "field", req[i].FieldId, "error", ret.Error())
		}
	}
	if x, ok := got[nvml.FI_DEV_MEMORY_TEMP]; ok {
		v.set(FieldMemTemp, x)
	}
	tx, okTx := got[nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX]
	rx, okRx := got[nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_RX]
	if okTx && okRx {
		v.set(FieldNVLinkBandwidth, tx+rx)
	}
}

// fieldFloat decodes a field value by its type.
func fieldFloat(f *nvml.FieldValue) (float64, bool) {
	b := f.Value[:]
	switch nvml.ValueType(f.ValueType) {
	case nvml.VALUE_TYPE_DOUBLE:
		return math.Float64frombits(binary.NativeEndian.Uint64(b)), true
	case nvml.VALUE_TYPE_UNSIGNED_INT:
		return float64(binary.NativeEndian.Uint32(b)), true
	case nvml.VALUE_TYPE_UNSIGNED_LONG, nvml.VALUE_TYPE_UNSIGNED_LONG_LONG:
		return float64(binary.NativeEndian.Uint64(b)), true
	case nvml.VALUE_TYPE_SIGNED_LONG_LONG:
		return float64(int64(binary.NativeEndian.Uint64(b))), true
	case nvml.VALUE_TYPE_SIGNED_INT:
		return float64(int32(binary.NativeEndian.Uint32(b))), true
	case nvml.VALUE_TYPE_UNSIGNED_SHORT:
		return float64(binary.NativeEndian.Uint16(b)), true
	}
	return 0, false
}

// sampleGPM takes each GPU's and GPU instance's GPM sample and fills in the
// metrics since the previous one. Sources without one get a second sample
// gpmFirstGap later, in this pass.
func (s *Sampler) sampleGPM(snap *Snapshot, runs []*sampleRun) {
	if !s.hasSymbol(symGPM) {
		return
	}
	s.warm = s.warm[:0]
	for i, r := range runs {
		if r != nil {
			s.gpmGPU(snap, i, r)
		}
	}
	if len(s.warm) == 0 {
		return
	}
	// Every waiting source got its first sample before now.
	s.opts.Sleep(gpmFirstGap)
	warm := slices.Clone(s.warm)
	s.warm = s.warm[:0]
	for _, w := range warm {
		s.gpmRead(w.run, w.src, w.to, snap)
	}
	for i, r := range runs {
		if r != nil && r.lost && !snap.GPUs[i].Lost {
			s.lose(&snap.GPUs[i], r.st)
		}
	}
}

// gpmGPU samples GPU i and its GPU instances, once NVML says the GPU
// supports GPM (Hopper and newer).
func (s *Sampler) gpmGPU(snap *Snapshot, i int, r *sampleRun) {
	st := r.st
	if st.unsupported&callGPM != 0 {
		return
	}
	if st.gpm == nil {
		sup, ok := call(r, callGPM, func() (nvml.GpmSupport, nvml.Return) { return st.dev.GpmQueryDeviceSupport() })
		if !ok {
			return
		}
		if sup.IsSupportedDevice == 0 {
			st.unsupported |= callGPM
			return
		}
		st.gpm = &gpmSource{gi: -1}
	}
	s.gpmRead(r, st.gpm, gpmTarget{gpu: i}, snap)
	// One source per GPU instance, whose metrics every MIG device (compute
	// instance) in it carries.
	insts := snap.GPUs[i].Instances
	for k := 0; k < len(insts); k++ {
		gi := insts[k].GI
		if slices.ContainsFunc(insts[:k], func(m MIGSample) bool { return m.GI == gi }) {
			continue
		}
		t := gpmTarget{gpu: i}
		for j := k; j < len(insts); j++ {
			if insts[j].GI == gi {
				t.insts = append(t.insts, j)
			}
		}
		if st.gpmGIs == nil {
			st.gpmGIs = map[int]*gpmSource{}
		}
		src := st.gpmGIs[gi]
		if src == nil {
			src = &gpmSource{gi: gi}
			st.gpmGIs[gi] = src
		}
		s.gpmRead(r, src, t, snap)
	}
	if r.lost {
		s.lose(&snap.GPUs[i], st)
	}
}

// gpmRead takes a new sample of src. With an earlier one it sends the
// metrics between the two to t; without, src waits in s.warm for a second.
func (s *Sampler) gpmRead(r *sampleRun, src *gpmSource, t gpmTarget, snap *Snapshot) {
	bit := uint32(callGPM)
	if src.gi >= 0 {
		bit = callMIGGPM
	}
	if r.lost || r.st.unsupported&bit != 0 {
		return
	}
	now := s.opts.Now()
	if src.prev != nil && now.Sub(src.at) < gpmFirstGap {
		// A pass right after another (an inventory kick): an average over
		// so short a time would be noise, so the last one stands.
		t.apply(snap, &src.last)
		return
	}
	cur, ok := call(r, bit, s.lib.GpmSampleAlloc)
	if !ok {
		return
	}
	dev := r.st.dev
	if _, ok := call(r, bit, func() (struct{}, nvml.Return) {
		if src.gi < 0 {
			return struct{}{}, s.lib.GpmSampleGet(dev, cur)
		}
		return struct{}{}, s.lib.GpmMigSampleGet(dev, src.gi, cur)
	}); !ok {
		s.lib.GpmSampleFree(cur)
		return
	}
	prev := src.prev
	src.prev, src.at, src.last = cur, now, Values{}
	if prev == nil {
		s.warm = append(s.warm, gpmWarm{run: r, src: src, to: t})
		return
	}
	defer s.lib.GpmSampleFree(prev)
	mg := &s.gpmReq
	*mg = nvml.GpmMetricsGetType{Version: nvml.GPM_METRICS_GET_VERSION, NumMetrics: uint32(len(gpmMetrics)), Sample1: prev, Sample2: cur}
	for i, m := range gpmMetrics {
		mg.Metrics[i].MetricId = uint32(m.id)
	}
	if _, ok := call(r, bit, func() (struct{}, nvml.Return) { return struct{}{}, s.lib.GpmMetricsGet(mg) }); !ok {
		return
	}
	var v Values
	for i, m := range gpmMetrics {
		got := &mg.Metrics[i]
		if nvml.Return(got.NvmlReturn) != nvml.SUCCESS {
			continue // this metric only: NVLink on a GPU without it, say
		}
		if m.pct {
			v.set(m.field, got.Value/100)
		} else {
			v.set(m.field, got.Value*(1<<20))
		}
	}
	src.last = v
	t.apply(snap, &v)
}

// dropGPM frees the GPU instances' GPM samples and, with whole, the GPU's.
func (s *Sampler) dropGPM(st *sampledGPU, whole bool) {
	for _, src := range st.gpmGIs {
		if src.prev != nil {
			s.lib.GpmSampleFree(src.prev)
		}
	}
	st.gpmGIs = nil
	if whole && st.gpm != nil {
		if st.gpm.prev != nil {
			s.lib.GpmSampleFree(st.gpm.prev)
		}
		st.gpm = nil
	}
}

func (s *Sampler) migHandle(st *sampledGPU, uuid string) nvml.Device {
	if d, ok := st.migs[uuid]; ok {
		return d
	}
	d, ret := s.lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil
	}
	st.migs[uuid] = d
	return d
}

// nvmlBusID turns the inventory's sysfs form ("0000:07:00.0") into NVML's
// ("00000000:07:00.0"), which dcgm-exporter's pci_bus_id label carries.
func nvmlBusID(s string) string {
	domain, rest, ok := strings.Cut(s, ":")
	if !ok || len(domain) > 8 {
		return strings.ToUpper(s)
	}
	return strings.ToUpper(strings.Repeat("0", 8-len(domain)) + domain + ":" + rest)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// sampleRun makes the NVML calls of one GPU in one pass.
type sampleRun struct {
	st   *sampledGPU
	log  *slog.Logger
	g    *gpu.GPU
	lost bool
}

// call runs f unless the GPU refused it before or is lost; NOT_SUPPORTED is
// remembered quietly (for every call in bits), other errors are logged at
// debug level and the value is left out of this pass.
func call[T any](r *sampleRun, bits uint32, f func() (T, nvml.Return)) (T, bool) {
	var zero T
	if r.lost || r.st.unsupported&bits == bits {
		return zero, false
	}
	x, ret := f()
	switch ret {
	case nvml.SUCCESS:
		return x, true
	case nvml.ERROR_NOT_SUPPORTED:
		r.st.unsupported |= bits
	case nvml.ERROR_GPU_IS_LOST:
		r.lost = true
	default:
		r.log.Debug("sampling failed", "gpu", r.g.Index, "uuid", r.g.UUID, "call", bits, "error", ret.Error())
	}
	return zero, false
}
