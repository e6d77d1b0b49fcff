package sim

import (
	"fmt"
	"log/slog"
	"math/rand"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/google/uuid"
)

// Versions a 550-series driver reports.
const (
	driverVersion     = "550.54.15"
	nvmlVersion       = "12.550.54.15"
	cudaDriverVersion = 12040
)

// uuidNamespace roots the name-based (SHA-1) UUIDs of simulated GPUs, so the
// same profile and index always give the same UUID.
var uuidNamespace = uuid.NewSHA1(uuid.NameSpaceURL, []byte("https://gpu-agent.io/sim"))

// Option changes how New builds a node.
type Option func(*options)

type options struct {
	migEnabled   bool
	migImmediate bool
	now          func() time.Time
	statePath    string
	state        []byte
	logger       *slog.Logger
	crashAfter   int
	crash        func()
}

// WithMIGEnabled starts MIG-capable GPUs with MIG mode on (current and
// pending) and no instances. GPUs without MIG ignore it.
func WithMIGEnabled() Option { return func(o *options) { o.migEnabled = true } }

// WithImmediateMIGModeChange makes SetMigMode take effect at once, as on
// bare-metal hosts where the driver can reset the GPU itself; without it a
// change stays pending until Reset.
func WithImmediateMIGModeChange() Option { return func(o *options) { o.migImmediate = true } }

// WithClock sets the clock that advances the energy counter (default time.Now).
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// WithCrashAfter kills the process right after the nth NVML call that
// changed the GPUs (MIG mode, GPU or compute instances) returned, its effect
// already in the state file: a crash at an exact point of a repartition, as
// a power cut or an OOM kill would cause it. crash replaces the kill (nil:
// SIGKILL to this process), for tests in one process.
func WithCrashAfter(n int, crash func()) Option {
	return func(o *options) { o.crashAfter, o.crash = n, crash }
}

// WithLogger sets where the node logs what NVML's return codes cannot say,
// such as why a call failed with ERROR_UNKNOWN (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// Node is a simulated GPU node. It implements nvml.Interface; calls it does
// not model return ERROR_NOT_SUPPORTED. It is safe for concurrent use: all
// state sits behind one mutex.
type Node struct {
	mockInterface
	spec *nodeSpec
	opts options

	// switchPCI is the PCI info of each NVSwitch, as NVLink peers see it.
	switchPCI []nvml.PciInfo

	mu        sync.Mutex
	initCount int
	// mutations counts NVML calls that changed kept state (WithCrashAfter).
	mutations int
	gpus      []*gpuState
	sets      map[*eventSet]struct{}
	store     *stateStore // nil without WithStateFile

	// Injected call failures (FailCalls, SetFlaky); never persisted, as
	// they stand for the driver, not the GPU.
	failures  map[failKey]failure
	flakyRate float64
	flakyRand *rand.Rand

	// gpmLive counts GPM sample buffers not yet freed.
	gpmLive int
	// boot is the boot id (BootID).
	boot string
}

// mockInterface puts the go-nvml mock one level deeper than Node's own
// methods, so those shadow it: the mock records every call in a slice that
// would grow without bound in a long-running agent.
type mockInterface struct{ *mock.Interface }

// gpuState is one physical GPU. Guarded by Node.mu.
type gpuState struct {
	index  int
	uuid   string
	bus    uint32
	pci    nvml.PciInfo
	numa   int
	links  []linkEnd
	handle *device

	lost       bool
	migCurrent bool
	migPending bool
	gis        []*gpuInstance // ordered by id

	gpuUtil, memUtil uint32
	memUsed          uint64
	tempC            uint32
	powerMW          uint32
	energyMJ         float64
	energyAt         time.Time
	// act integrates the load (see telemetry.go) for GPM and the NVLink
	// throughput counters.
	act              activity
	encUtil, decUtil uint32
	pcieReplays      uint32
	smMHz, memMHz    uint32
	ecc              [2][2]uint64 // [MemoryErrorType][EccCounterType]
	// recovery is what FI_DEV_GET_GPU_RECOVERY_ACTION reports (NONE = 0).
	recovery     nvml.DeviceGpuRecoveryAction
	remapCorr    int
	remapUnc     int
	remapPending bool
	remapFailure bool
	procs        []process
}

// New builds the simulated node named profile (see Profiles).
func New(profile string, opts ...Option) (*Node, error) {
	var spec *nodeSpec
	for _, s := range nodeSpecs {
		if s.name == profile {
			spec = s
		}
	}
	if spec == nil {
		names := make([]string, 0, len(nodeSpecs))
		for _, p := range Profiles() {
			names = append(names, p.Name)
		}
		return nil, fmt.Errorf("sim: unknown profile %q (known: %s)", profile, strings.Join(names, ", "))
	}
	o := options{now: time.Now, logger: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	n := &Node{spec: spec, opts: o, sets: map[*eventSet]struct{}{}, failures: map[failKey]failure{}, boot: uuid.NewString()}
	n.Interface = &mock.Interface{}
	fillFuncs(n.Interface, func(string) nvml.Return {
		n.mu.Lock()
		defer n.mu.Unlock()
		if r := n.ready(); r != nvml.SUCCESS {
			return r
		}
		return nvml.ERROR_NOT_SUPPORTED
	})
	forwardHandleFuncs(n.Interface)

	for _, bus := range spec.switchBus {
		n.switchPCI = append(n.switchPCI, pciInfo(bus, spec.switchPCIx, 0))
	}
	links := spec.links(len(spec.bus))
	now := o.now()
	m := spec.model
	for i, bus := range spec.bus {
		g := &gpuState{
			index: i,
			uuid:  "GPU-" + uuid.NewSHA1(uuidNamespace, []byte(spec.name+"/gpu/"+strconv.Itoa(i))).String(),
			bus:   bus, pci: pciInfo(bus, m.pciDeviceID, m.pciSubsystem), numa: spec.numa(i), links: links[i],
			migCurrent: o.migEnabled && m.mig != nil,
			migPending: o.migEnabled && m.mig != nil,
			tempC:      m.idleTempC, powerMW: m.idlePowerMW, energyAt: now,
			smMHz: m.idleSMMHz, memMHz: m.maxMemMHz,
		}
		g.handle = n.newDevice(g, nil)
		n.gpus = append(n.gpus, g)
	}
	var store *stateStore
	saved := o.state
	if o.statePath != "" && o.state != nil {
		return nil, fmt.Errorf("sim %s: a state file and a copied state are exclusive", spec.name)
	}
	if o.statePath != "" {
		var err error
		if store, saved, err = openState(o.statePath); err != nil {
			return nil, fmt.Errorf("sim %s: state file %s: %w", spec.name, o.statePath, err)
		}
	}
	switch {
	case saved != nil:
		if err := n.load(saved); err != nil {
			store.close()
			if o.statePath == "" {
				return nil, fmt.Errorf("sim %s: copied state: %w", spec.name, err)
			}
			return nil, fmt.Errorf("sim %s: state file %s: %w", spec.name, o.statePath, err)
		}
	case spec.migLayout != nil:
		if err := n.createLayout(spec.migLayout); err != nil {
			store.close()
			return nil, fmt.Errorf("sim %s: %w", spec.name, err)
		}
	}
	// Set only now: the layout above is the starting point, written once,
	// not a series of changes.
	n.store = store
	if store != nil && saved != nil {
		// What persist would write, so that only real changes rewrite it.
		n.store.written = saved
	}
	if err := n.persist(); err != nil {
		store.close()
		return nil, fmt.Errorf("sim %s: %w", spec.name, err)
	}
	return n, nil
}

// createLayout turns MIG on and creates the GPU instances of layout, each
// with its full compute instance, on every GPU, through the node's NVML API
// so that they obey the same rules as instances made later.
func (n *Node) createLayout(layout []int) error {
	for _, g := range n.gpus {
		g.migCurrent, g.migPending = true, true
	}
	n.Init()
	defer n.Shutdown()
	ciProfile := map[uint32]int{1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
		3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, 7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE}
	for _, g := range n.gpus {
		for _, p := range layout {
			info, r := g.handle.GetGpuInstanceProfileInfo(p)
			if r != nvml.SUCCESS {
				return fmt.Errorf("gpu %d: profile %d: %v", g.index, p, r)
			}
			gi, r := g.handle.CreateGpuInstance(&info)
			if r != nvml.SUCCESS {
				return fmt.Errorf("gpu %d: create profile %d: %v", g.index, p, r)
			}
			ci, r := gi.GetComputeInstanceProfileInfo(ciProfile[info.SliceCount], nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if r != nvml.SUCCESS {
				return fmt.Errorf("gpu %d: compute profile for %d slices: %v", g.index, info.SliceCount, r)
			}
			if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
				return fmt.Errorf("gpu %d: create compute instance: %v", g.index, r)
			}
		}
	}
	return nil
}

// Profile returns the name of the profile the node was built from.
func (n *Node) Profile() string { return n.spec.name }

// ready reports why NVML calls fail before Init and after the last Shutdown.
// Callers hold n.mu.
func (n *Node) ready() nvml.Return {
	if n.initCount == 0 {
		return nvml.ERROR_UNINITIALIZED
	}
	return nvml.SUCCESS
}

// Init counts references as NVML does: each Init needs its own Shutdown.
func (n *Node) Init() nvml.Return {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.initCount++
	return nvml.SUCCESS
}

// InitWithFlags is Init; the flags change nothing on a simulated node.
func (n *Node) InitWithFlags(uint32) nvml.Return { return n.Init() }

// Shutdown drops one Init reference.
func (n *Node) Shutdown() nvml.Return {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.initCount == 0 {
		return nvml.ERROR_UNINITIALIZED
	}
	n.initCount--
	return nvml.SUCCESS
}

// Extensions answers symbol lookups: every symbol of the simulated 550
// driver's NVML exists.
func (n *Node) Extensions() nvml.ExtendedInterface {
	return &mock.ExtendedInterface{LookupSymbolFunc: func(string) error { return nil }}
}

// ErrorString returns NVML's name for r.
func (n *Node) ErrorString(r nvml.Return) string { return r.Error() }

// SystemGetDriverVersion returns the simulated driver's version.
func (n *Node) SystemGetDriverVersion() (string, nvml.Return) {
	return n.systemString(driverVersion)
}

// SystemGetNVMLVersion returns the simulated NVML library's version.
func (n *Node) SystemGetNVMLVersion() (string, nvml.Return) {
	return n.systemString(nvmlVersion)
}

func (n *Node) systemString(s string) (string, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return "", r
	}
	return s, nvml.SUCCESS
}

// SystemGetCudaDriverVersion returns the CUDA version the driver supports (12.4).
func (n *Node) SystemGetCudaDriverVersion() (int, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return 0, r
	}
	return cudaDriverVersion, nvml.SUCCESS
}

// SystemGetCudaDriverVersion_v2 is SystemGetCudaDriverVersion.
func (n *Node) SystemGetCudaDriverVersion_v2() (int, nvml.Return) {
	return n.SystemGetCudaDriverVersion()
}

// DeviceGetCount counts lost GPUs too, as NVML does.
func (n *Node) DeviceGetCount() (int, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return 0, r
	}
	return len(n.gpus), nvml.SUCCESS
}

// DeviceGetHandleByIndex returns GPU index's handle; a lost GPU gives no
// handle and ERROR_GPU_IS_LOST.
func (n *Node) DeviceGetHandleByIndex(index int) (nvml.Device, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return nil, r
	}
	if index < 0 || index >= len(n.gpus) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return n.handleOf(n.gpus[index])
}

func (n *Node) handleOf(g *gpuState) (nvml.Device, nvml.Return) {
	if g.lost {
		return nil, nvml.ERROR_GPU_IS_LOST
	}
	return g.handle, nvml.SUCCESS
}

// DeviceGetHandleByUUID accepts GPU and MIG device UUIDs.
func (n *Node) DeviceGetHandleByUUID(id string) (nvml.Device, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return nil, r
	}
	if id == "" {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	for _, g := range n.gpus {
		if g.uuid == id {
			return n.handleOf(g)
		}
		for _, gi := range g.gis {
			for _, ci := range gi.cis {
				if ci.dev.uuid == id {
					if g.lost {
						return nil, nvml.ERROR_GPU_IS_LOST
					}
					return ci.dev, nvml.SUCCESS
				}
			}
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

// DeviceGetHandleByPciBusId accepts the forms NVML documents, in hex and any
// case: domain:bus:device.function, domain:bus:device and bus:device.function.
func (n *Node) DeviceGetHandleByPciBusId(id string) (nvml.Device, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return nil, r
	}
	domain, bus, dev, fn, ok := parseBusID(id)
	if !ok {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	for _, g := range n.gpus {
		if domain == 0 && bus == g.bus && dev == 0 && fn == 0 {
			return n.handleOf(g)
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

// parseBusID reads the forms nvmlDeviceGetHandleByPciBusId accepts; a
// missing function means function 0.
func parseBusID(s string) (domain, bus, dev, fn uint32, ok bool) {
	hex := func(p string, bits int) uint32 {
		v, err := strconv.ParseUint(p, 16, bits)
		if err != nil {
			ok = false
		}
		return uint32(v)
	}
	ok = true
	parts := strings.Split(strings.TrimSpace(s), ":")
	var devFn string
	switch len(parts) {
	case 3:
		domain, bus, devFn = hex(parts[0], 32), hex(parts[1], 8), parts[2]
	case 2:
		if !strings.Contains(parts[1], ".") {
			return 0, 0, 0, 0, false
		}
		bus, devFn = hex(parts[0], 8), parts[1]
	default:
		return 0, 0, 0, 0, false
	}
	d, f, hasFn := strings.Cut(devFn, ".")
	dev = hex(d, 5)
	if hasFn {
		fn = hex(f, 3)
	}
	return domain, bus, dev, fn, ok
}

// EventSetCreate returns an empty event set; see RegisterEvents on a device.
func (n *Node) EventSetCreate() (nvml.EventSet, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return nil, r
	}
	s := newEventSet(n)
	n.sets[s] = struct{}{}
	return s, nvml.SUCCESS
}

// EventSetWait is set.Wait.
func (n *Node) EventSetWait(set nvml.EventSet, timeoutMs uint32) (nvml.EventData, nvml.Return) {
	if set == nil {
		return nvml.EventData{}, nvml.ERROR_INVALID_ARGUMENT
	}
	return set.Wait(timeoutMs)
}

// EventSetFree is set.Free.
func (n *Node) EventSetFree(set nvml.EventSet) nvml.Return {
	if set == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return set.Free()
}

// gpu returns GPU i for the fault-injection methods.
func (n *Node) gpu(i int) (*gpuState, error) {
	if i < 0 || i >= len(n.gpus) {
		return nil, fmt.Errorf("sim %s: gpu %d out of range (node has %d GPUs)", n.spec.name, i, len(n.gpus))
	}
	return n.gpus[i], nil
}

// pciInfo renders NVML's two bus id forms ("00000000:07:00.0", "0000:07:00.0").
func pciInfo(bus, deviceID, subsystem uint32) nvml.PciInfo {
	p := nvml.PciInfo{Bus: bus, PciDeviceId: deviceID, PciSubSystemId: subsystem}
	copyCString(p.BusId[:], fmt.Sprintf("%08X:%02X:00.0", 0, bus))
	copyCString(p.BusIdLegacy[:], fmt.Sprintf("%04X:%02X:00.0", 0, bus))
	return p
}

func copyCString(dst []int8, s string) {
	for i := 0; i < len(s) && i < len(dst)-1; i++ {
		dst[i] = int8(s[i])
	}
}
