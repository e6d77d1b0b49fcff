package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/mig"
)

// MIGApplier executes MIG plans (mig.Applier).
type MIGApplier interface {
	Apply(ctx context.Context, p mig.Plan) (mig.State, error)
}

// MIGState is one GPU's repartitioning state, for /status and metrics.
type MIGState struct {
	GPU    int    `json:"gpu"`
	UUID   string `json:"uuid"`
	Want   string `json:"want"`
	Phase  string `json:"phase"`
	Reason string `json:"reason,omitempty"`
}

// reconcileMIG makes the GPUs match the selected config's MIG layout, one
// GPU at a time: plan (keeping what fits, never destroying what a pod
// holds), then apply. It runs between observe and plan, so the catalog is
// planned from the repartitioned GPUs; it reports whether any GPU changed
// (the inventory must be read again). A layout that cannot be applied is an
// error naming the entry and GPU; the GPUs are left as they are.
func (a *Agent) reconcileMIG(ctx context.Context) (changed bool, err error) {
	layout := a.selected.MIGLayout
	if layout == nil || a.opts.MIG == nil || a.inv == nil {
		a.migStates = nil
		return false, nil
	}
	wants, err := mig.Desired(layout, a.inv)
	if err != nil {
		return false, fmt.Errorf("configs.%s.mig: %w", a.selected.Name, err)
	}
	held := a.heldMIG(ctx)
	states := map[int]MIGState{}
	var errs []error
	for _, g := range a.inv.GPUs {
		want, ok := wants[g.Index]
		if !ok {
			continue
		}
		st := MIGState{GPU: g.Index, UUID: g.UUID, Want: want.String()}
		state, applied, err := a.migGPU(ctx, g, want, held)
		st.Phase, st.Reason = state.Phase, state.Reason
		if err != nil {
			errs = append(errs, fmt.Errorf("configs.%s.mig: %w", a.selected.Name, err))
		}
		changed = changed || applied
		if prev, ok := a.migStates[g.Index]; !ok || prev.Phase != st.Phase || prev.Reason != st.Reason {
			a.log.Info("MIG state", "gpu", g.Index, "uuid", g.UUID, "want", st.Want, "phase", st.Phase, "reason", st.Reason)
		}
		states[g.Index] = st
	}
	a.migStates = states
	a.metrics.migPhases.Reset()
	for _, st := range states {
		a.metrics.migPhases.WithLabelValues(fmt.Sprint(st.GPU), st.UUID, st.Phase).Set(1)
	}
	if len(errs) > 0 {
		return changed, errs[0]
	}
	return changed, nil
}

// migGPU plans and applies one GPU; applied says whether NVML was asked to
// change anything.
func (a *Agent) migGPU(ctx context.Context, g gpu.GPU, want mig.Want, held map[string]string) (mig.State, bool, error) {
	dev, ret := a.opts.Lib.DeviceGetHandleByIndex(g.Index)
	if ret != nvml.SUCCESS {
		err := fmt.Errorf("gpu %d (%s): %v", g.Index, g.UUID, ret)
		return mig.State{Phase: mig.PhaseFailed, Reason: err.Error()}, false, err
	}
	profiles, err := a.migProfiles(g, dev)
	if err != nil {
		return mig.State{Phase: mig.PhaseFailed, Reason: err.Error()}, false, err
	}
	plan, state, err := mig.MakePlan(g, profiles, want, held)
	if err != nil {
		return state, false, err
	}
	if state.Phase != mig.PhasePlanned && state.Phase != mig.PhaseApplied {
		return state, false, nil // pending (a pod holds an instance) or reset-required: wait
	}
	// Apply even an empty plan: it finishes one that crashed after its last step.
	state, err = a.opts.MIG.Apply(ctx, plan)
	return state, len(plan.Steps) > 0, err
}

// migProfiles queries a GPU model's profiles and placements from NVML once.
func (a *Agent) migProfiles(g gpu.GPU, dev nvml.Device) (mig.Profiles, error) {
	if p, ok := a.migProfileCache[g.Name]; ok {
		return p, nil
	}
	p, err := mig.QueryProfiles(dev, g.MemoryBytes)
	if err != nil {
		return nil, fmt.Errorf("gpu %d (%s): %w", g.Index, g.UUID, err)
	}
	if a.migProfileCache == nil {
		a.migProfileCache = map[string]mig.Profiles{}
	}
	a.migProfileCache[g.Name] = p
	return p, nil
}

// refresher is a Holdings that can ask the kubelet now (health.PodResources).
type refresher interface {
	Refresh(ctx context.Context) (*health.Attribution, error)
}

// recentHold is how long an Allocate counts as a hold without the kubelet's
// pod-resources answer confirming it: the kubelet lists a container's devices
// only once its admission completes.
const recentHold = 2 * time.Minute

// recentSettle is how long after an Allocate the kubelet's answer is trusted
// to list it.
const recentSettle = 5 * time.Second

// NoteAllocated records device IDs the plugin just allocated; safe from any
// goroutine. Until the kubelet lists them they still count as held, so a
// layout edit right after a pod starts cannot destroy its MIG device.
func (a *Agent) NoteAllocated(ids []string) {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	if a.recentAlloc == nil {
		a.recentAlloc = map[string]time.Time{}
	}
	now := a.now()
	for id, at := range a.recentAlloc {
		if now.Sub(at) > recentHold {
			delete(a.recentAlloc, id)
		}
	}
	for _, id := range ids {
		uuid, _, _ := strings.Cut(id, "::")
		a.recentAlloc[uuid] = now
	}
}

// heldMIG maps each MIG device a container holds to the holder: the kubelet's
// pod-resources answer, asked afresh because destroying is at stake, plus
// recent allocations it may not list yet.
func (a *Agent) heldMIG(ctx context.Context) map[string]string {
	held := map[string]string{}
	var answeredAt time.Time // when the kubelet last answered afresh
	if a.opts.Holdings != nil {
		att := a.opts.Holdings.Attribution()
		if r, ok := a.opts.Holdings.(refresher); ok {
			asked := a.now()
			if fresh, err := r.Refresh(ctx); err != nil {
				a.log.Warn("pod-resources not answering; MIG plans use its last answer", "error", err)
			} else {
				att, answeredAt = fresh, asked
			}
		}
		for _, g := range a.inv.GPUs {
			for _, m := range g.Instances {
				if hs := att.Holders(m.UUID); len(hs) > 0 {
					held[m.UUID] = hs[0].String()
				}
			}
		}
	}
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	for uuid, at := range a.recentAlloc {
		// A fresh answer from well after the allocation is authoritative:
		// the kubelet had time to list it, so a device it omits is free.
		if !answeredAt.IsZero() && answeredAt.Sub(at) > recentSettle {
			delete(a.recentAlloc, uuid)
			continue
		}
		if _, ok := held[uuid]; !ok && a.now().Sub(at) <= recentHold {
			held[uuid] = "a container allocated it at " + at.Format(time.TimeOnly) + " (not yet listed by the kubelet)"
		}
	}
	return held
}

// migStatus lists the GPUs' MIG states in GPU order.
func (a *Agent) migStatus() []MIGState {
	out := slices.Collect(maps.Values(a.migStates))
	slices.SortFunc(out, func(x, y MIGState) int { return x.GPU - y.GPU })
	return out
}
