package agent

import (
	"fmt"
	"maps"
	"slices"

	"github.com/gpu-agent/gpu-agent/mig"
)

// Event reasons on the Node (kubectl describe node shows them).
const (
	ReasonConfigRejected   = "GPUConfigRejected"
	ReasonConfigNotFitting = "GPUConfigDoesNotFit"
	ReasonMIGApplied       = "MIGApplied"
	ReasonMIGPending       = "MIGPending"
	ReasonMIGFailed        = "MIGFailed"
	ReasonMIGReset         = "MIGResetRequired"
	ReasonMIGGPUReset      = "MIGGPUReset"
	ReasonGPUUnhealthy     = "GPUUnhealthy"
	ReasonGPURecovered     = "GPURecovered"
	ReasonGPUForgotten     = "GPUForgotten"
	ReasonCDISpecFailed    = "CDISpecNotWritten"
)

// maxEventMessage bounds an Event's message (the API server refuses more
// than 1 KiB); config errors can be long.
const maxEventMessage = 1000

// event records a Node Event when there is an API.
func (a *Agent) event(warning bool, reason, format string, args ...any) {
	if a.opts.Cluster == nil {
		return
	}
	msg := fmt.Sprintf(format, args...)
	if len(msg) > maxEventMessage {
		msg = msg[:maxEventMessage-3] + "..."
	}
	a.opts.Cluster.Event(warning, reason, msg)
}

// migEvent reports a GPU's MIG state change.
func (a *Agent) migEvent(st MIGState) {
	switch st.Phase {
	case mig.PhaseApplied:
		a.event(false, ReasonMIGApplied, "GPU %d (%s): MIG layout %s applied", st.GPU, st.UUID, st.Want)
	case mig.PhasePending:
		a.event(false, ReasonMIGPending, "GPU %d (%s): MIG layout %s pending: %s", st.GPU, st.UUID, st.Want, st.Reason)
	case mig.PhaseResetRequired:
		a.event(true, ReasonMIGReset, "GPU %d (%s): %s", st.GPU, st.UUID, st.Reason)
	case mig.PhaseFailed:
		a.event(true, ReasonMIGFailed, "GPU %d (%s): MIG layout %s failed: %s", st.GPU, st.UUID, st.Want, st.Reason)
	}
}

// healthEvents reports GPUs that turned unhealthy or recovered since the
// last call: a GPU-wide health cause, or a GPU the inventory cannot read.
func (a *Agent) healthEvents() {
	now := map[string]string{}
	index := map[string]int{}
	if a.health != nil {
		for _, c := range a.health.Causes {
			if _, seen := now[c.GPU]; !seen && c.GPUWide() {
				now[c.GPU], index[c.GPU] = c.Reason, c.Index
			}
		}
	}
	for uuid, f := range a.failed {
		if _, seen := now[uuid]; !seen {
			now[uuid], index[uuid] = f.Reason, f.GPU.Index
		}
	}
	prev := a.unhealthyGPUs
	a.unhealthyGPUs = now
	for _, uuid := range slices.Sorted(maps.Keys(now)) {
		if prev[uuid] != now[uuid] {
			a.event(true, ReasonGPUUnhealthy, "GPU %d (%s) unhealthy: %s", index[uuid], uuid, now[uuid])
		}
	}
	for _, uuid := range slices.Sorted(maps.Keys(prev)) {
		if _, still := now[uuid]; !still && (a.inv == nil || a.inv.HasDevice(uuid)) { // a GPU forgotten did not recover
			a.event(false, ReasonGPURecovered, "GPU %s recovered (was: %s)", uuid, prev[uuid])
		}
	}
}

// publishCluster hands the node labels to the API side.
func (a *Agent) publishCluster() {
	if a.opts.Cluster == nil || a.inv == nil {
		return
	}
	cfg := a.lastGood
	if cfg.Config == nil {
		cfg = a.selected
	}
	a.opts.Cluster.SetLabels(withoutGFDLabels(NodeLabels(a.inv, cfg, a.migStatus()), a.conflicts.GFD))
}
