// Package agent is gpu-agent's reconcile loop: one goroutine owns the node's
// state and turns inputs (config changed, resync tick, health changed) into an
// observe → plan → publish pass. Everything else reads immutable snapshots it
// publishes.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
)

// Publisher serves a catalog (the plugin manager).
type Publisher interface {
	Update(c *catalog.Catalog)
}

// HealthWatcher is the part of health.Watcher the agent drives.
type HealthWatcher interface {
	SetInventory(inv *gpu.Inventory)
	SetPolicy(p health.Policy)
	State() *health.State
}

// MPSSupervisor is the part of mps.Supervisor the agent drives.
type MPSSupervisor interface {
	Set(daemons []mps.Daemon) error
	Healthy(device string) (bool, string)
}

// Holdings is the part of health.PodResources the agent reads.
type Holdings interface {
	Attribution() *health.Attribution
}

// Options configure an Agent.
type Options struct {
	// Lib is an initialised NVML (real or simulated).
	Lib              nvml.Interface
	InventoryOptions gpu.Options
	NodeName         string
	// ConfigSource names where the config comes from, for /status ("" = built-in default).
	ConfigSource string
	// ConfigUpdates delivers the config file's content each time it changes;
	// nil means the built-in default config forever.
	ConfigUpdates <-chan config.Update
	Publisher     Publisher
	// Health marks devices unhealthy (nil: all healthy unless unreadable).
	Health HealthWatcher
	// HealthChanged wakes the loop when Health's state changed.
	HealthChanged <-chan struct{}
	// Holdings says which devices running containers hold (the kubelet's
	// pod-resources API); nil: unknown, nothing is kept for holders.
	Holdings Holdings
	// MIG repartitions GPUs to the config's MIG layout (nil: layouts are
	// not applied; existing instances are served).
	MIG MIGApplier
	// MPS runs the MPS control daemons (nil: MPS sharing is refused).
	MPS MPSSupervisor
	// MPSChanged wakes the loop when a daemon's health changed.
	MPSChanged <-chan struct{}
	// MPSRoot and MPSShmDir: where daemons keep their pipes, and the host
	// directory MPS clients get as /dev/shm.
	MPSRoot, MPSShmDir string
	// InventoryObservers get every new inventory (the metrics sampler).
	InventoryObservers []func(*gpu.Inventory)
	// ResyncInterval re-reads the inventory even without events (default 30s).
	ResyncInterval time.Duration
	Logger         *slog.Logger
	// Registerer receives the agent's own metrics (nil: none).
	Registerer prometheus.Registerer
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Agent owns the node state. Create with New, then Run.
type Agent struct {
	opts    Options
	log     *slog.Logger
	now     func() time.Time
	status  atomic.Pointer[Status]
	catalog atomic.Pointer[catalog.Catalog]
	metrics *metrics

	// Owned by the Run goroutine only.
	file     *config.File
	selected config.Selected
	cfgErr   error
	cfgErrAt time.Time
	// planErr: the selected config does not fit this node (set by plan).
	planErr   error
	planErrAt time.Time
	warnings  []string
	gen       int
	inv       *gpu.Inventory
	cat       *catalog.Catalog
	lastPass  time.Time
	lastLoop  time.Time
	// ctx is Run's context (MIG applies honour it).
	ctx context.Context
	// MIG repartitioning: state per GPU index, the last error, the profiles
	// of each GPU model (queried once).
	migStates       map[int]MIGState
	migErr          error
	migProfileCache map[string]mig.Profiles

	// recentAlloc: device UUIDs allocated lately (NoteAllocated, any goroutine).
	allocMu     sync.Mutex
	recentAlloc map[string]time.Time
	// lastGood is the last selection that planned on this node; it is
	// served while a newer one does not fit.
	lastGood config.Selected
	failed   map[string]FailedGPU
	// scorerCache ranks GPU sets for GetPreferredAllocation; built once per
	// inventory and policy (scorerInv, scorerPolicy), never per request.
	scorerCache  *topology.Scorer
	scorerInv    *gpu.Inventory
	scorerPolicy topology.Policy
}

// New returns an agent; it does nothing until Run.
func New(opts Options) *Agent {
	if opts.ResyncInterval <= 0 {
		opts.ResyncInterval = 30 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	a := &Agent{opts: opts, log: opts.Logger, now: opts.Now}
	a.metrics = newMetrics(opts.Registerer)
	a.status.Store(&Status{Node: opts.NodeName})
	return a
}

// Run loops until ctx is done. With no ConfigUpdates it uses the built-in
// default config at once; otherwise it waits for the first content.
func (a *Agent) Run(ctx context.Context) error {
	if a.opts.Lib == nil || a.opts.Publisher == nil {
		return errors.New("agent: Lib and Publisher are required")
	}
	a.ctx = ctx
	updates := a.opts.ConfigUpdates
	if updates == nil {
		a.file = config.Default()
		a.selectConfig()
		a.reconcile("start")
	}
	tick := time.NewTicker(a.opts.ResyncInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case u, ok := <-updates:
			if !ok {
				updates = nil
				continue
			}
			if a.applyConfig(u) {
				a.reconcile("config changed")
			}
		case <-a.opts.HealthChanged:
			if a.file != nil {
				a.plan("health changed")
			}
		case <-a.opts.MPSChanged:
			if a.file != nil {
				a.plan("MPS daemon health changed")
			}
		case <-tick.C:
			if a.file != nil {
				a.reconcile("resync")
			} else {
				a.lastLoop = a.now() // waiting for a valid config is being alive
				a.publishStatus()
			}
		}
	}
}

// Catalog returns the catalog last published (nil before the first); safe
// from any goroutine.
func (a *Agent) Catalog() *catalog.Catalog { return a.catalog.Load() }

// Status returns the latest published status; safe from any goroutine.
func (a *Agent) Status() *Status { return a.status.Load() }

// Alive reports whether the loop completed a pass recently (liveness): a
// loop stuck in NVML for several resync periods is dead to the kubelet too.
func (a *Agent) Alive() bool {
	s := a.status.Load()
	if s.LastLoop.IsZero() {
		return true // still starting; readiness covers that
	}
	return a.now().Sub(s.LastLoop) < 4*a.opts.ResyncInterval
}

// applyConfig takes new config content; it reports whether a new config is
// in force (a rejected one leaves everything as it was).
func (a *Agent) applyConfig(u config.Update) bool {
	var f *config.File
	var warnings []string
	err := u.Err
	if err == nil {
		f, warnings, err = config.Parse(u.Data)
	}
	if err != nil {
		a.metrics.configErrors.Inc()
		a.metrics.configValid.Set(0)
		if a.cfgErr == nil || a.cfgErr.Error() != err.Error() {
			a.cfgErrAt = a.now()
		}
		a.cfgErr = err
		if a.file == nil {
			a.log.Error("config rejected and no earlier config to keep; serving nothing until it is fixed",
				"source", a.opts.ConfigSource, "error", err)
		} else {
			a.log.Error("config rejected; keeping the last good config",
				"source", a.opts.ConfigSource, "kept", a.selected.Name, "generation", a.gen, "error", err)
		}
		a.publishStatus()
		return false
	}
	a.cfgErr = nil
	a.metrics.configValid.Set(1)
	a.metrics.configReloads.Inc()
	a.file, a.warnings = f, warnings
	a.gen++
	for _, w := range warnings {
		a.log.Warn("config warning", "source", a.opts.ConfigSource, "warning", w)
	}
	a.selectConfig()
	return true
}

func (a *Agent) selectConfig() {
	sel, err := a.file.Select(a.opts.NodeName, nil)
	if err != nil {
		a.cfgErr, a.cfgErrAt = err, a.now()
		a.metrics.configValid.Set(0)
		a.log.Error("no config applies to this node", "node", a.opts.NodeName, "error", err)
		return
	}
	if sel.Name != a.selected.Name || sel.Reason != a.selected.Reason {
		a.log.Info("config selected", "node", a.opts.NodeName, "config", sel.Name, "by", sel.Reason, "generation", a.gen)
	}
	a.selected = sel
}

// reconcile runs one observe → plan → publish pass.
func (a *Agent) reconcile(why string) {
	a.observe(why)
	changed, err := a.reconcileMIG(a.ctx)
	if err != nil && (a.migErr == nil || a.migErr.Error() != err.Error()) {
		a.log.Error("MIG layout not applied", "config", a.selected.Name, "error", err)
	}
	a.migErr = err
	if changed {
		a.observe("MIG layout applied") // plan the catalog from the new instances
	}
	a.plan(why)
}

// observe reads a new inventory and hands it to the health watcher and the
// observers; on failure the last inventory stays.
func (a *Agent) observe(why string) {
	inv, err := gpu.New(a.opts.Lib, a.opts.InventoryOptions)
	if err != nil {
		// Keep serving the last inventory: a transient NVML failure must not
		// withdraw every device from the kubelet.
		a.log.Error("inventory failed; keeping the last one", "reason", why, "error", err)
		a.metrics.inventoryErrors.Inc()
	} else {
		for _, e := range inv.Errors {
			a.log.Warn("inventory incomplete", "error", e.Error())
		}
		failed := carryFailed(a.inv, inv, a.failed)
		for uuid, f := range failed {
			if _, known := a.failed[uuid]; !known {
				a.log.Warn("GPU could not be read; offering it as unhealthy", "gpu", f.GPU.Index, "uuid", uuid, "reason", f.Reason)
			}
		}
		for uuid, f := range a.failed {
			if _, still := failed[uuid]; !still {
				a.log.Info("GPU readable again", "gpu", f.GPU.Index, "uuid", uuid)
			}
		}
		a.failed = failed
		a.inv = inv
		if a.opts.Health != nil {
			a.opts.Health.SetInventory(inv)
		}
		for _, o := range a.opts.InventoryObservers {
			o(inv)
		}
	}
}

// plan derives the catalog from the current inventory, config and health,
// and publishes it.
func (a *Agent) plan(why string) {
	start := a.now()
	// Liveness is the loop turning, whether or not it could publish: a
	// config that does not fit must not get the pod restarted (which would
	// withdraw every device).
	defer func() { a.lastLoop = a.now(); a.publishStatus() }()
	if a.selected.Config == nil {
		return
	}
	planned, err := a.planWith(a.selected)
	if err != nil {
		// The config is valid on its own but does not fit this node (a GPU
		// index it lacks, ...): same treatment as an invalid config.
		a.metrics.configValid.Set(0)
		if a.planErr == nil || a.planErr.Error() != err.Error() {
			a.planErrAt = a.now()
			a.metrics.configErrors.Inc()
			a.log.Error("config cannot be applied to this node; serving the last config that could", "config", a.selected.Name,
				"serving", a.lastGood.Name, "error", err)
		}
		a.planErr = err
		if a.lastGood.Config == nil || a.lastGood.Config == a.selected.Config {
			return // nothing else to plan with: what is served stays as it is
		}
		// Keep planning with the last config that fitted, so health and
		// inventory changes still reach the kubelet.
		if planned, err = a.planWith(a.lastGood); err != nil {
			a.log.Error("the last good config no longer fits this node either", "config", a.lastGood.Name, "error", err)
			return
		}
	} else {
		if a.planErr != nil {
			a.log.Info("config applies to this node again", "config", a.selected.Name)
			a.planErr = nil
			if a.cfgErr == nil {
				a.metrics.configValid.Set(1)
			}
		}
		if a.lastGood.Config != a.selected.Config {
			a.lastGood = a.selected
			// The health policy changes with the rest of the config, only
			// once the config is in force.
			if a.opts.Health != nil {
				a.opts.Health.SetPolicy(health.PolicyFromConfig(a.selected.Config.Health))
			}
		}
	}
	if a.opts.MPS != nil {
		// Apply before publishing: replicas whose daemon does not answer yet
		// are unhealthy in this catalog and turn healthy on its signal.
		if err := a.opts.MPS.Set(planned.MPSDaemons); err != nil {
			a.log.Error("MPS daemons not updated", "error", err)
		}
	}
	cat := planned.Catalog
	a.keepHeld(cat)
	changed := a.cat == nil || !sameCatalog(a.cat, cat)
	a.cat = cat
	a.catalog.Store(cat)
	a.opts.Publisher.Update(cat)
	a.lastPass = a.now()
	a.metrics.reconcileDuration.Observe(a.lastPass.Sub(start).Seconds())
	a.metrics.devices.Reset()
	for _, r := range cat.Resources {
		healthy := 0
		for _, d := range r.Devices {
			if d.Healthy {
				healthy++
			}
		}
		a.metrics.devices.WithLabelValues(r.Name, "healthy").Set(float64(healthy))
		a.metrics.devices.WithLabelValues(r.Name, "unhealthy").Set(float64(len(r.Devices) - healthy))
	}
	if changed {
		a.log.Info("catalog published", "reason", why, "resources", resourceSummary(cat))
	}
}

// planWith plans the catalog for sel against the current inventory and health.
func (a *Agent) planWith(sel config.Selected) (Planned, error) {
	unhealthy := map[string]string{}
	if a.opts.Health != nil {
		if st := a.opts.Health.State(); st != nil {
			unhealthy = st.UnhealthyDevices()
		}
	}
	cfg := sel.Config
	if cfg.Sharing.MPS != nil && len(cfg.Sharing.MPS.Resources) > 0 && a.opts.MPS == nil {
		return Planned{}, fmt.Errorf("configs.%s.sharing.mps: this agent runs no MPS supervisor", sel.Name)
	}
	var mpsHealthy func(string) (bool, string)
	if a.opts.MPS != nil {
		mpsHealthy = a.opts.MPS.Healthy
	}
	return Plan(PlanInput{
		Inventory:       a.inv,
		ConfigName:      sel.Name,
		PassDeviceSpecs: cfg.DevicePlugin.PassDeviceSpecs,
		MIGStrategy:     cfg.MIG.Strategy,
		Sharing:         cfg.Sharing,
		Unhealthy:       unhealthy,
		Failed:          a.failed,
		Scorer:          a.scorer(sel),
		MPS:             MPSInput{Root: a.opts.MPSRoot, ShmDir: a.opts.MPSShmDir, Healthy: mpsHealthy},
	})
}

func sameCatalog(a, b *catalog.Catalog) bool {
	if len(a.Resources) != len(b.Resources) {
		return false
	}
	for name, ra := range a.Resources {
		rb, ok := b.Resources[name]
		if !ok || !catalog.SameDevices(ra, rb) {
			return false
		}
	}
	return true
}

func resourceSummary(c *catalog.Catalog) map[string]int {
	out := map[string]int{}
	for name, r := range c.Resources {
		out[name] = len(r.Devices)
	}
	return out
}

// carryFailed returns the GPUs known before (in prev or still failing from
// an earlier pass) that next lacks, each with the inventory error that names
// it by UUID or index. A GPU that is back in next is dropped from the result.
func carryFailed(prev, next *gpu.Inventory, failing map[string]FailedGPU) map[string]FailedGPU {
	known := map[string]gpu.GPU{}
	for _, f := range failing {
		known[f.GPU.UUID] = f.GPU
	}
	if prev != nil {
		for _, g := range prev.GPUs {
			known[g.UUID] = g
		}
	}
	out := map[string]FailedGPU{}
	for uuid, g := range known {
		if _, ok := next.GPUByUUID(uuid); ok {
			continue
		}
		reason := "no longer enumerated by NVML"
		for _, e := range next.Errors {
			if e.UUID == uuid || (e.UUID == "" && e.Index == g.Index) {
				reason = e.Call + ": " + e.Err
				break
			}
		}
		out[uuid] = FailedGPU{GPU: g, Reason: reason}
	}
	return out
}

// scorer returns the topology scorer for the current inventory and the
// selected config's allocation policy.
func (a *Agent) scorer(sel config.Selected) *topology.Scorer {
	if a.inv == nil {
		return nil
	}
	policy, err := topology.ParsePolicy(string(sel.Config.Allocation.Policy))
	if err != nil {
		// Validation rejects unknown policies; keep serving with the default.
		a.log.Error("allocation policy not understood; using topology", "error", err)
		policy = topology.PolicyTopology
	}
	if a.scorerCache == nil || a.scorerInv != a.inv || a.scorerPolicy != policy {
		a.scorerCache, a.scorerInv, a.scorerPolicy = topology.FromInventory(a.inv, policy), a.inv, policy
	}
	return a.scorerCache
}

// keepHeld puts back, unhealthy, every device of the last published catalog
// that a running container holds but the new plan no longer offers (a
// config edit took a GPU out of a shared pool, ...). The kubelet keeps such
// a pod's allocation either way; advertising the device until the pod
// releases it keeps its accounting honest and says on /status who holds it,
// instead of silently handing the same device out under a new name.
func (a *Agent) keepHeld(cat *catalog.Catalog) {
	if a.opts.Holdings == nil || a.cat == nil {
		return
	}
	att := a.opts.Holdings.Attribution()
	for name, old := range a.cat.Resources {
		held := att.HeldIDs(name)
		if len(held) == 0 {
			continue
		}
		cur := cat.Resources[name]
		for _, d := range old.Devices {
			h, ok := held[d.ID]
			if !ok {
				continue
			}
			if cur != nil {
				if _, offered := cur.Device(d.ID); offered {
					continue
				}
			}
			if cur == nil {
				cur = &catalog.Resource{Name: name, Common: old.Common, MaxPerContainer: old.MaxPerContainer}
				cat.Resources[name] = cur
			}
			d.Healthy = false
			d.Reason = "held by " + h.String() + "; no longer offered by the config, withdrawn once released"
			cur.Devices = append(cur.Devices, d)
		}
		if cur != nil {
			slices.SortFunc(cur.Devices, func(x, y catalog.Device) int { return strings.Compare(x.ID, y.ID) })
		}
	}
}
