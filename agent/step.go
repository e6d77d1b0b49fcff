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
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
)

// recentSettle is how long after an Allocate the kubelet's pod-resources
// answer is trusted to list it (the ledger's rule).
const recentSettle = ledger.SettleAfter

// refreshRetry is the least time between two pod-resources requests after one
// failed, so a hung kubelet socket (each request waits out its timeout)
// cannot stall the loop on every event.
const refreshRetry = 10 * time.Second

// Step handles one batch of events. It is the loop's whole behaviour, and
// reads as a table (first the state an event updates, then the work it
// calls for; the work runs once per batch however many events asked):
//
//	event      updates                                    work
//	config     file, selection (rejected: nothing)        observe + plan
//	labels     selection                                  observe + plan, if the selection changed
//	cordon     GPUs taken out of service                  plan, if they changed
//	health     health state                               plan
//	mps        -                                          plan
//	allocated  - (the ledger recorded it before Allocate  - (plan, with DRA)
//	           answered)
//	holdings   who holds what, settled allocations        plan
//	holdings-  the same, for the loop's own request       plan (which may destroy)
//	answer
//	tick       -                                          observe + plan
//	dra-*      DRA claims in the ledger (checkpointed     plan, if a claim was
//	           before the kubelet gets its answer)        prepared or released
//
// A plan pass decides (decide: Plan, and the Effects wanted of the node,
// with no I/O), then the executor does them: the MIG plans first
// (applyMIG); when they changed the GPUs, the loop reads them and decides
// again; then the rest (apply): health policy, MPS daemons, the CDI spec,
// the catalog to the kubelet, the DRA pool, status. The checkpoint is
// written at the end of the batch. A plan that would destroy MIG devices
// without an answer of the kubelet's asked for it (fresh) asks in the
// background and destroys nothing: the pass of the batch the answer comes
// in does. After each observe, what released DRA claims left on the node is
// undone again (retryReleases) before anything is planned.
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
		case CordonChanged:
			if !slices.Equal(a.cordoned, e.GPUs) {
				a.cordoned = slices.Clone(e.GPUs)
				plan = true
			}
		case ControlPlaneChanged:
			if a.controlPlane != e.Version {
				a.controlPlane = e.Version
				plan = true
			}
		case HealthChanged:
			a.health = e.State
			plan = true
		case MPSChanged:
			plan = true
		case Allocated:
			// The ledger recorded it before Allocate answered. With DRA,
			// the device leaves the DRA pool at once: a claim the
			// scheduler gave it meanwhile would fail to prepare.
			plan = plan || a.opts.DRA != nil
		case HoldingsChanged:
			// The background refresh answers every few seconds, mostly
			// the same: only news is planned from.
			news := !e.Attribution.Same(a.ledger.Holders())
			if !e.Answered.IsZero() {
				news = a.ledger.Settle(e.Attribution, e.Answered) > 0 || news
			} else {
				a.ledger.SetHolders(e.Attribution)
			}
			plan = plan || news
		case HoldingsAnswer:
			a.fresh = a.holdingsAnswer(e) || a.fresh
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
		if len(a.ledger.Releases()) > 0 {
			// On GPUs just read, before anything is planned from them.
			a.retryReleases()
		}
		a.removeBare()
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
	a.fresh = false // an answer authorises the pass of its own batch only
	if observe || plan || len(claims) > 0 {
		// Nothing the checkpoint holds changes otherwise (an allocation
		// alone is in the allocation log already). An allocation log
		// that could not be opened is tried again as often.
		a.ledger.RetryLog()
		a.checkpoint()
	}
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
		a.log.Info("config source in force", "source", sourceName(src, a.opts.ConfigSource, a.opts.ConfigMap), "was", sourceName(beforeSrc, a.opts.ConfigSource, a.opts.ConfigMap))
	}
	a.source = src
	return u, src != beforeSrc || !sameUpdate(before, u)
}

func (c *configState) inForce() (config.Update, ConfigSource) {
	if u, ok := c.sources[SourceAPI]; ok && u.Err == nil {
		return u, SourceAPI
	}
	if u, ok := c.sources[SourceFile]; ok {
		return u, SourceFile
	}
	if u, ok := c.sources[SourceAPI]; ok {
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

// sourceInForce names the config source in force, for logs and Events.
func (a *Agent) sourceInForce() string {
	return sourceName(a.source, a.opts.ConfigSource, a.opts.ConfigMap)
}

func sourceName(src ConfigSource, file, configMap string) string {
	if src == SourceAPI {
		return configMapSource(configMap)
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
		if a.cfgErr.set(err, a.now()) {
			kept := "the built-in default (" + builtInSummary + ") is served until it is fixed"
			if a.gen > 0 {
				kept = fmt.Sprintf("config %q (generation %d) stays in force", a.selected.Name, a.gen)
			}
			a.event(true, ReasonConfigRejected, "config %s rejected, %s: %v", a.sourceInForce(), kept, err)
		}
		if a.file == nil {
			a.log.Error("config rejected and no earlier config to keep; serving the built-in default until it is fixed",
				"source", a.sourceInForce(), "serving", builtInSummary, "error", err)
			a.serveBuiltIn()
			return true // the built-in default is new: observe and plan
		}
		a.log.Error("config rejected; keeping the last good config",
			"source", a.sourceInForce(), "kept", a.selected.Name, "generation", a.gen, "error", err)
		return false
	}
	a.cfgErr.clear()
	a.metrics.configValid.Set(1)
	a.metrics.configReloads.Inc()
	a.file, a.warnings = f, warnings
	a.gen++
	for _, w := range warnings {
		a.log.Warn("config warning", "source", a.sourceInForce(), "warning", w)
	}
	a.selectConfig()
	return true
}

// setLabels takes the node's labels; it reports whether the selection changed.
func (a *Agent) setLabels(labels map[string]string) bool {
	if maps.Equal(a.labels, labels) {
		return false
	}
	mm, gfd := nodeConflicts(a.labels)
	mm2, gfd2 := nodeConflicts(labels)
	a.labels = maps.Clone(labels)
	if mm != mm2 || gfd != gfd2 {
		return true // mig-manager or GFD came or went: plan and label again
	}
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
		if a.selErr.set(err, a.now()) {
			a.log.Error("no config applies to this node; keeping the last selection", "node", a.opts.NodeName,
				"kept", a.selected.Name, "error", err)
			a.event(true, ReasonConfigRejected, "node labels select nothing; config %q stays in force: %v", a.selected.Name, err)
		}
		a.metrics.configValid.Set(0)
		return
	}
	if a.selErr.clear() {
		a.log.Info("node labels select a config again", "config", sel.Name)
		if !a.cfgErr.stands() {
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
	l := a.ledger
	claims, intents, releases := l.Claims(), l.Intents(), l.Releases()
	claimed := claimedUUIDs(claims)
	return Snapshot{
		Inventory: a.inv, Failed: a.failed,
		Profiles: a.profiles, ProfileErrs: a.profileErrs,
		Selected: a.selected, LastGood: a.lastGood,
		Health: a.health, MPS: mpsIn, MPSSupervised: a.opts.MPS != nil, MIGApplies: a.opts.MIG != nil,
		MIGResets:  a.opts.Reset != nil,
		MIGManager: a.labels[LabelDeployMIGManager] == "true",
		Holdings: Holdings{Attribution: l.Holders(), Fresh: a.fresh, Err: a.holdErr.get(), Allocated: l.Allocations(),
			Claimed: claimed, Claims: claims, Releasing: releasingUUIDs(releases, intents, a.inv, claimed),
			Unsettled: unsettled(intents, releases)},
		DRA:       a.opts.DRA != nil,
		ClaimMPS:  a.claimDaemons(),
		Cordoned:  a.cordoned,
		Published: a.cat, Scorer: a.scorer.get(a.inv),
		MIGOpen: a.spares.open, MIGOpening: a.spares.opening,
		ControlPlane: a.controlPlane,
	}
}

// pass decides and has the executor apply what it decided: see Step. A
// MIG plan that changed the GPUs (or a GPU reset) makes the loop read them
// and decide again: what is published comes from GPUs as they are.
func (a *Agent) pass(why string) {
	if a.selected.Config == nil {
		return
	}
	start := a.now()
	e := a.decide(start)
	a.noteConflicts(a.conflictsWith(e.Catalog))
	a.laid = e.Laid
	if e.AskHoldings {
		a.askHoldings()
	}
	changed, reset := a.applyMIG(e)
	if reset {
		// A GPU reset made a pending MIG mode current: its layout is made
		// in this pass, from a fresh read.
		a.observe("GPU reset for a MIG mode change")
		a.ledger.UndoomAll()
		a.applyMIG(a.decide(start))
		changed = true
	}
	if changed {
		a.observe("MIG layout applied")
	}
	// The devices the plans destroyed are gone from this read, those they
	// did not destroy are free again: the catalog decided now says which.
	a.ledger.UndoomAll()
	if changed {
		e = a.decide(start)
	}
	a.fresh = false
	a.apply(e, why, start)
}

// noteFit records whether the selected config fits this node.
func (a *Agent) noteFit(e Effects) {
	if e.FitErr != nil {
		a.metrics.configValid.Set(0)
		if a.fitErr.set(e.FitErr, a.now()) {
			a.metrics.configErrors.Inc()
			a.log.Error("config cannot be applied to this node; serving the last config that could",
				"config", a.selected.Name, "serving", e.Serving.Name, "error", e.FitErr)
			a.event(true, ReasonConfigNotFitting, "config %q does not fit this node, serving %q: %v", a.selected.Name, e.Serving.Name, e.FitErr)
		}
		return
	}
	if a.fitErr.clear() {
		a.log.Info("config applies to this node again", "config", a.selected.Name)
		if !a.cfgErr.stands() {
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
	a.opts.Publisher.Update(withoutResources(cat, a.conflicts.Plugins))
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

// askHoldings asks the kubelet who holds what, for a pass that would
// destroy MIG devices, in the background: the loop never waits on the
// kubelet (a hung socket would stall health and everything else). The
// answer comes back as a HoldingsAnswer; until then the GPUs wait. One
// request at a time, and none for refreshRetry after one failed.
func (a *Agent) askHoldings() {
	if a.opts.Holdings == nil {
		a.holdErr.set(errors.New("no pod-resources API to ask"), a.now())
		return
	}
	asked := a.now()
	if a.asking || (a.holdErr.stands() && asked.Sub(a.holdAsked) < refreshRetry) {
		return // a.holdErr still says why
	}
	a.asking, a.holdAsked = true, asked
	ctx, src := a.ctx, a.opts.Holdings
	a.opts.Background(func() Event {
		att, err := src.Refresh(ctx)
		return HoldingsAnswer{Attribution: att, Err: err, Asked: asked}
	})
}

// holdingsAnswer takes the answer to askHoldings; it reports whether the
// pass of this batch may destroy on it (fresh).
func (a *Agent) holdingsAnswer(e HoldingsAnswer) bool {
	a.asking = false
	if e.Err != nil {
		if a.holdErr.set(e.Err, e.Asked) {
			a.log.Warn("pod-resources not answering; MIG plans destroy nothing until it does", "error", e.Err)
		}
		return false
	}
	if a.holdErr.clear() {
		a.log.Info("pod-resources answers again")
	}
	a.ledger.Settle(e.Attribution, e.Asked)
	return true
}

// applyMIG is the executor's first part: it runs e's MIG plans, and resets
// the GPUs whose mode change waits for a reset where the policy allows
// (resetForMIG), in the order Effects.MIG states; it reports whether any
// GPU changed, and whether one was reset.
func (a *Agent) applyMIG(e Effects) (changed, reset bool) {
	if e.MIG == nil {
		if a.migStates != nil {
			a.metrics.migPhases.Reset()
		}
		a.migStates = nil
		a.noteMIGErr(e.MIGErr)
		clear(a.migSaid)
		return false, false
	}
	if a.migSaid == nil {
		a.migSaid = map[int]MIGState{}
	}
	states := map[int]MIGState{}
	errs := []error{e.MIGErr}
	refused := a.doom(e.MIG)
	for _, gm := range e.MIG {
		st := MIGState{GPU: gm.GPU, UUID: gm.UUID, Want: gm.Want, Phase: gm.State.Phase, Reason: gm.State.Reason}
		if why, ok := refused[gm.GPU]; ok {
			// A mode change is not even tried under a holder; where it
			// will need a reset (an A100's), its holders are what the
			// reset waits for, and /status says so as it does once the
			// change is pending.
			st.Phase, st.Reason, st.ResetBlockers = mig.PhasePending, why, gm.ResetBlockers
		} else if gm.Apply() && a.opts.MIG != nil {
			// Apply even an empty plan: it finishes one that crashed after
			// its last step.
			if len(gm.Plan.Steps) > 0 {
				a.touchMIG(gm.UUID)
			}
			s, err := a.opts.MIG.Apply(a.ctx, gm.Plan, a.ledger)
			if err != nil {
				errs = append(errs, e.MIGLayout.MIGError(gm.Plan.Want.Entry, "", err))
			}
			changed = changed || len(gm.Plan.Steps) > 0
			st.Phase, st.Reason = s.Phase, s.Reason
			if gm.Waiting != "" && s.Phase == mig.PhaseApplied {
				st.Phase, st.Reason = mig.PhasePending, gm.Waiting
			}
		}
		if a.opts.MIG != nil {
			var done bool
			st, done = a.resetForMIG(gm, st, gm.ResetPolicy)
			reset = reset || done
		}
		// Waiting for the answer the loop just asked for is a moment, not
		// news: it is in /status, but logged and sent as an Event only if
		// the answer does not come (it fails, or the pass after it waits).
		said, ok := a.migSaid[gm.GPU]
		if transient := gm.Waiting != "" && a.asking; !transient && (!ok || said.Phase != st.Phase || said.Reason != st.Reason) {
			a.log.Info("MIG state", "gpu", gm.GPU, "uuid", gm.UUID, "want", st.Want, "phase", st.Phase, "reason", st.Reason)
			if !ok || said.Phase != st.Phase || said.Want != st.Want {
				a.migEvent(st)
			}
			a.migSaid[gm.GPU] = st
		}
		states[gm.GPU] = st
	}
	err := errors.Join(errs...)
	a.noteMIGErr(err)
	a.migStates = states
	a.metrics.migPhases.Reset()
	for _, st := range states {
		a.metrics.migPhases.WithLabelValues(fmt.Sprint(st.GPU), st.UUID, st.Phase).Set(1)
	}
	return changed, reset
}

// noteMIGErr keeps why the layout is not applied, logging it when it is
// news.
func (a *Agent) noteMIGErr(err error) {
	if err == nil {
		a.migErr.clear()
		return
	}
	if a.migErr.set(err, a.now()) {
		a.log.Error("MIG layout not applied", "config", a.selected.Name, "error", err)
	}
}

// doom marks in the ledger, before any GPU is touched, every device the
// plans destroy and every GPU whose MIG mode they change, and withdraws
// them from the kubelet at once: from here on Allocate refuses them, while
// the old catalog would still offer them until the new one is out. A GPU
// with a device the ledger will not give up (handed out since the plan was
// made, or prepared for a claim) keeps its devices: its plan waits, and the
// reason is returned by GPU index.
func (a *Agent) doom(plans []GPUMIG) map[int]string {
	if a.opts.MIG == nil {
		return nil
	}
	refused := map[int]string{}
	for _, gm := range plans {
		if !gm.Apply() {
			continue
		}
		var uuids []string
		for _, s := range gm.Plan.Steps {
			switch {
			case s.Op == mig.OpDestroy:
				uuids = append(uuids, s.UUIDs...)
			case s.Op == mig.OpSetMode && !slices.Contains(uuids, gm.UUID):
				uuids = append(uuids, gm.UUID)
			}
		}
		if len(uuids) == 0 {
			continue
		}
		if err := a.ledger.Doom(uuids, fmt.Sprintf("MIG layout %s on GPU %d", gm.Want, gm.GPU)); err != nil {
			what := "destroying waits: "
			if setsMode(gm.Plan) {
				what = "the MIG mode change waits: "
			}
			refused[gm.GPU] = what + err.Error()
		}
	}
	if doomed := a.ledger.Doomed(); len(doomed) > 0 && a.cat != nil {
		a.publish(a.withdraw(a.cat, doomed), "MIG layout: withdrawing the devices it destroys before the first destroy")
	}
	return refused
}

// withdraw is cat with every device that overlaps a doomed one unhealthy,
// saying why (cat itself is immutable: it may be served right now).
func (h *holdState) withdraw(cat *catalog.Catalog, doomed map[string]string) *catalog.Catalog {
	out := &catalog.Catalog{Resources: make(map[string]*catalog.Resource, len(cat.Resources))}
	for name, r := range cat.Resources {
		var devs []catalog.Device
		for i, d := range r.Devices {
			for _, u := range slices.Sorted(maps.Keys(doomed)) {
				if !h.ledger.Overlaps(d.Spec.VisibleID, u) {
					continue
				}
				if devs == nil {
					devs = slices.Clone(r.Devices)
				}
				devs[i].Healthy, devs[i].Reason = false, "being repartitioned: "+doomed[u]
				break
			}
		}
		if devs == nil {
			out.Resources[name] = r
			continue
		}
		c := *r
		c.Devices = devs
		out.Resources[name] = &c
	}
	return out
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
func (p *publishedState) migStatus() []MIGState {
	out := slices.Collect(maps.Values(p.migStates))
	slices.SortFunc(out, func(x, y MIGState) int { return x.GPU - y.GPU })
	return out
}
