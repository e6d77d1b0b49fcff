package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// GPUResetter resets a GPU whose MIG mode change waits for a reset
// (mig.Resetter). NVML lists the processes; the reset itself is nvidia-smi
// on a real node, the sim's Reset on a simulated one.
type GPUResetter interface {
	// Processes lists what runs on the GPU and on its MIG devices.
	Processes(uuid string) ([]mig.Process, error)
	// Reset resets the GPU; it refuses while a process runs on it.
	Reset(ctx context.Context, g gpu.GPU) error
}

// resetHolders lists who holds g or one of its MIG devices, as the
// planner's snapshot knows them: the pods the kubelet lists (named), the
// allocations it has not listed yet, prepared claims, and claims' MIG
// devices being made or released. Any of them keeps g from a reset: the
// reset would take the silicon from under a container or a claim. It is
// pure; the ledger's Doom is asked again just before the reset.
func resetHolders(g gpu.GPU, h Holdings) []string {
	ids := []string{g.UUID}
	for _, in := range g.Instances {
		ids = append(ids, in.UUID)
	}
	var out []string
	add := func(s string) {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	for _, id := range ids {
		for _, ho := range h.Attribution.Holders(id) {
			add("pod " + ho.String())
		}
		if _, ok := h.Allocated[id]; ok {
			add("a container given " + id + " by the device plugin (not yet listed by the kubelet)")
		}
		if c, ok := h.Claimed[id]; ok {
			add("claim " + c)
		}
		if c, ok := h.Releasing[id]; ok {
			add("claim " + c + " (its MIG device is being made or released)")
		}
	}
	for _, d := range h.Unsettled {
		if d.Parent == g.UUID {
			add(fmt.Sprintf("a claim's MIG device at slice %d (being made or released)", d.Placement.Start))
		}
	}
	return out
}

// resetBlockers is what keeps g from a reset now, as far as the planner's
// snapshot knows (none: it may be reset, once NVML lists no process on it).
func resetBlockers(g gpu.GPU, h Holdings) []string {
	if h.Attribution == nil {
		// A pod allocated before this agent started is known only
		// through the kubelet's answer.
		return []string{"the kubelet's answer on who holds what (pod-resources): " + errString(h.Err, "none yet")}
	}
	return resetHolders(g, h)
}

func errString(err error, none string) string {
	if err == nil {
		return none
	}
	return err.Error()
}

// resetForMIG resets, when the plan allows it, the GPU of gm whose MIG
// mode change waits for a reset (st, reset-required): the config's
// mig.resetPolicy is whenIdle, nothing the snapshot knows holds the GPU
// (gm.ResetBlockers), the ledger agrees to doom it (nothing was handed out
// since), and NVML lists no process on it or its MIG devices. Otherwise
// st's reason says what blocks it: the policy, the holders and their pods,
// the processes. It reports whether the GPU was reset; its pending mode is
// then current and its layout still to be made.
func (a *Agent) resetForMIG(gm GPUMIG, st MIGState, policy config.ResetPolicy) (MIGState, bool) {
	if st.Phase != mig.PhaseResetRequired {
		return st, false
	}
	if !policy.ResetsWhenIdle() {
		st.Reason += "; mig.resetPolicy is never: reset the GPU yourself (nvidia-smi -r -i <PCI bus id>)"
		return st, false
	}
	if a.opts.Reset == nil {
		st.Reason += "; this agent cannot reset GPUs (no nvidia-smi: see --nvidia-smi)"
		return st, false
	}
	if a.inv == nil {
		return st, false
	}
	g, ok := a.inv.GPUByUUID(gm.UUID)
	if !ok {
		return st, false
	}
	blockers := slices.Clone(gm.ResetBlockers)
	why := "GPU reset for MIG layout " + gm.Want
	if len(blockers) == 0 {
		if err := a.ledger.Doom([]string{g.UUID}, why); err != nil {
			blockers = append(blockers, err.Error())
		} else if a.cat != nil {
			// Allocate refuses the GPU from here on; the kubelet stops
			// offering it before the reset takes it.
			a.publish(a.withdraw(a.cat, a.ledger.Doomed()), why)
		}
	}
	procs, err := a.opts.Reset.Processes(g.UUID)
	if err != nil {
		blockers = append(blockers, "a readable process list: "+err.Error())
	}
	for _, p := range procs {
		blockers = append(blockers, p.String())
	}
	if len(blockers) > 0 {
		st.ResetBlockers = blockers
		st.Reason += "; the reset waits for " + strings.Join(blockers, ", ")
		return st, false
	}
	if err := a.opts.Reset.Reset(a.ctx, g); err != nil {
		a.log.Error("GPU reset failed", "gpu", g.Index, "uuid", g.UUID, "error", err)
		st.Reason += "; the reset failed: " + err.Error()
		return st, false
	}
	a.log.Info("GPU reset: its pending MIG mode is current", "gpu", g.Index, "uuid", g.UUID, "want", gm.Want)
	a.event(false, ReasonMIGGPUReset, "GPU %d (%s): reset to apply the MIG mode of layout %s; nothing held it or ran on it", g.Index, g.UUID, gm.Want)
	st.Phase, st.Reason = mig.PhasePlanned, "GPU reset; the layout is made next"
	return st, true
}

// setsMode reports whether p changes its GPU's MIG mode.
func setsMode(p mig.Plan) bool {
	return slices.ContainsFunc(p.Steps, func(s mig.Step) bool { return s.Op == mig.OpSetMode })
}
