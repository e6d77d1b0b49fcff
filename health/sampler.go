package health

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Field is one sampled value of a GPU or MIG device.
type Field int

// Sampled fields. Units are dcgm-exporter's: %, MiB, °C, W, mJ, MHz, counts.
const (
	FieldGPUUtil Field = iota
	FieldMemCopyUtil
	FieldFBUsed
	FieldFBFree
	FieldGPUTemp
	FieldPower
	FieldEnergy
	FieldSMClock
	FieldMemClock
	FieldECCSBEVolatile
	FieldECCDBEVolatile
	FieldECCSBEAggregate
	FieldECCDBEAggregate
	FieldRemappedCorrectable
	FieldRemappedUncorrectable
	FieldRemapFailure
	FieldRemapPending
	numFields
)

// Values holds sampled fields; a field NVML could not give is absent, never 0.
type Values struct {
	v   [numFields]float64
	has uint32
}

// Get returns a field and whether it was sampled.
func (v *Values) Get(f Field) (float64, bool) { return v.v[f], v.has&(1<<f) != 0 }

func (v *Values) set(f Field, x float64) { v.v[f], v.has = x, v.has|1<<f }

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
// instance (framebuffer only; the rest exists only for the whole GPU).
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
}

// Sampler reads telemetry from NVML into a cache on its own schedule, so a
// scrape costs the same however many scrapers there are and never waits for
// the driver. NVML calls a GPU answers NOT_SUPPORTED are remembered and not
// repeated until the GPU's MIG layout changes.
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
	passMu sync.Mutex
	inv    *gpu.Inventory
	state  map[string]*sampledGPU
}

type sampledGPU struct {
	dev         nvml.Device
	migs        map[string]nvml.Device
	layout      string // MIG mode and instances; a change resets unsupported
	unsupported uint32 // bit per call (not per field)
}

// Calls whose NOT_SUPPORTED is remembered, as bits of sampledGPU.unsupported.
const (
	callUtil = 1 << iota
	callMem
	callTemp
	callPower
	callEnergy
	callSMClock
	callMemClock
	callECC
	callRemap
	callMIGMem
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
	s := &Sampler{lib: lib, opts: opts, state: map[string]*sampledGPU{}, kick: make(chan struct{}, 1)}
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
	for _, g := range s.inv.GPUs {
		snap.GPUs = append(snap.GPUs, s.sampleGPU(g))
	}
	s.snap.Store(snap)
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

func (s *Sampler) sampleGPU(g gpu.GPU) GPUSample {
	out := GPUSample{Index: g.Index, UUID: g.UUID, Name: g.Name, PCIBusID: nvmlBusID(g.PCIBusID), Minor: g.Minor, MIG: g.MIG}
	st := s.state[g.UUID]
	if st == nil {
		st = &sampledGPU{migs: map[string]nvml.Device{}}
		s.state[g.UUID] = st
	}
	if key := layoutKey(g); key != st.layout {
		// NVML's answers depend on the MIG layout (utilization and remapped
		// rows are refused while MIG instances exist): ask again.
		st.layout, st.unsupported = key, 0
		st.migs = map[string]nvml.Device{}
	}
	if st.dev == nil {
		dev, ret := s.lib.DeviceGetHandleByUUID(g.UUID)
		if ret != nvml.SUCCESS {
			out.Lost = ret == nvml.ERROR_GPU_IS_LOST
			s.opts.Logger.Debug("sampling: no handle", "gpu", g.Index, "uuid", g.UUID, "error", ret.Error())
			return out
		}
		st.dev = dev
	}
	r := sampleRun{st: st, log: s.opts.Logger, g: &g}
	dev := st.dev
	v := &out.Values
	if u, ok := call(&r, callUtil, func() (nvml.Utilization, nvml.Return) { return dev.GetUtilizationRates() }); ok {
		v.set(FieldGPUUtil, float64(u.Gpu))
		v.set(FieldMemCopyUtil, float64(u.Memory))
	}
	if m, ok := call(&r, callMem, func() (nvml.Memory, nvml.Return) { return dev.GetMemoryInfo() }); ok {
		v.set(FieldFBUsed, float64(m.Used>>20))
		v.set(FieldFBFree, float64(m.Free>>20))
	}
	if x, ok := call(&r, callTemp, func() (uint32, nvml.Return) { return dev.GetTemperature(nvml.TEMPERATURE_GPU) }); ok {
		v.set(FieldGPUTemp, float64(x))
	}
	if x, ok := call(&r, callPower, func() (uint32, nvml.Return) { return dev.GetPowerUsage() }); ok {
		v.set(FieldPower, float64(x)/1000)
	}
	if x, ok := call(&r, callEnergy, func() (uint64, nvml.Return) { return dev.GetTotalEnergyConsumption() }); ok {
		v.set(FieldEnergy, float64(x))
	}
	if x, ok := call(&r, callSMClock, func() (uint32, nvml.Return) { return dev.GetClockInfo(nvml.CLOCK_SM) }); ok {
		v.set(FieldSMClock, float64(x))
	}
	if x, ok := call(&r, callMemClock, func() (uint32, nvml.Return) { return dev.GetClockInfo(nvml.CLOCK_MEM) }); ok {
		v.set(FieldMemClock, float64(x))
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
		if x, ok := call(&r, callECC, func() (uint64, nvml.Return) { return dev.GetTotalEccErrors(e.typ, e.cnt) }); ok {
			v.set(e.f, float64(x))
		}
	}
	type remap struct {
		corr, unc        int
		pending, failure bool
	}
	if x, ok := call(&r, callRemap, func() (remap, nvml.Return) {
		c, u, p, f, ret := dev.GetRemappedRows()
		return remap{c, u, p, f}, ret
	}); ok {
		v.set(FieldRemappedCorrectable, float64(x.corr))
		v.set(FieldRemappedUncorrectable, float64(x.unc))
		v.set(FieldRemapFailure, b2f(x.failure))
		v.set(FieldRemapPending, b2f(x.pending))
	}
	if r.lost {
		out.Lost, out.Values = true, Values{}
		st.dev = nil // look the handle up again once the GPU is back
		return out
	}
	if len(g.Instances) > 0 {
		out.Instances = make([]MIGSample, 0, len(g.Instances))
	}
	for _, in := range g.Instances {
		ms := MIGSample{UUID: in.UUID, Profile: in.Profile, GI: in.GI, CI: in.CI}
		if st.unsupported&callMIGMem == 0 {
			if mdev := s.migHandle(st, in.UUID); mdev != nil {
				if m, ok := call(&r, callMIGMem, func() (nvml.Memory, nvml.Return) { return mdev.GetMemoryInfo() }); ok {
					ms.Values.set(FieldFBUsed, float64(m.Used>>20))
					ms.Values.set(FieldFBFree, float64(m.Free>>20))
				} else {
					delete(st.migs, in.UUID) // maybe destroyed: look it up again next time
				}
			}
		}
		out.Instances = append(out.Instances, ms)
	}
	return out
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
// remembered quietly, other errors are logged at debug level and the value
// is left out of this pass.
func call[T any](r *sampleRun, bit uint32, f func() (T, nvml.Return)) (T, bool) {
	var zero T
	if r.lost || r.st.unsupported&bit != 0 {
		return zero, false
	}
	x, ret := f()
	switch ret {
	case nvml.SUCCESS:
		return x, true
	case nvml.ERROR_NOT_SUPPORTED:
		r.st.unsupported |= bit
	case nvml.ERROR_GPU_IS_LOST:
		r.lost = true
	default:
		r.log.Debug("sampling failed", "gpu", r.g.Index, "uuid", r.g.UUID, "call", bit, "error", ret.Error())
	}
	return zero, false
}
