package telemetry

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/usage"
)

// Sources the HolderTracker reads besides NVML.
type (
	// OwnerResolver finds the pod and container of a host PID: a
	// usage.Resolver over the host's /proc, on a simulated node the sim's
	// own cgroups first.
	OwnerResolver interface {
		Resolve(pid uint32) (usage.Owner, error)
		// Retain forgets the PIDs live does not hold.
		Retain(live func(pid uint32) bool)
	}
	// PodSource returns the index of the node's Pods, nil until it has
	// one (no API server, or the watch not synced yet).
	PodSource interface{ PodIndex() *usage.PodIndex }
	// HolderSource is the HolderTracker, for the Collector.
	HolderSource interface{ Holders() *HolderSnapshot }
)

// HolderOptions wire a HolderTracker; Attribution is needed for any holder.
type HolderOptions struct {
	Owners      OwnerResolver
	Pods        PodSource
	Attribution AttributionSource
	// DRA attributes devices held through DRA claims (nil: none are).
	DRA DRASource
	// Catalog gives the MPS active-thread limit of device-plugin replicas
	// (nil: none known).
	Catalog CatalogSource
	// Samples gives device-level utilization, which is the holder's own
	// on a device it holds alone where NVML has no per-process figures
	// (a MIG device). Optional.
	Samples SampleSource
	// StatePath is the file the holders' last use and averages survive a
	// restart in; "" keeps nothing.
	StatePath string
	// Interval between passes (default 10s).
	Interval time.Duration
	Now      func() time.Time
	Logger   *slog.Logger
	// IdleAfter returns how long a holder must not have used its device
	// before OnIdle is called for it (0: never); asked at every pass, as
	// the config in force changes.
	IdleAfter func() time.Duration
	// OnIdle is called once per idle spell of a holder on a device, from
	// the tracker's goroutine: it must not block.
	OnIdle func(HolderUse)
	// OnPass is called after each pass is published (an Exposition's
	// Kick); it must not block.
	OnPass func()
}

// HolderSnapshot is one pass of a HolderTracker; immutable once published.
type HolderSnapshot struct {
	Time    time.Time   `json:"time"`
	Holders []HolderUse `json:"holders"`
}

// HolderClaim is the DRA claim a holder holds its device through.
type HolderClaim struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Driver    string `json:"driver"`
	Pool      string `json:"pool"`
	Device    string `json:"device"`
}

// HolderUse is how one holder (a container, or a container's DRA claim)
// used one GPU or MIG device in the last pass, and since.
type HolderUse struct {
	GPU     int    `json:"gpu"`
	GPUUUID string `json:"gpuUUID"`
	// Device is the UUID of the GPU or MIG device held.
	Device     string       `json:"device"`
	MIGProfile string       `json:"migProfile,omitempty"`
	GI         int          `json:"gi"` // GPU instance id; -1 on a whole GPU
	Namespace  string       `json:"namespace"`
	Pod        string       `json:"pod"`
	Container  string       `json:"container"`
	Claim      *HolderClaim `json:"claim,omitempty"`
	// Sharers is how many holders the device has, this one included.
	Sharers int `json:"sharers"`
	// Attributed: the pass could tell whose each process is (host /proc
	// and the node's Pods were readable); without, Processes, FBBytes and
	// per-process figures are 0 for want of knowing, not of use.
	Attributed bool `json:"attributed"`
	Processes  int  `json:"processes"`
	MPS        bool `json:"mps,omitempty"`
	// MPSThreadLimit is the holder's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE on
	// a device shared by MPS (its replica's, or its claim's share); 0
	// elsewhere.
	MPSThreadLimit int `json:"mpsActiveThreadPercent,omitempty"`
	// MPSLimitUsed is SM as a % of MPSThreadLimit, with UtilKnown. Not
	// capped: NVML's SM % is the part of the time the holder's kernels
	// ran, the limit a part of the SMs they may take at once, so a client
	// that runs all the time reads over 100 (25% limit, 60% SM: 240).
	MPSLimitUsed float64 `json:"mpsLimitUsedPercent,omitempty"`
	// FBBytes is the framebuffer the holder's processes hold.
	FBBytes uint64 `json:"fbBytes"`
	// UtilKnown says whether SM is known: from NVML's per-process samples
	// (PerProcess, which give Mem, Enc and Dec too), from the device's own
	// figure where the holder is its only one, or 0 where no process runs.
	UtilKnown  bool `json:"utilKnown"`
	PerProcess bool `json:"perProcess"`
	// SM, Mem (memory bandwidth), Enc and Dec are %, the sum over the
	// holder's processes of the means of their samples since the last
	// pass, at most 100.
	SM  float64 `json:"smPercent"`
	Mem float64 `json:"memPercent"`
	Enc float64 `json:"encPercent"`
	Dec float64 `json:"decPercent"`
	// LastActive is when the holder last used the device as far as the
	// agent knows (across restarts); zero if never seen to.
	LastActive time.Time `json:"lastActive,omitzero"`
	// IdleSeconds is the time since LastActive, or since the agent first
	// saw the holder when it never was; only with UtilKnown.
	IdleSeconds float64 `json:"idleSeconds"`
	// SMAvg is the mean SM % over the time held within each window
	// ("1h", "24h"), to within a bucket (5 min).
	SMAvg map[string]float64 `json:"smAvgPercent,omitempty"`

	series seriesHolder
}

// Windows of HolderUse.SMAvg.
var holderWindows = [...]struct {
	name string
	span time.Duration
}{{"1h", time.Hour}, {"24h", 24 * time.Hour}}

// holderSaveEvery is how often the state file is written when no holder
// came or went: a crash loses at most this much of the averages.
const holderSaveEvery = 5 * time.Minute

// HolderTracker samples the processes on each GPU and MIG device, finds
// the holder each runs for, and keeps per holder and device its use: the
// figures of the last pass, when it last used the device, and its average
// SM utilization over an hour and a day, kept across restarts in a state
// file. A holder's record ends with it. Each pass is published as a
// HolderSnapshot for the Collector and /holders; a scrape never waits for
// NVML or /proc.
type HolderTracker struct {
	opts  HolderOptions
	procs *usage.Sampler

	mu      sync.Mutex
	pendInv *gpu.Inventory
	kick    chan struct{}

	// passMu serialises passes; it guards what follows.
	passMu   sync.Mutex
	inv      *gpu.Inventory
	state    map[holderKey]*holderState
	lastPass time.Time
	lastSave time.Time
	dirty    bool

	snap    atomic.Pointer[HolderSnapshot]
	saveErr atomic.Pointer[error]
}

// holderKey is one holder on one device.
type holderKey struct {
	device string
	h      seriesHolder
}

// holderState is what is kept of a holder on a device between passes.
type holderState struct {
	firstSeen, lastActive time.Time
	// notified is when OnIdle was last called for it; zero if never.
	notified time.Time
	win      window
}

// since is when the holder's current idle spell began.
func (s *holderState) since() time.Time {
	if s.lastActive.After(s.firstSeen) {
		return s.lastActive
	}
	return s.firstSeen
}

// NewHolderTracker returns a tracker reading processes through lib
// (initialised), with the state StatePath holds, if any: a state file
// that cannot be read is logged and the tracker starts afresh.
func NewHolderTracker(lib nvml.Interface, opts HolderOptions) *HolderTracker {
	if opts.Interval <= 0 {
		opts.Interval = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	t := &HolderTracker{opts: opts, procs: usage.NewSampler(lib), state: map[holderKey]*holderState{}, kick: make(chan struct{}, 1)}
	t.snap.Store(&HolderSnapshot{})
	if opts.StatePath != "" {
		st, err := loadHolderState(opts.StatePath)
		if err != nil {
			opts.Logger.Warn("holder state not restored; idle times and averages start afresh", "path", opts.StatePath, "error", err)
		}
		if st != nil {
			t.state = st
		}
	}
	return t
}

// SetInventory sets the GPUs and MIG devices to sample from the next pass on.
func (t *HolderTracker) SetInventory(inv *gpu.Inventory) {
	t.mu.Lock()
	t.pendInv = inv
	t.mu.Unlock()
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

// Holders returns the latest pass; safe from any goroutine.
func (t *HolderTracker) Holders() *HolderSnapshot { return t.snap.Load() }

// SaveError is why the state file could not be written last time; nil
// when it was (or none is kept).
func (t *HolderTracker) SaveError() error {
	if p := t.saveErr.Load(); p != nil {
		return *p
	}
	return nil
}

// Run passes every Interval until ctx is done, then saves the state.
func (t *HolderTracker) Run(ctx context.Context) error {
	tick := time.NewTicker(t.opts.Interval)
	defer tick.Stop()
	for {
		t.Pass()
		select {
		case <-ctx.Done():
			t.passMu.Lock()
			t.save(t.opts.Now())
			t.passMu.Unlock()
			return nil
		case <-tick.C:
		case <-t.kick:
		}
	}
}

// owned is a process with the workload it runs in, if known.
type owned struct {
	usage.ProcessSample
	w     usage.Workload
	known bool
}

// heldDevice is a GPU or MIG device that may have holders.
type heldDevice struct {
	gpu        *gpu.GPU
	uuid       string
	migProfile string
	gi         int
	// devSM is the device's own utilization (%), where sampled.
	devSM    float64
	hasDevSM bool
}

// Pass samples the processes now, attributes them and publishes the pass.
func (t *HolderTracker) Pass() {
	t.passMu.Lock()
	defer t.passMu.Unlock()
	t.mu.Lock()
	if t.pendInv != nil {
		t.inv, t.pendInv = t.pendInv, nil
	}
	t.mu.Unlock()
	if t.inv == nil {
		return
	}
	now := t.opts.Now()
	samples, sampleErr := t.procs.Sample(t.inv)
	if sampleErr != nil {
		t.opts.Logger.Debug("process sampling", "error", sampleErr)
	}
	byDevice, attributed := t.owners(samples)

	attr := t.attribution()
	holders := newHoldersOf(attr, t.opts.DRA)
	// Time since the last pass counts towards the averages only while the
	// agent was running: a gap (a restart, a stalled pass) is not held
	// time anyone can be blamed for.
	dt := now.Sub(t.lastPass)
	if t.lastPass.IsZero() || dt < 0 || dt > 3*t.opts.Interval {
		dt = 0
	}
	t.lastPass = now
	var idleAfter time.Duration
	if t.opts.IdleAfter != nil {
		idleAfter = t.opts.IdleAfter()
	}

	limits := mpsThreadLimits(t.catalog())
	seen := map[holderKey]bool{}
	var uses []HolderUse
	for _, d := range t.devices() {
		hs := holders.series(d.uuid)
		if len(hs) == 0 {
			continue
		}
		procs := byDevice[d.uuid]
		perProcess := slices.ContainsFunc(procs, func(p owned) bool { return p.HasUtil })
		for _, h := range hs {
			u := t.use(d, h, hs, procs, perProcess && attributed, sampleErr == nil, now)
			u.Attributed = attributed
			k := holderKey{d.uuid, h}
			u.MPSThreadLimit = limits[d.uuid]
			if h.claim != (podresources.DRAHold{}) {
				u.MPSThreadLimit = holders.mpsLimits[k]
			}
			if u.MPSThreadLimit > 0 && u.UtilKnown {
				u.MPSLimitUsed = u.SM * 100 / float64(u.MPSThreadLimit)
			}
			seen[k] = true
			st := t.state[k]
			if st == nil {
				st = &holderState{firstSeen: now}
				t.state[k] = st
				t.dirty = true
			}
			if u.LastActive.After(st.lastActive) && !u.LastActive.After(now) {
				st.lastActive = u.LastActive
			}
			if u.UtilKnown && dt > 0 {
				st.win.add(now, dt, u.SM)
			}
			u.LastActive = st.lastActive
			if u.UtilKnown {
				u.IdleSeconds = max(0, now.Sub(st.since()).Seconds())
			}
			for _, w := range holderWindows {
				if avg, ok := st.win.avg(now, w.span); ok {
					if u.SMAvg == nil {
						u.SMAvg = map[string]float64{}
					}
					u.SMAvg[w.name] = avg
				}
			}
			if idleAfter > 0 && u.UtilKnown && now.Sub(st.since()) >= idleAfter && st.notified.Before(st.since()) && t.opts.OnIdle != nil {
				st.notified = now
				t.dirty = true
				t.opts.OnIdle(u)
			}
			uses = append(uses, u)
		}
	}
	// Without an answer from the kubelet nobody is known to have ended:
	// the records wait for one (the first after a restart among them).
	if attr != nil {
		for k := range t.state {
			if !seen[k] {
				delete(t.state, k)
				t.dirty = true
			}
		}
	}
	slices.SortFunc(uses, func(a, b HolderUse) int {
		return cmp.Or(cmp.Compare(a.GPU, b.GPU), cmp.Compare(a.GI, b.GI), cmp.Compare(a.Device, b.Device), a.series.compare(b.series))
	})
	t.snap.Store(&HolderSnapshot{Time: now, Holders: uses})
	if t.opts.OnPass != nil {
		t.opts.OnPass()
	}
	if t.dirty || now.Sub(t.lastSave) >= holderSaveEvery {
		t.save(now)
	}
}

func (t *HolderTracker) catalog() *catalog.Catalog {
	if t.opts.Catalog == nil {
		return nil
	}
	return t.opts.Catalog.Catalog()
}

// mpsThreadLimits maps each device the catalog shares by MPS to its
// replicas' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (one daemon per device, so
// one limit for all of them).
func mpsThreadLimits(cat *catalog.Catalog) map[string]int {
	out := map[string]int{}
	if cat == nil {
		return out
	}
	for _, r := range cat.Resources {
		for _, d := range r.Devices {
			if !d.Replica {
				continue
			}
			if pct, err := strconv.Atoi(d.Spec.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]); err == nil && pct > 0 {
				out[d.Spec.VisibleID] = pct
			}
		}
	}
	return out
}

func (t *HolderTracker) attribution() *podresources.Attribution {
	if t.opts.Attribution == nil {
		return nil
	}
	return t.opts.Attribution.Attribution()
}

// owners finds each process's workload, by device, and says whether it
// could.
func (t *HolderTracker) owners(samples []usage.ProcessSample) (map[string][]owned, bool) {
	var idx *usage.PodIndex
	if t.opts.Pods != nil {
		idx = t.opts.Pods.PodIndex()
	}
	byDevice := map[string][]owned{}
	for _, s := range samples {
		o := owned{ProcessSample: s}
		if t.opts.Owners != nil && idx != nil {
			if own, err := t.opts.Owners.Resolve(s.PID); err == nil {
				o.w, o.known = idx.Lookup(own)
			}
		}
		byDevice[s.Device] = append(byDevice[s.Device], o)
	}
	if t.opts.Owners != nil {
		live := make(map[uint32]bool, len(samples))
		for _, s := range samples {
			live[s.PID] = true
		}
		t.opts.Owners.Retain(func(pid uint32) bool { return live[pid] })
	}
	return byDevice, t.opts.Owners != nil && idx != nil
}

// devices lists the devices a holder can hold: each GPU with MIG off, each
// MIG device of the others, with the device-level SM figure the Sampler
// has for it.
func (t *HolderTracker) devices() []heldDevice {
	var snap *Snapshot
	if t.opts.Samples != nil {
		snap = t.opts.Samples.Snapshot()
	}
	sampled := map[string]*GPUSample{}
	if snap != nil {
		for i := range snap.GPUs {
			sampled[snap.GPUs[i].UUID] = &snap.GPUs[i]
		}
	}
	var out []heldDevice
	for i := range t.inv.GPUs {
		g := &t.inv.GPUs[i]
		gs := sampled[g.UUID]
		if !g.MIG.Current {
			d := heldDevice{gpu: g, uuid: g.UUID, gi: -1}
			if gs != nil && !gs.Lost {
				d.devSM, d.hasDevSM = gs.Values.Get(FieldGPUUtil)
			}
			out = append(out, d)
			continue
		}
		for _, in := range g.Instances {
			d := heldDevice{gpu: g, uuid: in.UUID, migProfile: in.Profile, gi: in.GI}
			if gs != nil {
				for _, ms := range gs.Instances {
					if ms.UUID == in.UUID {
						// GPM's engine activity of the GPU instance (Hopper
						// and newer), a ratio.
						if v, ok := ms.Values.Get(FieldGrEngineActive); ok {
							d.devSM, d.hasDevSM = v*100, true
						}
					}
				}
			}
			out = append(out, d)
		}
	}
	return out
}

// use sums the processes of holder h on device d. A process whose
// container the pod's status does not list yet counts for the pod's first
// holder on the device. perProcess: NVML gave per-process utilization on
// the device and the processes could be attributed; listed: every device's
// processes were listed.
func (t *HolderTracker) use(d heldDevice, h seriesHolder, all []seriesHolder, procs []owned, perProcess, listed bool, now time.Time) HolderUse {
	u := HolderUse{GPU: d.gpu.Index, GPUUUID: d.gpu.UUID, Device: d.uuid, MIGProfile: d.migProfile, GI: d.gi,
		Namespace: h.Namespace, Pod: h.Pod, Container: h.Container, Sharers: len(all), series: h}
	if h.claim != (podresources.DRAHold{}) {
		u.Claim = &HolderClaim{Namespace: h.claim.ClaimNamespace, Name: h.claim.ClaimName, Driver: h.claim.Driver, Pool: h.claim.Pool, Device: h.claim.Device}
	}
	firstOfPod := func(ns, pod string) seriesHolder {
		i := slices.IndexFunc(all, func(s seriesHolder) bool { return s.Namespace == ns && s.Pod == pod })
		return all[i]
	}
	for _, p := range procs {
		if !p.known || p.w.Namespace != h.Namespace || p.w.Pod != h.Pod {
			continue
		}
		if p.w.Container != h.Container && (p.w.Container != "" || firstOfPod(h.Namespace, h.Pod) != h) {
			continue
		}
		u.Processes++
		u.MPS = u.MPS || p.MPS
		u.FBBytes += p.MemoryBytes
		u.SM += p.SM
		u.Mem += p.Mem
		u.Enc += p.Enc
		u.Dec += p.Dec
		if p.LastActive.After(u.LastActive) {
			u.LastActive = p.LastActive
		}
	}
	u.SM, u.Mem, u.Enc, u.Dec = min(u.SM, 100), min(u.Mem, 100), min(u.Enc, 100), min(u.Dec, 100)
	switch {
	case perProcess:
		u.UtilKnown, u.PerProcess = true, true
	case len(procs) == 0 && listed:
		// No process on the device: nobody used it.
		u.UtilKnown = true
	case len(all) == 1 && d.hasDevSM:
		// The device's figure is its one holder's.
		u.UtilKnown, u.SM = true, min(d.devSM, 100)
		if d.devSM > 0 {
			u.LastActive = now
		}
	}
	return u
}
