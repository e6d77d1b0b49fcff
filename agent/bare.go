package agent

import (
	"fmt"
	"strings"
	"time"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// bareGrace is how long a GPU instance without a compute instance is left
// before the agent removes it from a GPU no layout governs. NVML makes a MIG
// device in two calls (the GPU instance, then its compute instance): a tool
// other than the agent (an admin's nvidia-smi) is between the two for
// milliseconds, while one left this long was left for good, by a crash
// mid-change. The agent's own changes run on the loop, so it never sees one
// of its own half-made.
const bareGrace = 10 * time.Second

// removeBare destroys the GPU instances without a compute instance that a
// change cut short left on GPUs no MIG layout in force governs (a layout's
// plan removes those on its GPUs; a layout that does not fit is not in
// force: Plan serves the last config that fitted, and its layout): no MIG
// device stands for one, so no container can hold it and no claim was
// given it, yet it takes its slices for good.
// One at the placement of a claim's MIG device, or of one being made or
// destroyed for a claim, is left to that claim's release, which undoes it.
// It runs on GPUs just read.
func (a *Agent) removeBare() {
	if a.opts.MIG == nil || a.inv == nil || a.selected.Config == nil {
		return
	}
	seen := map[string]time.Time{}
	now := a.now()
	type left struct {
		g    gpu.GPU
		bare []gpu.GPUInstance
	}
	var todo []left
	laid := a.laid
	for _, g := range a.inv.GPUs {
		if !a.read(g.UUID) {
			for k, at := range a.bareSince { // not read: what was seen stands
				if bareKeyGPU(k) == g.UUID {
					seen[k] = at
				}
			}
			continue
		}
		var old []gpu.GPUInstance
		for _, b := range g.GIsWithoutCI {
			k := bareKey(g.UUID, b)
			at, ok := a.bareSince[k]
			if !ok {
				at = now
			}
			seen[k] = at
			switch {
			case laid == nil || laid[g.Index]:
				// The layout in force governs it: its plan destroys the
				// instance (before the first pass, what is in force is not
				// known yet).
			case a.claimedAt(g.UUID, b.Placement) != "":
				if !ok {
					a.log.Warn("GPU instance without a compute instance left: a DRA claim's MIG device is recorded at its placement; its release undoes it",
						"gpu", g.Index, "uuid", g.UUID, "profile", b.Profile, "placement", b.Placement.Start, "claim", a.claimedAt(g.UUID, b.Placement))
				}
			case now.Sub(at) >= bareGrace:
				old = append(old, b)
			}
		}
		if len(old) > 0 {
			todo = append(todo, left{g, old})
		}
	}
	a.bareSince = seen
	for _, x := range todo {
		if err := a.destroyBare(x.g, x.bare); err != nil {
			a.log.Error("GPU instances without a compute instance not removed; trying again after the next read", "gpu", x.g.Index, "uuid", x.g.UUID, "error", err)
		}
	}
}

// destroyBare runs the one-GPU plan that destroys g's GPU instances in
// bare, each only while it still has no compute instance (mig.Step.Bare).
func (a *Agent) destroyBare(g gpu.GPU, bare []gpu.GPUInstance) error {
	counts := map[string]int{}
	for _, m := range g.Instances {
		counts[m.Profile]++
	}
	const why = "GPU instance without a compute instance, left by an interrupted change, on a GPU no MIG layout governs"
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: g.MIG.Current, Counts: counts}}
	for _, b := range bare {
		plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpDestroy, Profile: b.Profile, ProfileIndex: b.GIProfileID,
			Placement: b.Placement, GI: b.GI, Bare: true, Reason: why})
		a.log.Info("removing a GPU instance without a compute instance", "gpu", g.Index, "uuid", g.UUID, "profile", b.Profile,
			"gi", b.GI, "placement", b.Placement.Start)
	}
	if err := a.applyAndRead(plan, why); err != nil {
		return fmt.Errorf("GPU %d (%s): %w", g.Index, g.UUID, err)
	}
	return nil
}

// claimedAt names the claim whose MIG device (prepared, being made, or to
// be destroyed) is recorded at a placement overlapping pl on GPU uuid (""
// when none).
func (h *holdState) claimedAt(uuid string, pl gpu.Placement) string {
	return h.ledger.ClaimedAt(uuid, pl)
}

// bareKey names a GPU instance without a compute instance across reads.
func bareKey(uuid string, b gpu.GPUInstance) string {
	return fmt.Sprintf("%s/%s@%d+%d", uuid, b.Profile, b.Placement.Start, b.Placement.Size)
}

// bareKeyGPU is the GPU of a bareKey.
func bareKeyGPU(k string) string {
	uuid, _, _ := strings.Cut(k, "/")
	return uuid
}
