package agent

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// MIG devices made on demand for DRA claims, and undone when their claim
// is released or fails: each change is a one- or two-step MIG plan run by
// the same journaled applier as layouts (applyAndRead).

// applyAndRead runs a one-GPU MIG plan for a claim and reads the GPUs
// again; the error includes a plan that stopped short of applied. What the
// applier doomed for it (mig.Guard) is cleared once the GPUs are read: the
// devices it destroyed are gone, those it did not are free again. The plan
// is exact (mig.Plan.Exact): a journal a crash left is resumed only by the
// same change, never by another claim's whose counts happen to match.
func (a *Agent) applyAndRead(plan mig.Plan, why string) error {
	plan.Exact = true
	a.touchMIG(plan.UUID)
	a.ledger.SettlingClaims(true)
	st, err := a.opts.MIG.Apply(a.ctx, plan, a.ledger)
	a.ledger.SettlingClaims(false)
	if err == nil && st.Phase != mig.PhaseApplied {
		err = fmt.Errorf("%s: %s", st.Phase, st.Reason)
	}
	a.observe("dynamic MIG: " + why)
	a.ledger.UndoomAll()
	return err
}

// partitionPlan is a MIG device to make on demand for a claim (dynamic
// MIG), decided by planPartition and made by createPartition.
type partitionPlan struct {
	// GPU is the GPU as last read, and Plan the change that makes the
	// device there: MIG mode on first if it is off (only on GPUs that need
	// no reset for it), then the GPU instance at the device's placement
	// with one compute instance spanning it.
	GPU  gpu.GPU
	Plan mig.Plan
	// Intent is the device as the ledger records it before the plan runs.
	Intent PreparedClaimDevice
	// TurnsMIGOn: the plan turns MIG on for claims, so the GPU goes back to
	// MIG off when its last on-demand device goes; the ledger records that
	// with the intent, before the mode changes.
	TurnsMIGOn bool
	// why names the claim, for the applier's journal and the logs.
	why string
}

// planPartition works out the change that makes the MIG device pool device
// d stands for, for claim c, on its GPU as last read. It changes nothing.
func (a *Agent) planPartition(c dra.Claim, d devicemodel.Device) (partitionPlan, error) {
	if a.opts.MIG == nil {
		return partitionPlan{}, errors.New("this agent does not manage MIG")
	}
	g, ok := a.inv.GPUByUUID(d.ParentUUID)
	if !ok {
		return partitionPlan{}, fmt.Errorf("GPU %s is gone", d.ParentUUID)
	}
	for _, m := range g.Instances {
		if m.Placement.Overlaps(d.Placement) {
			return partitionPlan{}, fmt.Errorf("GPU %d: MIG device %s (%s at %d) already occupies memory slices %d-%d",
				g.Index, m.UUID, m.Profile, m.Placement.Start, d.Placement.Start, d.Placement.Start+d.Placement.Size-1)
		}
	}
	counts := map[string]int{d.Profile: 1}
	for _, m := range g.Instances {
		counts[m.Profile]++
	}
	pp := partitionPlan{GPU: g, why: "DRA claim " + c.String(), TurnsMIGOn: !g.MIG.Current,
		Plan: mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: true, Counts: counts}},
		Intent: PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name}, Created: true, Parent: g.UUID,
			Profile: d.Profile, ProfileIndex: d.ProfileIndex, Placement: d.Placement}}
	if pp.TurnsMIGOn {
		pp.Plan.Steps = append(pp.Plan.Steps, mig.Step{Op: mig.OpSetMode, Enable: true, Reason: pp.why + ": the first MIG device on an idle GPU"})
	}
	pp.Plan.Steps = append(pp.Plan.Steps, mig.Step{Op: mig.OpCreate, Profile: d.Profile, ProfileIndex: d.ProfileIndex, Placement: d.Placement, Reason: pp.why})
	return pp, nil
}

// createPartition makes the MIG device pp plans for claim c, journaled by
// the MIG applier like any layout change. The intent is in the ledger, and
// checkpointed, before anything changes, so a crash orphans nothing; until
// the plan runs, a failure takes the intent back (one deferred rollback),
// and after, the claim's release (the caller's) undoes whatever the plan
// made, from the intent.
func (a *Agent) createPartition(c dra.Claim, pp partitionPlan) (dev PreparedClaimDevice, err error) {
	g, intent := pp.GPU, pp.Intent
	wasDynamic := a.ledger.Dynamic(g.UUID)
	if pp.TurnsMIGOn {
		a.ledger.SetDynamic(g.UUID, true)
	}
	ran := false
	defer func() {
		if err != nil && !ran {
			a.ledger.DropIntent(c.UID, intent)
			if !wasDynamic {
				a.ledger.SetDynamic(g.UUID, false)
			}
		}
	}()
	if err := a.ledger.Intend(c.UID, PreparedClaim{Namespace: c.Namespace, Name: c.Name, At: a.now()}, intent); err != nil {
		return PreparedClaimDevice{}, fmt.Errorf("GPU %d (%s) is %w", g.Index, g.UUID, err)
	}
	if err := a.checkpoint(); err != nil {
		return PreparedClaimDevice{}, fmt.Errorf("GPU %d: %s at %d not created: it could not be checkpointed first, so a crash could orphan it: %w",
			g.Index, intent.Profile, intent.Placement.Start, err)
	}
	ran = true
	err = a.applyAndRead(pp.Plan, pp.why)
	if err != nil {
		err = fmt.Errorf("GPU %d: %w", g.Index, err)
	}
	if !a.read(g.UUID) {
		// What NVML made cannot be told now. The intent stays in the
		// ledger: the claim's release (the caller's) undoes it once the
		// GPU reads again.
		if err == nil {
			err = fmt.Errorf("GPU %d could not be read after %s at %d was created", g.Index, intent.Profile, intent.Placement.Start)
		}
		return PreparedClaimDevice{}, err
	}
	now, ok := a.inv.GPUByUUID(g.UUID)
	if ok && !now.MIG.Current && !now.MIG.Pending {
		a.ledger.SetDynamic(g.UUID, false) // the mode did not change, not even pending a reset
	}
	if m, found := instanceAt(now, intent.Profile, intent.Placement); ok && found && err == nil {
		// The intent stays until the claim is checkpointed with the
		// device (claimsStep).
		a.log.Info("DRA: MIG device created", "claim", c.String(), "gpu", g.Index, "profile", intent.Profile, "placement", intent.Placement.Start, "uuid", m.UUID)
		made := intent
		made.UUID, made.CDIDevices = m.UUID, []string{devicemodel.CDIKind + "=" + m.UUID}
		return made, nil
	}
	if err == nil {
		err = fmt.Errorf("GPU %d: %s at %d was created but NVML does not list it", pp.Plan.GPU, intent.Profile, intent.Placement.Start)
	}
	// Whatever the failed creation left (a device NVML lists late, MIG mode
	// turned on or pending a reset) is undone with the claim's release (the
	// caller's), from the intent, now or on a later resync.
	return PreparedClaimDevice{}, err
}

// release undoes what preparing claim uid left on the node: its CDI spec,
// the MIG devices created for it (pc's devices marked Created) and those
// it intended, for a claim the kubelet released or one that failed to
// prepare (unclaim: it is still the ledger's claim). It is recorded as a
// release before anything is undone; what cannot be undone now stays in
// the ledger's releases,
// checkpointed, and is tried again after every read of the GPUs
// (retryReleases): nothing a claim made is forgotten.
func (a *Agent) release(uid types.UID, pc PreparedClaim, unclaim bool) {
	again := a.ledger.HasRelease(uid)
	rest := pc
	rest.Devices = nil
	devs := a.ledger.BeginRelease(uid, pc, unclaim)
	var failed []string
	if a.opts.CDI != nil && !a.ledger.HasClaim(uid) { // a claim prepared again keeps its spec
		if err := a.opts.CDI.RemoveClaim(string(uid)); err != nil {
			failed = append(failed, "CDI spec: "+err.Error())
		}
	}
	seen := map[string]bool{}
	for _, d := range devs {
		if !d.Created {
			continue
		}
		key := fmt.Sprintf("%s/%s/%s@%d+%d", d.UUID, d.Parent, d.Profile, d.Placement.Start, d.Placement.Size)
		if seen[key] {
			continue
		}
		seen[key] = true
		if err := a.destroyPartition(pc, d); err != nil {
			rest.Devices = append(rest.Devices, d)
			failed = append(failed, err.Error())
		}
	}
	if len(failed) == 0 {
		a.ledger.DropRelease(uid)
		return
	}
	if !again {
		a.log.Error("DRA: what a claim left on the node is not undone yet; trying again after every read of the GPUs",
			"claim", pc.String(), "uid", uid, "left", strings.Join(failed, "; "))
	}
	a.ledger.SetRelease(uid, rest)
}

// retryReleases tries again to undo what released claims left.
func (a *Agent) retryReleases() {
	releases := a.ledger.Releases()
	for _, uid := range slices.Sorted(maps.Keys(releases)) {
		pc := releases[uid]
		a.release(uid, pc, false)
		if !a.ledger.HasRelease(uid) {
			a.log.Info("DRA: what a released claim left on the node is undone", "claim", pc.String(), "uid", uid)
		}
	}
}

// destroyPartition destroys a MIG device created for a claim once the claim
// no longer holds it, unless a container got it through the device plugin
// meanwhile; a GPU left without MIG devices goes back to MIG off where a
// claim turned it on, so it is offered whole again. A device recorded only
// as an intent (no UUID yet) is the one at its placement that no claim
// holds. The error says why it is still there.
func (a *Agent) destroyPartition(pc PreparedClaim, d PreparedClaimDevice) error {
	if a.opts.MIG == nil || a.inv == nil {
		return fmt.Errorf("%s at %d on GPU %s: this agent cannot change MIG devices now", d.Profile, d.Placement.Start, d.Parent)
	}
	g, ok := a.inv.GPUByUUID(d.Parent)
	switch {
	case a.readNow == nil || ok && !a.read(d.Parent) || a.isFailed(d.Parent):
		// What the loop believes of the GPU is older than the last read
		// (or the checkpoint's): it cannot tell the device is gone.
		return fmt.Errorf("%s at %d on GPU %s: the GPU was not read just now; trying again", d.Profile, d.Placement.Start, d.Parent)
	case !ok:
		return nil // the GPU is gone, and its MIG devices with it
	}
	claimed := claimedUUIDs(a.ledger.Claims())
	var m gpu.MIGInstance
	found := false
	if d.UUID != "" {
		i := slices.IndexFunc(g.Instances, func(in gpu.MIGInstance) bool { return in.UUID == d.UUID })
		if found = i >= 0; found {
			m = g.Instances[i]
		}
	} else if in, ok := instanceAt(g, d.Profile, d.Placement); ok && !hasKey(claimed, in.UUID) {
		m, found = in, true
	}
	// A destroy or create cut short leaves the GPU instance without its
	// compute instance: no MIG device, but its slices are still taken.
	bare := slices.IndexFunc(g.GIsWithoutCI, func(b gpu.GPUInstance) bool { return b.Placement == d.Placement && b.Profile == d.Profile })
	switch {
	case found:
		if by, ok := claimed[m.UUID]; ok {
			// Made again, with the same UUID, for another claim: ours is gone.
			a.log.Warn("DRA: MIG device of a released claim is prepared for another claim; left as it is", "claim", pc.String(), "uuid", m.UUID, "holder", by)
			return nil
		}
		if by := a.ledger.PluginHolder(m.UUID); by != "" {
			return fmt.Errorf("MIG device %s is held by %s; destroyed once released", m.UUID, by)
		}
	case bare >= 0:
		b := g.GIsWithoutCI[bare]
		m = gpu.MIGInstance{GI: b.GI, Profile: b.Profile, GIProfileID: b.GIProfileID, Placement: b.Placement}
	default:
		return a.turnMIGOffIfUnused(g, pc.String()+" released") // the device is gone
	}
	var uuids []string
	if m.UUID != "" {
		uuids = []string{m.UUID}
	}
	counts := map[string]int{}
	for _, o := range g.Instances {
		if o.UUID != m.UUID {
			counts[o.Profile]++
		}
	}
	bares := len(g.GIsWithoutCI)
	if !found {
		bares-- // the one destroyed
	}
	// MIG goes back off only where a claim turned it on (and so it switched
	// without a reset): one an admin turned on stays on.
	last := len(counts) == 0 && bares == 0
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: !(last && a.ledger.Dynamic(g.UUID)), Counts: counts}}
	why := pc.String() + " released"
	plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpDestroy, Profile: m.Profile, ProfileIndex: m.GIProfileID, Placement: m.Placement,
		GI: m.GI, UUIDs: uuids, Reason: why})
	if !plan.Want.MIGEnabled {
		plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpSetMode, Enable: false, Reason: why + ": no MIG device left, the GPU is offered whole again"})
	}
	if err := a.applyAndRead(plan, why); err != nil {
		return fmt.Errorf("GPU %d: MIG device %s (%s at %d) not destroyed: %w", g.Index, d.UUID, m.Profile, m.Placement.Start, err)
	}
	if !plan.Want.MIGEnabled {
		a.ledger.SetDynamic(g.UUID, false)
	}
	a.log.Info("DRA: MIG device destroyed", "claim", pc.String(), "gpu", g.Index, "uuid", d.UUID, "gi", m.GI, "mig-off", !plan.Want.MIGEnabled)
	return nil
}

// instanceAt is g's MIG device of profile at placement pl, if any (a
// placement holds one GPU instance; ours have one compute instance).
func instanceAt(g gpu.GPU, profile string, pl gpu.Placement) (gpu.MIGInstance, bool) {
	i := slices.IndexFunc(g.Instances, func(m gpu.MIGInstance) bool { return m.Placement == pl && m.Profile == profile })
	if i < 0 {
		return gpu.MIGInstance{}, false
	}
	return g.Instances[i], true
}

// turnMIGOffIfUnused turns MIG off on a GPU a claim turned it on for that
// has no MIG device left, so the GPU is offered whole again. A creation
// that failed after the mode changed leaves it so, or with the enable
// pending a reset (a GPU that needs one): that pending enable is cancelled
// too, or the next reset would turn MIG on with no claim behind it.
func (a *Agent) turnMIGOffIfUnused(g gpu.GPU, why string) error {
	if !g.MIG.Current && !g.MIG.Pending && a.read(g.UUID) {
		a.ledger.SetDynamic(g.UUID, false) // off already (it never went on)
	}
	if !a.ledger.Dynamic(g.UUID) || (!g.MIG.Current && !g.MIG.Pending) || len(g.Instances) > 0 || len(g.GIsWithoutCI) > 0 {
		return nil
	}
	reason := why + ": no MIG device left, the GPU is offered whole again"
	if !g.MIG.Current {
		reason = why + ": cancelling the MIG enable that waits for a reset"
	}
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: false},
		Steps: []mig.Step{{Op: mig.OpSetMode, Enable: false, Reason: reason}}}
	if err := a.applyAndRead(plan, why); err != nil {
		return fmt.Errorf("GPU %d: MIG mode not turned back off: %w", g.Index, err)
	}
	a.ledger.SetDynamic(g.UUID, false)
	return nil
}
