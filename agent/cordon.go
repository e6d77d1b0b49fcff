package agent

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Cordoning takes single GPUs out of service without draining the node: an
// admin lists them in the Node's gpu-agent.io/cordon annotation (kube
// CordonAnnotation), the node watcher hands the list to the loop
// (CordonChanged), and Plan withdraws every device on those GPUs from new
// work: unhealthy to the kubelet ("cordoned"), tainted NoSchedule in the DRA
// pool under a key of its own, dra.TaintCordoned (left out where the API
// server drops taints), and no MIG layout or dynamic MIG device is made on
// them. Containers that hold one keep it; removing a GPU from the list
// brings it back at the next pass. The list is checkpointed, so that a
// restarted agent withdraws them before its Node watch answers.

// ReasonCordoned is the reason the kubelet and /status are given for a
// cordoned GPU's devices.
const ReasonCordoned = "cordoned"

// ReasonCordonUnknown is the Node Event of an annotation entry that names
// no GPU of the node.
const ReasonCordonUnknown = "GPUCordonUnknown"

// CordonChanged carries the GPUs the Node's cordon annotation lists (UUIDs
// or NVML indices, as written; kube.SplitCordon).
type CordonChanged struct{ GPUs []string }

func (CordonChanged) kind() string { return "cordon" }

// CordonStatus is what /status says of cordoned GPUs.
type CordonStatus struct {
	GPUs []CordonedGPU `json:"gpus,omitempty"`
	// Unknown are annotation entries that name no GPU of the node; they
	// are ignored.
	Unknown []string `json:"unknown,omitempty"`
}

// CordonedGPU is one GPU taken out of service, and how the annotation
// named it.
type CordonedGPU struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	As    string `json:"as"`
}

// Cordon resolves the snapshot's cordon list against the GPUs it knows (read
// now or kept unread): a GPU UUID, or an NVML index written in decimal.
func (s Snapshot) Cordon() CordonStatus {
	var out CordonStatus
	if len(s.Cordoned) == 0 {
		return out
	}
	var gpus []gpu.GPU
	if s.Inventory != nil {
		gpus = slices.Clone(s.Inventory.GPUs)
	}
	for _, uuid := range slices.Sorted(maps.Keys(s.Failed)) {
		gpus = append(gpus, s.Failed[uuid].GPU)
	}
	seen := map[string]bool{}
	for _, as := range s.Cordoned {
		i := slices.IndexFunc(gpus, func(g gpu.GPU) bool { return g.UUID == as })
		if n, err := strconv.Atoi(as); i < 0 && err == nil && strconv.Itoa(n) == as {
			i = slices.IndexFunc(gpus, func(g gpu.GPU) bool { return g.Index == n })
		}
		if i < 0 {
			out.Unknown = append(out.Unknown, as)
			continue
		}
		if g := gpus[i]; !seen[g.UUID] {
			seen[g.UUID] = true
			out.GPUs = append(out.GPUs, CordonedGPU{Index: g.Index, UUID: g.UUID, As: as})
		}
	}
	slices.SortFunc(out.GPUs, func(x, y CordonedGPU) int { return x.Index - y.Index })
	return out
}

// has reports whether the GPU uuid is cordoned.
func (c CordonStatus) has(uuid string) bool {
	return slices.ContainsFunc(c.GPUs, func(g CordonedGPU) bool { return g.UUID == uuid })
}

// holdMIG is the MIG plan of a cordoned GPU not at its layout: none, and
// pending. The admin took the GPU out of service, perhaps to look at it,
// and repartitioning would change it under them; the layout applies once
// the GPU is uncordoned. A GPU already at its layout stays applied.
func (c CordonStatus) holdMIG(gm GPUMIG) GPUMIG {
	gm.Plan, gm.Waiting = mig.Plan{}, ""
	gm.State = mig.State{Phase: mig.PhasePending, Reason: "GPU cordoned (" + cordonAnnotation + "): its layout is applied once it is uncordoned"}
	return gm
}

// cordonAnnotation names the annotation in messages (kube.CordonAnnotation;
// the agent does not import kube).
const cordonAnnotation = "gpu-agent.io/cordon"

// withdrawCordoned marks every device on a cordoned GPU unhealthy in the
// catalog (the whole GPU, its replicas, its MIG devices: catalog.Device.GPU
// is the physical GPU; a device unhealthy for another reason keeps it, with
// "cordoned" added), and cordoned in the DRA pool (a MIG device or
// partition by its parent): the taint of its own, dra.TaintCordoned, so
// that a claim tolerating unhealthy devices is not given it. A device also
// unhealthy carries both taints, and the cordon's is never NoExecute
// (Device.Evict is the unhealthy taint's alone).
func withdrawCordoned(cat *catalog.Catalog, pool *devicemodel.Pool, c CordonStatus) {
	if len(c.GPUs) == 0 {
		return
	}
	byIndex := map[int]bool{}
	for _, g := range c.GPUs {
		byIndex[g.Index] = true
	}
	if cat != nil {
		for _, r := range cat.Resources {
			for i := range r.Devices {
				d := &r.Devices[i]
				if byIndex[d.GPU] {
					d.Healthy, d.Reason = false, joinReason(d.Reason, ReasonCordoned)
				}
			}
		}
	}
	if pool != nil {
		for i := range pool.Devices {
			d := &pool.Devices[i]
			if c.has(d.UUID) || d.Type == devicemodel.TypeMIG && c.has(d.ParentUUID) {
				d.Cordoned = ReasonCordoned
			}
		}
	}
}

func joinReason(reason, more string) string {
	switch {
	case reason == "":
		return more
	case strings.Contains(reason, more):
		return reason
	}
	return reason + "; " + more
}

// noteCordon keeps what the pass resolved for /status, and reports entries
// that name no GPU once each time the list of them changes: a typo must not
// pass silently, nor flood the log and the Node's Events.
func (a *Agent) noteCordon(c CordonStatus) {
	before := a.cordonStatus
	a.cordonStatus = c
	if !slices.Equal(before.GPUs, c.GPUs) {
		a.log.Info("cordoned GPUs", "gpus", cordonedNames(c.GPUs), "was", cordonedNames(before.GPUs))
	}
	if len(c.Unknown) == 0 || slices.Equal(before.Unknown, c.Unknown) {
		return
	}
	a.log.Warn("cordon annotation names GPUs this node does not have; ignoring them",
		"annotation", cordonAnnotation, "unknown", c.Unknown)
	a.event(true, ReasonCordonUnknown, "%s names no GPU of this node: %s (ignored; give a GPU UUID or index)",
		cordonAnnotation, strings.Join(c.Unknown, ", "))
}

func cordonedNames(gs []CordonedGPU) []string {
	out := make([]string, 0, len(gs))
	for _, g := range gs {
		out = append(out, fmt.Sprintf("%d (%s)", g.Index, g.UUID))
	}
	return out
}
