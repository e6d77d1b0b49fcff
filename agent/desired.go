package agent

import (
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Snapshot is everything a plan is derived from. Plan reads nothing else:
// no NVML, no clock, no kubelet. The loop builds it from what it observed and
// was told; `config validate` and `mig plan` build it from one inventory.
type Snapshot struct {
	Inventory *gpu.Inventory
	// Failed are GPUs known earlier that the inventory could not read; they
	// stay offered, unhealthy.
	Failed map[string]FailedGPU
	// Profiles are each GPU model's MIG profiles (by gpu.GPU.Name), and
	// ProfileErrs why a model's could not be read.
	Profiles    map[string]mig.Profiles
	ProfileErrs map[string]error
	// Selected is the config chosen for this node; LastGood the last one
	// that planned here, served while Selected does not fit.
	Selected config.Selected
	LastGood config.Selected
	Health   *health.State
	MPS      MPSInput
	// MPSSupervised: an MPS supervisor runs (without one, MPS sharing is refused).
	MPSSupervised bool
	// MIGApplies: a MIG applier runs (without one, layouts are not applied).
	MIGApplies bool
	// MIGResets: the agent can reset a GPU whose MIG mode change waits for
	// one (Options.Reset), where the layout's mig.resetPolicy allows.
	MIGResets bool
	// MIGManager: NVIDIA's mig-manager runs on the node (its deploy label),
	// acting on the same nvidia.com/mig.config label: no GPU is
	// repartitioned or reset.
	MIGManager bool
	// DRA: the node also offers its devices through DRA.
	DRA bool
	// MIGOpen, under the config's migOnDemand.spareGPUs, are the chosen
	// GPUs (by UUID) that offer MIG devices on demand, each with when it
	// was found a surplus spare (zero: it is not closing); a chosen GPU
	// not in it is offered whole only. Nil: every chosen GPU offers them.
	// The loop carries it from pass to pass (nextOpen).
	MIGOpen map[string]time.Time
	// MIGOpening, under migOnDemand.spareLayout, are chosen GPUs offered
	// whole, tainted since the time given, before their layout replaces
	// it; one in MIGOpen too offers both, tainted, on counters (nextOpen).
	MIGOpening map[string]time.Time
	// ControlPlane is the API server's version ("v1.36.3"; "" not known).
	ControlPlane string
	// ClaimMPS are the MPS daemons DRA claims' configs ask for, on devices
	// the config does not share by MPS.
	ClaimMPS []mps.Daemon
	Holdings Holdings
	// Cordoned are the GPUs the Node's cordon annotation lists, as written
	// (Snapshot.Cordon resolves them).
	Cordoned []string
	// Published is the catalog the kubelet was last given.
	Published *catalog.Catalog
	// Scorer returns the topology scorer for an allocation policy (nil:
	// the plugin's default order).
	Scorer func(topology.Policy) *topology.Scorer
}

// Holdings is what the node knows about which devices containers hold.
type Holdings struct {
	// Attribution is the kubelet's latest pod-resources answer (nil: none).
	Attribution *podresources.Attribution
	// Fresh: Attribution is a successful answer the loop asked for during
	// this pass. Destroying a MIG instance needs one that does not list it.
	Fresh bool
	// Err is why there is no fresh answer (for messages).
	Err error
	// Allocated are device UUIDs the plugin allocated that no fresh answer
	// has accounted for yet, with when (the checkpointed ledger).
	Allocated map[string]time.Time
	// Claimed maps the device UUIDs that prepared DRA claims hold to the
	// claim (the ledger's DRA side, checkpointed too); Claims are the claims.
	Claimed map[string]string
	Claims  map[types.UID]PreparedClaim
	// Releasing maps the MIG devices of released claims that are still to
	// be destroyed to the claim: offered neither way meanwhile.
	Releasing map[string]string
	// Unsettled are the MIG devices being made for claims (intents) and
	// those of released claims still to be destroyed: each may exist at its
	// placement whatever the last read of its GPU shows.
	Unsettled []PreparedClaimDevice
}

// Desired is what the node should run and offer.
type Desired struct {
	// Config is the config the catalog was planned with: Selected, or
	// LastGood when Selected does not fit (FitErr says why).
	Config config.Selected
	FitErr error
	// Catalog is nil when nothing can be planned (no config fits).
	Catalog    *catalog.Catalog
	MPSDaemons []mps.Daemon
	// MIG is each GPU's plan for the selected layout, in GPU order; MIGErr
	// the first error among them (or the layout's own).
	MIG    []GPUMIG
	MIGErr error
	// HealthPolicy is Config's health section.
	HealthPolicy health.Policy
	// NeedFreshHoldings: a MIG plan would destroy instances, but Holdings
	// is not fresh; ask the kubelet and plan again.
	NeedFreshHoldings bool
	// Warnings are what the catalog's config asks that this node cannot
	// do, while the rest applies (Planned.Warnings).
	Warnings []string
	// DRA is what the node offers through DRA (nil: DRA is off).
	DRA *devicemodel.Pool
	// Cordon is the GPUs taken out of service (withdrawCordoned).
	Cordon CordonStatus
}

// GPUMIG is one GPU's MIG plan.
type GPUMIG struct {
	GPU   int
	UUID  string
	Want  string
	Plan  mig.Plan
	State mig.State
	// Waiting, when set, is why the GPU stays pending after Plan's steps
	// (create-only: destroying waits for the kubelet's answer).
	Waiting string
	// ResetPolicy is the layout's mig.resetPolicy, and ResetBlockers, on a
	// GPU whose mode change waits for a reset, the holders that keep the
	// agent from it (resetBlockers).
	ResetPolicy   config.ResetPolicy
	ResetBlockers []string
}

// Apply reports whether the GPU's plan is to be run.
func (g GPUMIG) Apply() bool {
	return g.State.Phase == mig.PhasePlanned || g.State.Phase == mig.PhaseApplied
}

// Plan derives what the node should be from s. It is pure: the same snapshot
// always gives the same Desired.
func Plan(s Snapshot) Desired {
	var d Desired
	d.DRA = planDRA(s)
	d.Cordon = s.Cordon()
	if s.Selected.Config == nil {
		return d
	}
	d.MIG, d.MIGErr, d.NeedFreshHoldings = planMIG(s, s.Selected, d.Cordon)
	d.Config = s.Selected
	planned, err := planWith(s, s.Selected)
	badLayout := errors.Is(d.MIGErr, mig.ErrLayout)
	if badLayout {
		// A layout the GPUs cannot hold refuses the whole config before
		// anything changes: its sharing and strategy assume that layout.
		err = d.MIGErr
	}
	if err != nil {
		d.FitErr = err
		if badLayout {
			d.MIG, d.MIGErr, d.NeedFreshHoldings = nil, nil, false
		}
		if s.LastGood.Config == nil || s.LastGood.Config == s.Selected.Config {
			d.Config = config.Selected{}
			return d
		}
		// Keep planning with the last config that fitted, so health and
		// inventory changes still reach the kubelet. Its layout stays in
		// force where the new one cannot be; otherwise the new layout is
		// applied: a config that shares MIG devices fits only once they
		// exist.
		d.Config = s.LastGood
		if badLayout {
			d.MIG, d.MIGErr, d.NeedFreshHoldings = planMIG(s, s.LastGood, d.Cordon)
		}
		if planned, err = planWith(s, s.LastGood); err != nil {
			d.FitErr = fmt.Errorf("%w; the last good config %q no longer fits either: %w", d.FitErr, s.LastGood.Name, err)
			d.Config, d.MIG, d.MIGErr, d.NeedFreshHoldings = config.Selected{}, nil, nil, false
			return d
		}
	}
	keepHeld(planned.Catalog, s.Published, s.Holdings.Attribution)
	withholdHeldSilicon(planned.Catalog, s.Holdings.Attribution, s.Inventory)
	drain(planned.Catalog, d.DRA, d.MIG, s.Holdings)
	shareDevices(d.DRA, planned.Catalog, d.Config)
	evictOnUnhealthy(d.DRA, d.Config)
	withholdClaimed(planned.Catalog, s.Holdings.Claimed, claimedGPUs(s.Holdings.Claims, s.Inventory), func(by string) string {
		return "prepared for " + by + " through DRA"
	})
	withholdClaimed(planned.Catalog, s.Holdings.Releasing, nil, func(by string) string {
		return "created for " + by + " through DRA, which was released: being destroyed"
	})
	withdrawCordoned(planned.Catalog, d.DRA, d.Cordon)
	d.Catalog, d.MPSDaemons, d.Warnings = planned.Catalog, withClaimDaemons(planned.MPSDaemons, s.ClaimMPS), planned.Warnings
	if s.DRA {
		d.Warnings = append(d.Warnings, spareLayoutWarnings(s.Inventory, s.Profiles, d.Config)...)
		if w := countersWarning(s.ControlPlane, d.Config); w != "" {
			d.Warnings = append(d.Warnings, w)
		}
	}
	d.HealthPolicy = health.PolicyFromConfig(d.Config.Config.Health)
	return d
}

// planWith plans the catalog for sel.
func planWith(s Snapshot, sel config.Selected) (Planned, error) {
	cfg := sel.Config
	if !cfg.DevicePlugin.Serves() {
		if !s.DRA {
			return Planned{}, fmt.Errorf("configs.%s.devicePlugin.enabled: false would leave the node offering nothing: this agent runs without --dra", sel.Name)
		}
		// DRA only: nothing through the device plugin (keepHeld still
		// shows what running containers hold, unhealthy).
		return Planned{Catalog: &catalog.Catalog{Resources: map[string]*catalog.Resource{}}}, nil
	}
	if cfg.Sharing.MPS != nil && len(cfg.Sharing.MPS.Resources) > 0 && !s.MPSSupervised {
		return Planned{}, fmt.Errorf("configs.%s.sharing.mps: this agent runs no MPS supervisor", sel.Name)
	}
	var scorer *topology.Scorer
	if s.Scorer != nil {
		policy, err := topology.ParsePolicy(string(cfg.Allocation.Policy))
		if err != nil {
			return Planned{}, fmt.Errorf("configs.%s.allocation.policy: %w", sel.Name, err)
		}
		scorer = s.Scorer(policy)
	}
	return PlanResources(PlanInput{
		Inventory:        s.Inventory,
		ConfigName:       sel.Name,
		PassDeviceSpecs:  cfg.DevicePlugin.PassDeviceSpecs,
		DeviceIDStrategy: cfg.DevicePlugin.DeviceIDStrategy,
		Env:              cfg.DevicePlugin.ContainerEnv(),
		Delivery:         catalog.Delivery{Strategies: cfg.DevicePlugin.ListStrategies(), CDIAnnotationPrefix: cfg.DevicePlugin.CDIAnnotationPrefix},
		MIGStrategy:      cfg.MIG.Strategy,
		Sharing:          cfg.Sharing,
		Unhealthy:        s.Health.UnhealthyDevices(),
		Failed:           s.Failed,
		Scorer:           scorer,
		MPS:              s.MPS,
	})
}

// planMIG plans each GPU the selected layout names. The layout comes from
// the selected config even when its sharing section does not fit yet: a
// config that shares MIG devices fits only once they exist. A cordoned GPU
// (cordon, resolved once by Plan) keeps its MIG devices until uncordoned.
func planMIG(s Snapshot, sel config.Selected, cordon CordonStatus) (out []GPUMIG, firstErr error, needFresh bool) {
	layout := sel.MIGLayout
	if layout == nil || !s.MIGApplies || s.Inventory == nil {
		return nil, nil, false
	}
	// Errors name the layout where its author wrote it: the entry of
	// mig-configs or the config's mig.devices, and the field.
	wants, err := mig.Desired(layout, s.Inventory)
	if err != nil {
		var ee *mig.EntryError
		if errors.As(err, &ee) {
			return nil, sel.MIGError(ee.Entry, ee.Field, fmt.Errorf("%w: %w", mig.ErrLayout, ee.Err)), false
		}
		return nil, sel.MIGError(-1, "", err), false
	}
	held := s.Holdings.heldMIG(s.Inventory)
	var errs []error
	for _, g := range s.Inventory.GPUs {
		want, ok := wants[g.Index]
		if !ok {
			continue
		}
		gm := GPUMIG{GPU: g.Index, UUID: g.UUID, Want: want.String()}
		profiles, ok := s.Profiles[g.Name]
		if !ok {
			why := s.ProfileErrs[g.Name]
			if why == nil {
				why = errors.New("MIG profiles not read")
			}
			err := fmt.Errorf("gpu %d (%s): %w", g.Index, g.UUID, why)
			gm.State = mig.State{Phase: mig.PhaseFailed, Reason: err.Error()}
			errs = append(errs, sel.MIGError(want.Entry, "", err))
			out = append(out, gm)
			continue
		}
		plan, state, err := mig.MakePlan(g, profiles, want, held)
		if err != nil {
			errs = append(errs, sel.MIGError(want.Entry, layoutField(g, want, err), err))
		}
		gm.Plan, gm.State = plan, state
		if sel.Config != nil {
			gm.ResetPolicy = sel.Config.MIG.ResetPolicy
		}
		if s.MIGManager && (len(plan.Steps) > 0 || state.Phase == mig.PhaseResetRequired) {
			gm.Plan.Steps = nil
			gm.State = mig.State{Phase: mig.PhasePending, Reason: "mig-manager runs on this node (" + LabelDeployMIGManager + "=true): gpu-agent does not repartition until it is off"}
			out = append(out, gm)
			continue
		}
		resets := s.MIGResets && gm.ResetPolicy.ResetsWhenIdle()
		if resets && (state.Phase == mig.PhaseResetRequired || setsMode(plan)) {
			// A mode change the plan makes may turn out to wait for a
			// reset too (on most A100 hosts it does).
			gm.ResetBlockers = resetBlockers(g, s.Holdings)
			// Without any answer from the kubelet the reset waits for
			// one: the loop asks.
			needFresh = needFresh || s.Holdings.Attribution == nil
		}
		if state.Phase == mig.PhaseResetRequired {
			if resets {
				// The agent resets the GPU once nothing holds it: new
				// work must not keep it from ever being idle.
				gm.Plan.Draining = append(gm.Plan.Draining, g.UUID)
			}
		}
		if cordon.has(g.UUID) && len(plan.Steps) > 0 {
			out = append(out, cordon.holdMIG(gm))
			continue
		}
		if state.Phase == mig.PhasePending && !s.Holdings.Fresh && s.Holdings.allocatedOn(g) {
			// Waiting on allocations the kubelet has not accounted for:
			// only its answer can release them.
			needFresh = true
		}
		if destroysDevices(plan) && !s.Holdings.Fresh {
			needFresh = true
			gm.Plan, gm.Waiting = createOnly(plan), waitingForKubelet(plan, s.Holdings.Err)
			gm.Plan.DestroyBlocked = gm.Waiting
			if len(gm.Plan.Steps) == 0 {
				gm.State = mig.State{Phase: mig.PhasePending, Reason: gm.Waiting}
			}
		}
		out = append(out, gm)
	}
	return out, groupGPUErrors(errs), needFresh
}

// layoutField is the field of a layout entry that MakePlan's err for g is
// about: mig-enabled for a GPU without MIG, mig-devices for profiles that
// do not fit, the entry itself for the rest (the GPU's state).
func layoutField(g gpu.GPU, want mig.Want, err error) string {
	switch {
	case !errors.Is(err, mig.ErrLayout) || !want.MIGEnabled:
		return ""
	case !g.MIGCapable:
		return "mig-enabled"
	}
	return "mig-devices"
}

// PlanMIG is the MIG part of Plan: each GPU's plan for s.Selected's layout
// and the error that refuses it, if any (mig.ErrLayout when the layout
// does not fit). `config validate` checks every named layout with it.
func PlanMIG(s Snapshot) ([]GPUMIG, error) {
	out, err, _ := planMIG(s, s.Selected, s.Cordon())
	return out, err
}

// reGPUInError finds the GPU an error of planMIG names.
var reGPUInError = regexp.MustCompile(`gpu (\d+) \(GPU-[^)]*\): `)

// groupGPUErrors joins errs, those that say the same of several GPUs once
// with the GPUs listed ("gpus 0, 1, 2: MIG layout does not fit: ..."): a
// layout that does not fit a model fails on every GPU of it alike, and eight
// identical lines hide the one that differs. Each group wraps its first
// error, so errors.Is still finds mig.ErrLayout.
func groupGPUErrors(errs []error) error {
	type group struct {
		gpus []string
		err  error
	}
	var order []string
	groups := map[string]*group{}
	for _, err := range errs {
		msg := err.Error()
		key, idx := msg, ""
		if m := reGPUInError.FindStringSubmatchIndex(msg); m != nil {
			key, idx = msg[:m[0]]+"\x00"+msg[m[1]:], msg[m[2]:m[3]]
		}
		g, ok := groups[key]
		if !ok {
			g = &group{err: err}
			groups[key] = g
			order = append(order, key)
		}
		if idx != "" {
			g.gpus = append(g.gpus, idx)
		}
	}
	out := make([]error, 0, len(order))
	for _, key := range order {
		g := groups[key]
		if len(g.gpus) < 2 {
			out = append(out, g.err)
			continue
		}
		before, after, _ := strings.Cut(key, "\x00")
		out = append(out, groupedError{msg: before + "gpus " + strings.Join(g.gpus, ", ") + ": " + after, err: g.err})
	}
	return errors.Join(out...)
}

// groupedError is one error said of several GPUs.
type groupedError struct {
	msg string
	err error
}

func (e groupedError) Error() string { return e.msg }
func (e groupedError) Unwrap() error { return e.err }

// createOnly keeps the steps of p that destroy no MIG device and touch no
// slice such a destroy would free: creating in free slices, and removing a
// GPU instance without a compute instance (no device stands for it, so no
// pod can hold it), are safe whoever holds what. Destroying devices, and a
// MIG mode change (which needs them gone), wait for the kubelet's word.
func createOnly(p mig.Plan) mig.Plan {
	var freed uint64
	for _, s := range p.Steps {
		if s.Op == mig.OpDestroy && len(s.UUIDs) > 0 {
			freed |= slots(s.Placement)
		}
	}
	out := p
	out.Steps = nil
	for _, s := range p.Steps {
		switch {
		case s.Op == mig.OpDestroy && len(s.UUIDs) == 0:
			out.Steps = append(out.Steps, s)
		case s.Op == mig.OpCreate && slots(s.Placement)&freed == 0:
			out.Steps = append(out.Steps, s)
		}
	}
	return out
}

// destroysDevices reports whether p destroys any MIG device.
func destroysDevices(p mig.Plan) bool {
	for _, s := range p.Steps {
		if s.Op == mig.OpDestroy && len(s.UUIDs) > 0 {
			return true
		}
	}
	return false
}

func slots(pl gpu.Placement) uint64 {
	if pl.Size <= 0 || pl.Start < 0 || pl.Start+pl.Size > 64 {
		return ^uint64(0)
	}
	return ((uint64(1) << pl.Size) - 1) << pl.Start
}

func waitingForKubelet(p mig.Plan, why error) string {
	var victims []string
	for _, s := range p.Steps {
		if s.Op == mig.OpDestroy && len(s.UUIDs) > 0 {
			victims = append(victims, fmt.Sprintf("%s at %d", s.Profile, s.Placement.Start))
		}
	}
	msg := "destroying " + strings.Join(victims, ", ") + " waits for a fresh answer from the kubelet's pod-resources API"
	if why != nil {
		msg += " (" + why.Error() + ")"
	}
	return msg
}

// allocatedOn reports whether a ledger entry is one of g's MIG devices.
func (h Holdings) allocatedOn(g gpu.GPU) bool {
	for _, m := range g.Instances {
		if _, ok := h.Allocated[m.UUID]; ok {
			return true
		}
	}
	return false
}

// heldMIG maps each MIG device a container holds, or that was allocated and
// not yet accounted for, to who holds it.
func (h Holdings) heldMIG(inv *gpu.Inventory) map[string]string {
	held := map[string]string{}
	for _, g := range inv.GPUs {
		for _, m := range g.Instances {
			if hs := h.Attribution.Holders(m.UUID); len(hs) > 0 {
				held[m.UUID] = hs[0].String()
			}
		}
	}
	for _, uuid := range slices.Sorted(maps.Keys(h.Claimed)) {
		if _, ok := held[uuid]; !ok {
			held[uuid] = h.Claimed[uuid] + " (DRA)"
		}
	}
	for _, uuid := range slices.Sorted(maps.Keys(h.Allocated)) {
		if _, ok := held[uuid]; !ok {
			held[uuid] = "a container allocated it at " + stamp(h.Allocated[uuid]) + " (not yet listed by the kubelet)"
		}
	}
	// A MIG device being made or destroyed for a claim is the claim's until
	// that is done: a layout destroying it meanwhile would race the claim's
	// own MIG plan on the same instance.
	for _, uuid := range slices.Sorted(maps.Keys(h.Releasing)) {
		if _, ok := held[uuid]; !ok {
			held[uuid] = h.Releasing[uuid] + " (DRA, being made or released)"
		}
	}
	return held
}

// drain stops offering, through the device plugin and DRA, the MIG devices
// nobody holds that a layout destroys once the containers on their GPU
// end: without it, new pods keep landing on them and the layout may never
// apply on a busy node. Those the kubelet lists as held stay as they are
// (healthy: a running container's device is not at fault).
func drain(cat *catalog.Catalog, pool *devicemodel.Pool, plans []GPUMIG, h Holdings) {
	draining := map[string]string{}
	for _, gm := range plans {
		for _, uuid := range gm.Plan.Draining {
			if len(h.Attribution.Holders(uuid)) > 0 || hasKey(h.Claimed, uuid) {
				// Listed by the kubelet (or a claim's): the container
				// runs. One allocated moments ago and not listed yet is
				// drained with the rest, so the kubelet does not hand
				// it out again meanwhile.
				continue
			}
			draining[uuid] = fmt.Sprintf("drained for MIG layout %s on GPU %d: %s", gm.Want, gm.GPU, gm.State.Reason)
		}
	}
	if len(draining) == 0 {
		return
	}
	for _, r := range cat.Resources {
		for i := range r.Devices {
			if why, ok := draining[r.Devices[i].Spec.VisibleID]; ok && r.Devices[i].Healthy {
				r.Devices[i].Healthy, r.Devices[i].Reason = false, why
			}
		}
	}
	if pool != nil {
		pool.Devices = slices.DeleteFunc(pool.Devices, func(d devicemodel.Device) bool { return hasKey(draining, d.UUID) })
	}
}

// withholdHeldSilicon marks unhealthy every catalog device whose silicon a
// container holds under another ID: the kubelet counts device IDs, so after
// a config edit it would give GPU 5 whole to a second container while the
// first holds its time-sliced replica "GPU-5::1", or a MIG device's GPU
// (strategy none) while the first holds the MIG device. Replicas of one
// device under one resource are meant to be shared and stay.
func withholdHeldSilicon(cat *catalog.Catalog, att *podresources.Attribution, inv *gpu.Inventory) {
	if att == nil || cat == nil {
		return
	}
	parent := map[string]string{}
	if inv != nil {
		for _, g := range inv.GPUs {
			for _, m := range g.Instances {
				parent[m.UUID] = g.UUID
			}
		}
	}
	type held struct {
		resource, id string
		replica      bool
		by           podresources.Holder
	}
	bySilicon := map[string][]held{} // GPU or MIG UUID → what containers hold of it
	for _, name := range att.Resources() {
		ids := att.HeldIDs(name)
		for _, id := range slices.Sorted(maps.Keys(ids)) {
			uuid, _, replica := strings.Cut(id, "::")
			bySilicon[uuid] = append(bySilicon[uuid], held{name, id, replica, ids[id]})
		}
	}
	if len(bySilicon) == 0 {
		return
	}
	for name, r := range cat.Resources {
		for i := range r.Devices {
			d := &r.Devices[i]
			if !d.Healthy {
				continue
			}
			u := d.Spec.VisibleID
			for _, x := range []string{u, parent[u]} {
				for _, h := range bySilicon[x] {
					if h.resource == name && h.id == d.ID || h.resource == name && h.replica && d.Replica && x == u {
						continue // the device itself, or a replica shared as meant
					}
					d.Healthy, d.Reason = false, "held by "+h.by.String()+" as "+h.id+" ("+h.resource+")"
					break
				}
			}
			for _, child := range slices.Sorted(maps.Keys(parent)) {
				if parent[child] != u || !d.Healthy {
					continue
				}
				if hs := bySilicon[child]; len(hs) > 0 {
					d.Healthy, d.Reason = false, "its MIG device "+child+" is held by "+hs[0].by.String()
				}
			}
		}
	}
}

// keepHeld puts back, unhealthy, every device of the last published catalog
// that a running container holds but the new plan no longer offers (a
// config edit took a GPU out of a shared pool, ...). The kubelet keeps such
// a pod's allocation either way; advertising the device until the pod
// releases it keeps its accounting honest and says on /status who holds it,
// instead of silently handing the same device out under a new name.
func keepHeld(cat, published *catalog.Catalog, att *podresources.Attribution) {
	if published == nil || att == nil {
		return
	}
	for name, old := range published.Resources {
		held := att.HeldIDs(name)
		if len(held) == 0 {
			continue
		}
		cur := cat.Resources[name]
		added := false
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
			added = true
		}
		if added {
			slices.SortFunc(cur.Devices, func(x, y catalog.Device) int { return strings.Compare(x.ID, y.ID) })
		}
	}
}
