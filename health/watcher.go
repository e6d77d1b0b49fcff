package health

import (
	"context"
	"encoding/binary"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// wantedEvents are the event types the watcher asks for on every GPU.
var wantedEvents = []uint64{
	nvml.EventTypeXidCriticalError,
	nvml.EventTypeDoubleBitEccError,
	nvml.EventTypeSingleBitEccError,
}

// noInstance is NVML's GI/CI id in events that concern the whole GPU.
const noInstance = 0xFFFFFFFF

// WatcherOptions tune a Watcher.
type WatcherOptions struct {
	// Logger receives state changes and NVML trouble; nil discards.
	Logger *slog.Logger
	// Now is the clock for causes and quiet periods (nil: time.Now).
	Now func() time.Time
	// OnChange is called from the watcher's goroutine with each new State;
	// it must not block for long.
	OnChange func(*State)
	// WaitTimeout bounds one wait for NVML events, and so how late the
	// watcher notices ctx, inventory or policy changes (default 1s).
	WaitTimeout time.Duration
	// Restore are causes checkpointed by an earlier agent; each applies
	// when its GPU is found, and clears by the usual evidence. One raised
	// in another boot than BootID's is not restored.
	Restore []SavedCause
	// BootID reads the node's boot id (Linux's
	// /proc/sys/kernel/random/boot_id, or a simulated node's), at start
	// and with every probe; nil or "" means unknown. A reboot clears every
	// cause raised before it: it reset every GPU. Only a simulated node
	// reboots under a running agent; a real one sees the new boot at its
	// next start, against the causes it checkpointed.
	BootID func() string
}

// Watcher turns NVML events and reachability probes into device health.
// Create with NewWatcher, then Run in one goroutine; the other methods are
// safe from any goroutine.
type Watcher struct {
	lib   nvml.Interface
	opts  WatcherOptions
	log   *slog.Logger
	state atomic.Pointer[State]
	// changes is signalled (coalesced) whenever a new State is published.
	changes chan struct{}
	// watched: GPUs registered for events (Watched).
	watched atomic.Pointer[[]string]

	mu         sync.Mutex
	pendInv    *gpu.Inventory
	pendPolicy *Policy
	pendResets []string

	// Owned by Run.
	tr   *tracker
	devs map[string]*watchedGPU
	// byHandle maps the GPU handle in an event to its UUID. A lost GPU cannot
	// be asked for its UUID, and its XID 79 must still be placed.
	byHandle map[nvml.Device]string
}

type watchedGPU struct {
	uuid       string
	index      int
	dev        nvml.Device
	registered uint64 // event types registered
	skipped    uint64 // event types the GPU does not support
	noTemp     bool   // GetTemperature is unsupported: probe with GetMemoryInfo
	noECC      bool
	noAction   bool
	noRemap    bool
	noRetired  bool
	// scanned: the traces of earlier faults were read (tracker.initial).
	scanned bool
}

// NewWatcher returns a watcher for lib (initialised) under policy.
func NewWatcher(lib nvml.Interface, policy Policy, opts WatcherOptions) *Watcher {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.WaitTimeout <= 0 {
		opts.WaitTimeout = time.Second
	}
	w := &Watcher{
		changes: make(chan struct{}, 1),
		lib:     lib, opts: opts, log: opts.Logger,
		tr:   newTracker(policy, opts.Logger),
		devs: map[string]*watchedGPU{}, byHandle: map[nvml.Device]string{},
	}
	w.tr.setBoot(w.bootID(), opts.Now())
	w.tr.restore(opts.Restore)
	w.state.Store(w.tr.state())
	return w
}

func (w *Watcher) bootID() string {
	if w.opts.BootID == nil {
		return ""
	}
	return w.opts.BootID()
}

// SetInventory tells the watcher which GPUs and MIG devices exist; new GPUs
// are registered for events on the watcher's next turn.
func (w *Watcher) SetInventory(inv *gpu.Inventory) {
	w.mu.Lock()
	w.pendInv = inv
	w.mu.Unlock()
}

// SetPolicy replaces the XID policy (a config change).
func (w *Watcher) SetPolicy(p Policy) {
	w.mu.Lock()
	w.pendPolicy = &p
	w.mu.Unlock()
}

// NoteReset tells the watcher the agent reset this GPU (e.g. to apply a MIG
// mode change), which clears its application- and reset-class causes.
func (w *Watcher) NoteReset(gpuUUID string) {
	w.mu.Lock()
	w.pendResets = append(w.pendResets, gpuUUID)
	w.mu.Unlock()
}

// State returns the latest health snapshot; safe from any goroutine.
func (w *Watcher) State() *State { return w.state.Load() }

// Run watches until ctx is done. Without NVML events (EventSetCreate fails)
// it still probes, so a lost GPU is found either way.
func (w *Watcher) Run(ctx context.Context) error {
	set, ret := w.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		w.log.Warn("NVML events unavailable; health relies on probing alone", "error", ret.Error())
		set = nil
	} else {
		defer set.Free()
	}
	waitMs := uint32(w.opts.WaitTimeout / time.Millisecond)
	// Find and register the GPUs before anything else, not when the first
	// inventory arrives: events are only queued for registered GPUs, and
	// the agent's first inventory may wait for its config.
	w.discover()
	var lastProbe time.Time
	for ctx.Err() == nil {
		w.applyPending(set)
		w.scanNew()
		// Published after the scan: a caller that sees a GPU as watched
		// knows its earlier faults were read too, so what it injects next
		// is an event, not a trace the scan also reports.
		w.publishWatched()
		if interval := w.tr.policy.ProbeInterval; time.Since(lastProbe) >= interval {
			if w.tr.setBoot(w.bootID(), w.opts.Now()) {
				// Read again what earlier faults left in NVML: what
				// outlives a reboot (a failed row remapping) is there.
				for _, d := range w.devs {
					d.scanned = false
				}
				w.scanNew()
			}
			w.probeAll()
			lastProbe = time.Now()
		}
		w.tr.tick(w.opts.Now())
		w.publish()
		if set == nil {
			sleep(ctx, w.opts.WaitTimeout)
			continue
		}
		ev, ret := set.Wait(waitMs)
		switch ret {
		case nvml.SUCCESS:
			w.handle(ev)
		case nvml.ERROR_TIMEOUT:
		case nvml.ERROR_GPU_IS_LOST:
			// NVML says a registered GPU is gone before any event says which:
			// probe now rather than at the next interval.
			lastProbe = time.Time{}
		default:
			w.log.Warn("waiting for NVML events failed", "error", ret.Error())
			sleep(ctx, w.opts.WaitTimeout)
		}
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (w *Watcher) publish() {
	if !w.tr.changed {
		return
	}
	w.tr.changed = false
	s := w.tr.state()
	w.state.Store(s)
	if w.opts.OnChange != nil {
		w.opts.OnChange(s)
	}
	select {
	case w.changes <- struct{}{}:
	default: // a signal is pending; the reader takes the latest State anyway
	}
}

// applyPending takes what other goroutines handed in since the last turn.
func (w *Watcher) applyPending(set nvml.EventSet) {
	w.mu.Lock()
	inv, pol, resets := w.pendInv, w.pendPolicy, w.pendResets
	w.pendInv, w.pendPolicy, w.pendResets = nil, nil, nil
	w.mu.Unlock()
	now := w.opts.Now()
	if pol != nil {
		w.tr.setPolicy(*pol, now)
	}
	if inv != nil {
		w.tr.setInventory(inv)
		for _, g := range inv.GPUs {
			d := w.devs[g.UUID]
			if d == nil {
				d = &watchedGPU{uuid: g.UUID}
				w.devs[g.UUID] = d
			}
			d.index = g.Index
		}
	}
	for _, uuid := range resets {
		w.tr.noteReset(uuid, now)
	}
	if set != nil {
		for _, d := range w.devs {
			w.register(set, d)
		}
	}
}

// discover finds the GPUs through NVML itself, so they are registered for
// events (and their checkpointed causes restored) from the first turn.
func (w *Watcher) discover() {
	n, ret := w.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		w.log.Warn("cannot count GPUs; health events start with the first inventory", "error", ret.Error())
		return
	}
	for i := range n {
		dev, ret := w.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue // the inventory reports it; the probe follows it once known
		}
		uuid, ret := dev.GetUUID()
		if ret != nvml.SUCCESS {
			continue
		}
		if _, ok := w.devs[uuid]; !ok {
			w.devs[uuid] = &watchedGPU{uuid: uuid, index: i, dev: dev}
			w.byHandle[dev] = uuid
		}
		w.tr.ensure(uuid, i)
	}
}

// scanNew reads, once per GPU and after its events are registered (so
// nothing falls between the two), what earlier faults left behind.
func (w *Watcher) scanNew() {
	now := w.opts.Now()
	for _, uuid := range slices.Sorted(maps.Keys(w.devs)) {
		d := w.devs[uuid]
		if d.scanned || w.tr.gpu(uuid) == nil {
			continue
		}
		d.scanned = true
		w.tr.initial(uuid, w.probeWith(d, true), now)
	}
}

// publishWatched records the GPUs registered for events (Watched).
func (w *Watcher) publishWatched() {
	watched := make([]string, 0, len(w.devs))
	for _, d := range w.devs {
		if d.registered != 0 {
			watched = append(watched, d.uuid)
		}
	}
	slices.Sort(watched)
	w.watched.Store(&watched)
}

// Changes is signalled after a new State is published; signals coalesce, so
// a reader should take State() when woken.
func (w *Watcher) Changes() <-chan struct{} { return w.changes }

// Watched returns the UUIDs of the GPUs NVML delivers health events for, in
// order; events that happen on a GPU before it is listed here are not seen
// (only the periodic probe catches their effect). Safe from any goroutine.
func (w *Watcher) Watched() []string {
	if p := w.watched.Load(); p != nil {
		return *p
	}
	return nil
}

// handleOf returns the GPU's handle, looking it up again when unknown.
func (w *Watcher) handleOf(d *watchedGPU) (nvml.Device, nvml.Return) {
	if d.dev != nil {
		return d.dev, nvml.SUCCESS
	}
	dev, ret := w.lib.DeviceGetHandleByUUID(d.uuid)
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	d.dev = dev
	w.byHandle[dev] = d.uuid
	return dev, nvml.SUCCESS
}

// register asks for the wanted event types the GPU supports. NVML refuses a
// whole mask if one type in it is unsupported, so on refusal each type is
// tried alone; what a GPU cannot deliver is skipped for that GPU only.
func (w *Watcher) register(set nvml.EventSet, d *watchedGPU) {
	var missing uint64
	for _, t := range wantedEvents {
		if d.registered&t == 0 && d.skipped&t == 0 {
			missing |= t
		}
	}
	if missing == 0 {
		return
	}
	dev, ret := w.handleOf(d)
	if ret != nvml.SUCCESS {
		return // lost or not yet there: the probe reports it; retried next turn
	}
	if sup, ret := dev.GetSupportedEventTypes(); ret == nvml.SUCCESS {
		if skip := missing &^ sup; skip != 0 {
			d.skipped |= skip
			w.log.Info("GPU does not support some health events; skipping them", "gpu", d.index, "uuid", d.uuid, "eventTypes", skip)
		}
		missing &= sup
	}
	if missing == 0 {
		return
	}
	if ret := dev.RegisterEvents(missing, set); ret == nvml.SUCCESS {
		d.registered |= missing
		return
	}
	for _, t := range wantedEvents {
		if missing&t == 0 {
			continue
		}
		switch ret := dev.RegisterEvents(t, set); ret {
		case nvml.SUCCESS:
			d.registered |= t
		case nvml.ERROR_NOT_SUPPORTED:
			d.skipped |= t
			w.log.Info("GPU does not support a health event type; skipping it", "gpu", d.index, "uuid", d.uuid, "eventType", t)
		default:
			w.log.Warn("registering health events failed; retrying later", "gpu", d.index, "uuid", d.uuid, "eventType", t, "error", ret.Error())
		}
	}
}

func instanceID(id uint32) int {
	if id == noInstance {
		return AllInstances
	}
	return int(id)
}

// handle applies one event.
func (w *Watcher) handle(ev nvml.EventData) {
	uuid, ok := w.byHandle[ev.Device]
	if !ok && ev.Device != nil {
		if u, ret := ev.Device.GetUUID(); ret == nvml.SUCCESS {
			uuid, ok = u, true
		}
	}
	if !ok {
		w.log.Warn("NVML event for an unknown device; dropped", "eventType", ev.EventType, "data", ev.EventData)
		return
	}
	gi, ci := instanceID(ev.GpuInstanceId), instanceID(ev.ComputeInstanceId)
	if gi == AllInstances {
		ci = AllInstances
	}
	now := w.opts.Now()
	switch ev.EventType {
	case nvml.EventTypeXidCriticalError:
		w.tr.xid(uuid, ev.EventData, gi, ci, now)
	case nvml.EventTypeDoubleBitEccError:
		w.tr.ecc(uuid, true, gi, ci, now)
	case nvml.EventTypeSingleBitEccError:
		w.tr.ecc(uuid, false, gi, ci, now)
	}
	// Read the reset evidence (ECC count, recovery action) at once: a reset
	// done before the next periodic probe would otherwise leave no trace,
	// and the device would stay unhealthy until the agent restarts.
	if w.tr.wantsResetEvidence(uuid) {
		for _, d := range w.devs {
			if d.uuid == uuid {
				w.tr.probe(uuid, w.probe(d), now)
			}
		}
	}
}

// probeAll checks every known GPU with one cheap call, plus the reset
// evidence where a reset-class cause is waiting for it.
func (w *Watcher) probeAll() {
	now := w.opts.Now()
	for _, d := range w.devs {
		w.tr.probe(d.uuid, w.probe(d), now)
	}
}

func (w *Watcher) probe(d *watchedGPU) probeResult {
	return w.probeWith(d, w.tr.wantsResetEvidence(d.uuid))
}

// probeWith pings the GPU and, when evidence is set, reads the counters that
// show a fault needing a reset, or that one happened.
func (w *Watcher) probeWith(d *watchedGPU, evidence bool) probeResult {
	dev, ret := w.handleOf(d)
	if ret == nvml.SUCCESS {
		ret = w.ping(d, dev)
		if ret == nvml.ERROR_INVALID_ARGUMENT || ret == nvml.ERROR_UNINITIALIZED {
			// A stale handle (the GPU was reset or re-attached): look it up again.
			delete(w.byHandle, d.dev)
			d.dev = nil
			// Event registrations belonged to the old handle: register the
			// new one on the next turn, or its XIDs would go unseen.
			d.registered, d.skipped = 0, 0
			if dev, ret = w.handleOf(d); ret == nvml.SUCCESS {
				ret = w.ping(d, dev)
			}
		}
	}
	var r probeResult
	switch ret {
	case nvml.SUCCESS:
		r.reach = reachOK
	case nvml.ERROR_GPU_IS_LOST:
		r.reach = reachLost
		return r
	case nvml.ERROR_RESET_REQUIRED:
		r.reach = reachResetRequired
		return r
	default:
		w.log.Debug("health probe inconclusive", "gpu", d.index, "uuid", d.uuid, "error", ret.Error())
		r.reach = reachUnknown
		return r
	}
	if !evidence {
		return r
	}
	// Any failure below leaves the fact unknown: a failed read is not a
	// fault (only a confirmed condition marks a device).
	if !d.noECC {
		n, ret := dev.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC)
		switch ret {
		case nvml.SUCCESS:
			r.dbeVolatile, r.dbeKnown = n, true
		case nvml.ERROR_NOT_SUPPORTED:
			d.noECC = true
		}
	}
	if !d.noAction {
		fv := []nvml.FieldValue{{FieldId: nvml.FI_DEV_GET_GPU_RECOVERY_ACTION}}
		ret := dev.GetFieldValues(fv)
		if ret == nvml.SUCCESS {
			ret = nvml.Return(fv[0].NvmlReturn)
		}
		switch ret {
		case nvml.SUCCESS:
			r.action, r.actionKnown = int(binary.NativeEndian.Uint32(fv[0].Value[:4])), true
		case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_INVALID_ARGUMENT:
			d.noAction = true
		}
	}
	if !d.noRemap {
		_, _, pending, failure, ret := dev.GetRemappedRows()
		switch ret {
		case nvml.SUCCESS:
			r.remapPending, r.remapFailure, r.remapKnown = pending, failure, true
		case nvml.ERROR_NOT_SUPPORTED:
			// Pre-Ampere, or refused while MIG is on: not a fault either way.
			d.noRemap = true
		}
	}
	if !d.noRetired {
		st, ret := dev.GetRetiredPagesPendingStatus()
		switch ret {
		case nvml.SUCCESS:
			r.retiredPending, r.retiredKnown = st == nvml.FEATURE_ENABLED, true
		case nvml.ERROR_NOT_SUPPORTED:
			d.noRetired = true
		}
	}
	return r
}

// ping is the cheap call that tells whether the GPU answers.
func (w *Watcher) ping(d *watchedGPU, dev nvml.Device) nvml.Return {
	if !d.noTemp {
		_, ret := dev.GetTemperature(nvml.TEMPERATURE_GPU)
		if ret != nvml.ERROR_NOT_SUPPORTED {
			return ret
		}
		d.noTemp = true
	}
	_, ret := dev.GetMemoryInfo()
	return ret
}
