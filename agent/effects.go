package agent

import (
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/mps"
)

// A plan pass decides, then acts. decide is pure: from the planner's
// snapshot and what earlier passes put in force, it works out the Effects,
// everything the pass wants done to the node and told to others. The
// executor does that I/O in the order Effects' fields state: applyMIG
// first, then apply. A MIG plan changes the GPUs the decision was made
// from, so applyMIG reports what changed, and the loop (pass) reads the
// GPUs and decides again before anything is published.

// Effects is what one decision asks of the node, field by field in the
// order the executor does it. Nothing in it has happened yet: tests assert
// it without running an actuator.
type Effects struct {
	// Serving is the config the catalog was planned with (Desired.Config),
	// FitErr why the selected one does not fit (then Serving is the last
	// config that did, or nothing), Cordon the GPUs taken out of service
	// and Warnings what Serving asks that this node cannot do. They go to
	// /status, logs and Events once the GPUs are settled, before the
	// catalog.
	Serving  config.Selected
	FitErr   error
	Cordon   CordonStatus
	Warnings []string

	// AskHoldings: ask the kubelet who holds what, in the background, before
	// any MIG plan runs. A MIG plan would destroy devices without an answer
	// asked for it, or the ledger holds allocations the kubelet has had time
	// to list: each holds its device (and the device's GPU: no MIG mode
	// change) until an answer accounts for it, and the background refresh
	// tells only changes. The answer comes back as a later batch's
	// HoldingsAnswer.
	AskHoldings bool
	// Laid are the GPUs (by index) the MIG layout in force governs.
	Laid map[int]bool

	// MIG is each GPU's MIG plan, in GPU order, and MIGErr why the layout is
	// not (wholly) applied; MIGLayout is the selection whose layout they
	// make, whose fields errors name. The executor runs them before anything
	// below, in this order: every device the plans destroy (and every GPU
	// whose mode they change) is doomed in the ledger and withdrawn from the
	// kubelet before the first GPU is touched; a GPU is recorded as touched,
	// and checkpointed, before its plan's first step; a GPU whose mode
	// change waits for a reset is reset where the layout's policy allows
	// (doomed and withdrawn first). When any GPU changed, the rest of these
	// effects describe GPUs that are not there any more: the loop reads them
	// and decides again, and that decision's catalog is the one published.
	MIG       []GPUMIG
	MIGErr    error
	MIGLayout config.Selected

	// Catalog is what the kubelet is to be offered. Nil: nothing fits, and
	// nothing below is done (what is served stays).
	Catalog *catalog.Catalog
	// HealthPolicy, when set, goes to the health watcher: the policy changes
	// with the rest of the config, and only once the config is in force.
	HealthPolicy *health.Policy
	// NewConfig, when set, is a config newly in force, handed to
	// ConfigObservers.
	NewConfig *config.Config
	// SetMPS: MPSDaemons are the control daemons to run, set before the
	// catalog is published: replicas whose daemon does not answer yet are
	// unhealthy in this catalog and turn healthy on its signal.
	SetMPS     bool
	MPSDaemons []mps.Daemon
	// CDIPlugin: the device plugin hands out CDI device names under Serving.
	// The CDI spec is brought in step with the inventory before the catalog
	// goes out: a container may be given a CDI name as soon as it is.
	CDIPlugin bool
	// DRA is the pool to publish once the catalog is out (nil: DRA is off).
	// /status then says what the kubelet was just told; the checkpoint
	// follows at the end of the batch (Step), the slowest of all (an
	// fsync), which nothing the kubelet is told waits on.
	DRA *devicemodel.Pool
}

// decideInput is what a decision reads: the planner's snapshot, and what
// earlier passes put in force that it is compared with.
type decideInput struct {
	Snapshot
	// Settleable: the ledger holds allocations the kubelet has had time to
	// list, which only an answer asked for settles (Ledger.Settleable).
	Settleable bool
	// Health: a health watcher takes policies; PolicyOf is the config whose
	// policy it has.
	Health   bool
	PolicyOf *config.Config
	// Observed is the config ConfigObservers were last handed.
	Observed *config.Config
}

// decide is a pass's decision: Plan, and what of it is to be done. It is
// deterministic and does no I/O; the executor (applyMIG, apply) does what
// it returns.
func decide(in decideInput) Effects {
	d := Plan(in.Snapshot)
	e := Effects{
		Serving: d.Config, FitErr: d.FitErr, Cordon: d.Cordon, Warnings: d.Warnings,
		AskHoldings: d.NeedFreshHoldings || in.Settleable,
		Laid:        map[int]bool{},
		MIG:         d.MIG, MIGErr: d.MIGErr, MIGLayout: d.Config,
	}
	for _, gm := range d.MIG {
		e.Laid[gm.GPU] = true
	}
	if e.MIGLayout.MIGLayout == nil {
		// Planned while the selected config's sharing does not fit yet:
		// its layout is the one being made.
		e.MIGLayout = in.Selected
	}
	if d.Catalog == nil {
		return e
	}
	e.Catalog = d.Catalog
	if in.Health && in.PolicyOf != d.Config.Config {
		p := d.HealthPolicy
		e.HealthPolicy = &p
	}
	if in.Observed != d.Config.Config {
		e.NewConfig = d.Config.Config
	}
	e.SetMPS, e.MPSDaemons = in.MPSSupervised, d.MPSDaemons
	e.CDIPlugin = d.Config.Config.DevicePlugin.UsesCDI()
	if in.DRA {
		e.DRA = d.DRA
	}
	return e
}

// decide plans from what the loop holds now; each call is a plan pass
// (PlanPasses).
func (a *Agent) decide(start time.Time) Effects {
	a.passes.Add(1)
	a.metrics.planPasses.Inc()
	snap := a.snapshot()
	a.noteOpen(nextOpen(snap, a.spares, a.now(), a.opts.MIGCloseGrace))
	snap.MIGOpen, snap.MIGOpening = a.spares.open, a.spares.opening
	return decide(decideInput{
		Snapshot:   snap,
		Settleable: a.ledger.Settleable(start),
		Health:     a.opts.Health != nil, PolicyOf: a.policySet,
		Observed: a.observedConfig,
	})
}

// apply does what e asks once the GPUs are settled (applyMIG ran, and the
// loop decided again if they changed), in Effects' order.
func (a *Agent) apply(e Effects, why string, start time.Time) {
	a.noteFit(e)
	a.noteCordon(e.Cordon)
	a.notePlanWarnings(e.Warnings)
	if e.Catalog == nil {
		return // nothing fits: what is served stays as it is
	}
	if e.FitErr == nil {
		a.lastGood = e.Serving
	}
	if e.HealthPolicy != nil {
		a.opts.Health.SetPolicy(*e.HealthPolicy)
		a.policySet = e.Serving.Config
	}
	if e.NewConfig != nil {
		for _, f := range a.opts.ConfigObservers {
			f(e.NewConfig)
		}
		a.observedConfig = e.NewConfig
	}
	if e.SetMPS {
		if err := a.opts.MPS.Set(e.MPSDaemons); err != nil {
			a.log.Error("MPS daemons not updated", "error", err)
		} else {
			a.mpsSet = e.MPSDaemons
		}
	}
	a.cdiPlugin = e.CDIPlugin
	a.syncCDI(why)
	a.publish(e.Catalog, why)
	if e.DRA != nil {
		a.draPool = e.DRA
		a.opts.DRA.Publish(e.DRA)
	}
	a.lastPass = a.now()
	a.metrics.reconcileDuration.Observe(a.lastPass.Sub(start).Seconds())
	// /status says what the kubelet was just told before anything slower
	// (the checkpoint's fsync) runs; Step publishes it again at its end.
	a.publishStatus()
}
