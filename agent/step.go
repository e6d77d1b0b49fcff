package agent

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/mig"
)

// recentSettle is how long after an Allocate the kubelet's pod-resources
// answer is trusted to list it. The kubelet records a container's devices
// as it admits the pod, right after Allocate returns; the margin covers a
// slow admission.
const recentSettle = 5 * time.Second

// refreshRetry is the least time between two pod-resources requests after one
// failed, so a hung kubelet socket (each request waits out its timeout)
// cannot stall the loop on every event.
const refreshRetry = 10 * time.Second

// Step handles one batch of events. It is the loop's whole behaviour, and
// reads as a table (first the state an event updates, then the work it
// calls for; the work runs once per batch however many events asked):
//
//	event      updates                                   work
//	config     file, selection (rejected: nothing)       observe + plan
//	labels     selection                                 observe + plan, if the selection changed
//	health     health state                              plan
//	mps        -                                         plan
//	allocated  allocation ledger (checkpointed)          - (plan, with DRA)
//	holdings   who holds what                            plan
//	tick       -                                         observe + plan
//	dra-*      DRA claims in the ledger (checkpointed    plan, if a claim was
//	           before the kubelet gets its answer)       prepared or released
//
// A plan pass is Plan, then at most: ask the kubelet afresh and Plan again
// (a MIG plan would destroy), apply MIG and Plan again (the GPUs changed);
// then the actuators: MPS daemons, health policy, the catalog to the
// kubelet, status, checkpoint. After each observe, what released DRA claims
// left on the node is undone again (retryReleases) before anything is
// planned.
func (a *Agent) Step(batch []Event) {
	var observe, plan bool
	var why []string
	var claims []Event // in the order they came
	for _, ev := range batch {
		switch e := ev.(type) {
		case ConfigChanged:
			if u, changed := a.configFrom(e); changed && a.applyConfig(u) {
				observe, plan = true, true
			}
		case LabelsChanged:
			if a.setLabels(e.Labels) {
				observe, plan = true, true
			}
		case HealthChanged:
			a.health = e.State
			plan = true
		case MPSChanged:
			plan = true
		case Allocated:
			a.noteAllocated(e.IDs)
			// With DRA, the device leaves the DRA pool at once: a claim
			// the scheduler gave it meanwhile would fail to prepare.
			plan = plan || a.opts.DRA != nil
		case HoldingsChanged:
			a.att = e.Attribution
			if !e.Answered.IsZero() {
				a.settleLedger(e.Answered)
			}
			plan = true
		case Tick:
			observe, plan = true, true
		case ClaimsPrepare, ClaimsUnprepare:
			claims = append(claims, e)
		}
		why = append(why, ev.kind())
	}
	reason := strings.Join(slices.Compact(why), "+")
	if observe && a.file != nil {
		a.observe(reason)
		if len(a.releasing) > 0 {
			// On GPUs just read, before anything is planned from them.
			a.retryReleases()
		}
	}
	// Claims are decided against what is observed now, before the pass
	// that then withholds them from the device plugin.
	replies := a.claimsStep(claims)
	plan = plan || replies.changed
	if plan && a.file != nil {
		a.pass(reason)
	}
	a.lastLoop = a.now() // the loop turned, whether or not it could publish
	if a.file != nil {
		a.healthEvents()
		a.publishCluster()
	}
	a.checkpoint()
	a.publishStatus()
	replies.sendAll()
}

// configFrom keeps the latest content of each source and returns the one in
// force (the API's while it has any, else the file's), and whether that
// changed.
func (a *Agent) configFrom(e ConfigChanged) (config.Update, bool) {
	if a.sources == nil {
		a.sources = map[ConfigSource]config.Update{}
	}
	before, beforeSrc := a.inForce()
	if e.Source == SourceAPI && e.Update.Err == nil && e.Update.Data == nil && e.Update.Files == nil {
		delete(a.sources, SourceAPI) // the ConfigMap is gone: the file takes over
	} else {
		a.sources[e.Source] = e.Update
	}
	u, src := a.inForce()
	if src != beforeSrc {
		a.log.Info("config source in force", "source", sourceName(src, a.opts.ConfigSource), "was", sourceName(beforeSrc, a.opts.ConfigSource))
	}
	a.source = src
	return u, src != beforeSrc || !sameUpdate(before, u)
}

func (a *Agent) inForce() (config.Update, ConfigSource) {
	if u, ok := a.sources[SourceAPI]; ok && u.Err == nil {
		return u, SourceAPI
	}
	if u, ok := a.sources[SourceFile]; ok {
		return u, SourceFile
	}
	if u, ok := a.sources[SourceAPI]; ok {
		return u, SourceAPI // only the API, and it fails: say why
	}
	return config.Update{}, ""
}

func sameUpdate(a, b config.Update) bool {
	if (a.Err == nil) != (b.Err == nil) || (a.Err != nil && a.Err.Error() != b.Err.Error()) {
		return false
	}
	return string(a.Data) == string(b.Data) && maps.Equal(a.Files, b.Files) && (a.Files == nil) == (b.Files == nil)
}

func sourceName(src ConfigSource, file string) string {
	if src == SourceAPI {
		return "the ConfigMap, through the API"
	}
	if file == "" {
		return "none"
	}
	return file
}

// applyConfig takes new config content; it reports whether a new config is
// in force (a rejected one leaves everything as it was).
func (a *Agent) applyConfig(u config.Update) bool {
	var f *config.File
	var warnings []string
	err := u.Err
	if err == nil {
		f, warnings, err = u.ParseWith(a.opts.DefaultConfig, a.parseOptions())
	}
	if err != nil {
		a.metrics.configErrors.Inc()
		a.metrics.configValid.Set(0)
		if a.cfgErr == nil || a.cfgErr.Error() != err.Error() {
			a.cfgErrAt = a.now()
			kept := "the built-in default (" + builtInSummary + ") is served until it is fixed"
			if a.gen > 0 {
				kept = fmt.Sprintf("config %q (generation %d) stays in force", a.selected.Name, a.gen)
			}
			a.event(true, ReasonConfigRejected, "config %s rejected, %s: %v", a.opts.ConfigSource, kept, err)
		}
		a.cfgErr = err
		if a.file == nil {
			a.log.Error("config rejected and no earlier config to keep; serving the built-in default until it is fixed",
				"source", a.opts.ConfigSource, "serving", builtInSummary, "error", err)
			a.serveBuiltIn()
			return true // the built-in default is new: observe and plan
		}
		a.log.Error("config rejected; keeping the last good config",
			"source", a.opts.ConfigSource, "kept", a.selected.Name, "generation", a.gen, "error", err)
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

// setLabels takes the node's labels; it reports whether the selection changed.
func (a *Agent) setLabels(labels map[string]string) bool {
	if maps.Equal(a.labels, labels) {
		return false
	}
	a.labels = maps.Clone(labels)
	if a.file == nil {
		return false
	}
	before := a.selected
	a.selectConfig()
	// Equal, not the config pointer: a new nvidia.com/mig.config alone
	// changes only the MIG layout.
	return !before.Equal(a.selected)
}

func (a *Agent) selectConfig() {
	sel, err := a.file.Select(a.opts.NodeName, a.labels)
	if err != nil {
		if a.selErr == nil || a.selErr.Error() != err.Error() {
			a.selErrAt = a.now()
			a.log.Error("no config applies to this node; keeping the last selection", "node", a.opts.NodeName,
				"kept", a.selected.Name, "error", err)
			a.event(true, ReasonConfigRejected, "node labels select nothing; config %q stays in force: %v", a.selected.Name, err)
		}
		a.selErr = err
		a.metrics.configValid.Set(0)
		return
	}
	if a.selErr != nil {
		a.log.Info("node labels select a config again", "config", sel.Name)
		a.selErr = nil
		if a.cfgErr == nil {
			a.metrics.configValid.Set(1)
		}
	}
	if !sel.Equal(a.selected) {
		a.log.Info("config selected", "node", a.opts.NodeName, "config", sel.Name, "by", sel.Reason,
			"mig", sel.MIGSource, "generation", a.gen)
		for _, n := range sel.Notes {
			a.log.Info("config selection note", "note", n)
		}
	}
	a.selected = sel
}

// snapshot gathers what Plan reads.
func (a *Agent) snapshot() Snapshot {
	var mpsIn MPSInput
	mpsIn.Root, mpsIn.ShmDir = a.opts.MPSRoot, a.opts.MPSShmDir
	if a.opts.MPS != nil {
		mpsIn.Healthy = a.opts.MPS.Healthy
	}
	claimed := claimedUUIDs(a.claims)
	return Snapshot{
		Inventory: a.inv, Failed: a.failed,
		Profiles: a.profiles, ProfileErrs: a.profileErrs,
		Selected: a.selected, LastGood: a.lastGood,
		Health: a.health, MPS: mpsIn, MPSSupervised: a.opts.MPS != nil, MIGApplies: a.opts.MIG != nil,
		Holdings: Holdings{Attribution: a.att, Fresh: a.fresh, Err: a.holdErr, Allocated: a.ledger,
			Claimed: claimed, Claims: a.claims, Releasing: releasingUUIDs(a.releasing, a.inv, claimed)},
		DRA:       a.opts.DRA != nil,
		Published: a.cat, Scorer: a.scorer.get(a.inv),
	}
}

func (a *Agent) plan() Desired {
	a.passes.Add(1)
	a.metrics.planPasses.Inc()
	return Plan(a.snapshot())
}

// pass plans and applies: see Step.
func (a *Agent) pass(why string) {
	if a.selected.Config == nil {
		return
	}
	start := a.now()
	a.fresh = false // only an answer asked for in this pass authorises destroying
	d := a.plan()
	if d.NeedFreshHoldings && a.refreshHoldings() {
		d = a.plan()
	}
	if a.applyMIG(d) {
		a.observe("MIG layout applied")
		d = a.plan()
	}
	a.fresh = false
	a.noteFit(d)
	a.notePlanWarnings(d.Warnings)
	if d.Catalog == nil {
		return // nothing fits: what is served stays as it is
	}
	if d.FitErr == nil {
		a.lastGood = d.Config
	}
	if a.opts.Health != nil && a.policySet != d.Config.Config {
		// The health policy changes with the rest of the config, only once
		// the config is in force.
		a.opts.Health.SetPolicy(d.HealthPolicy)
		a.policySet = d.Config.Config
	}
	if a.opts.MPS != nil {
		// Apply before publishing: replicas whose daemon does not answer yet
		// are unhealthy in this catalog and turn healthy on its signal.
		if err := a.opts.MPS.Set(d.MPSDaemons); err != nil {
			a.log.Error("MPS daemons not updated", "error", err)
		}
	}
	// The spec first: a container may be given a CDI name as soon as the
	// catalog is out.
	a.cdiPlugin = d.Config.Config != nil && d.Config.Config.DevicePlugin.UsesCDI()
	a.syncCDI(why)
	a.publish(d.Catalog, why)
	if a.opts.DRA != nil && d.DRA != nil {
		a.draPool = d.DRA
		a.opts.DRA.Publish(d.DRA)
	}
	a.lastPass = a.now()
	a.metrics.reconcileDuration.Observe(a.lastPass.Sub(start).Seconds())
}

// noteFit records whether the selected config fits this node.
func (a *Agent) noteFit(d Desired) {
	if d.FitErr != nil {
		a.metrics.configValid.Set(0)
		if a.fitErr == nil || a.fitErr.Error() != d.FitErr.Error() {
			a.fitErrAt = a.now()
			a.metrics.configErrors.Inc()
			a.log.Error("config cannot be applied to this node; serving the last config that could",
				"config", a.selected.Name, "serving", d.Config.Name, "error", d.FitErr)
			a.event(true, ReasonConfigNotFitting, "config %q does not fit this node, serving %q: %v", a.selected.Name, d.Config.Name, d.FitErr)
		}
		a.fitErr = d.FitErr
		return
	}
	if a.fitErr != nil {
		a.log.Info("config applies to this node again", "config", a.selected.Name)
		a.fitErr = nil
		if a.cfgErr == nil {
			a.metrics.configValid.Set(1)
		}
	}
}

// publish hands the catalog to the kubelet (the plugin manager tells it only
// what changed) and updates the device metrics.
func (a *Agent) publish(cat *catalog.Catalog, why string) {
	changed := a.cat == nil || !sameCatalog(a.cat, cat)
	a.cat = cat
	a.catalog.Store(cat)
	a.opts.Publisher.Update(cat)
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

// noteAllocated records device IDs the plugin allocated. Until a fresh
// pod-resources answer accounts for them they count as held, so a layout
// edit right after a pod starts cannot destroy its MIG device; the ledger is
// checkpointed, so an agent restart does not forget them either.
func (a *Agent) noteAllocated(ids []string) {
	now := a.now()
	for _, id := range ids {
		uuid, _, _ := strings.Cut(id, "::")
		a.ledger[uuid] = now
	}
}

// refreshHoldings asks the kubelet who holds what, for a pass about to
// destroy MIG instances; it reports whether a fresh answer came.
func (a *Agent) refreshHoldings() bool {
	if a.opts.Holdings == nil {
		a.holdErr = errors.New("no pod-resources API to ask")
		return false
	}
	asked := a.now()
	if !a.holdFailedAt.IsZero() && asked.Sub(a.holdFailedAt) < refreshRetry {
		return false // a.holdErr still says why
	}
	att, err := a.opts.Holdings.Refresh(a.ctx)
	if err != nil {
		if a.holdErr == nil || a.holdErr.Error() != err.Error() {
			a.log.Warn("pod-resources not answering; MIG plans destroy nothing until it does", "error", err)
		}
		a.holdErr, a.holdFailedAt = err, asked
		return false
	}
	if a.holdErr != nil {
		a.log.Info("pod-resources answers again")
	}
	a.att, a.fresh, a.holdErr, a.holdFailedAt = att, true, nil, time.Time{}
	a.settleLedger(asked)
	return true
}

// settleLedger forgets the allocations a successful pod-resources answer
// asked at (or before) asked accounts for: the kubelet had time to list
// them, so it holds them (the answer says so) or released them.
func (a *Agent) settleLedger(asked time.Time) {
	for uuid, at := range a.ledger {
		if asked.Sub(at) >= recentSettle {
			delete(a.ledger, uuid)
		}
	}
}

// applyMIG runs each GPU's MIG plan; it reports whether any GPU changed.
func (a *Agent) applyMIG(d Desired) (changed bool) {
	if d.MIG == nil {
		if a.migStates != nil {
			a.metrics.migPhases.Reset()
		}
		a.migStates, a.migErr = nil, d.MIGErr
		return false
	}
	states := map[int]MIGState{}
	errs := []error{d.MIGErr}
	for _, gm := range d.MIG {
		st := MIGState{GPU: gm.GPU, UUID: gm.UUID, Want: gm.Want, Phase: gm.State.Phase, Reason: gm.State.Reason}
		if gm.Apply() && a.opts.MIG != nil {
			// Apply even an empty plan: it finishes one that crashed after
			// its last step.
			s, err := a.opts.MIG.Apply(a.ctx, gm.Plan)
			if err != nil {
				errs = append(errs, fmt.Errorf("configs.%s.mig: %w", a.selected.Name, err))
			}
			changed = changed || len(gm.Plan.Steps) > 0
			st.Phase, st.Reason = s.Phase, s.Reason
			if gm.Waiting != "" && s.Phase == mig.PhaseApplied {
				st.Phase, st.Reason = mig.PhasePending, gm.Waiting
			}
		}
		if prev, ok := a.migStates[gm.GPU]; !ok || prev.Phase != st.Phase || prev.Reason != st.Reason {
			a.log.Info("MIG state", "gpu", gm.GPU, "uuid", gm.UUID, "want", st.Want, "phase", st.Phase, "reason", st.Reason)
			if !ok || prev.Phase != st.Phase || prev.Want != st.Want {
				a.migEvent(st)
			}
		}
		states[gm.GPU] = st
	}
	err := errors.Join(errs...)
	if err != nil && (a.migErr == nil || a.migErr.Error() != err.Error()) {
		a.log.Error("MIG layout not applied", "config", a.selected.Name, "error", err)
	}
	a.migStates, a.migErr = states, err
	a.metrics.migPhases.Reset()
	for _, st := range states {
		a.metrics.migPhases.WithLabelValues(fmt.Sprint(st.GPU), st.UUID, st.Phase).Set(1)
	}
	return changed
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

// migStatus lists the GPUs' MIG states in GPU order.
func (a *Agent) migStatus() []MIGState {
	out := slices.Collect(maps.Values(a.migStates))
	slices.SortFunc(out, func(x, y MIGState) int { return x.GPU - y.GPU })
	return out
}
