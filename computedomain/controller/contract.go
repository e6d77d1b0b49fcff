// Package controller is the cluster side of compute domains: `gpu-agent
// controller` reconciles NVIDIA's ComputeDomain resources
// (resource.nvidia.com/v1beta1). For each domain it makes the workload's
// ResourceClaimTemplate and the daemons' one, lists in status.nodes the
// nodes its workload's claims are allocated to (the node sides run the
// domain's IMEX daemon where their node is listed, with the listed nodes
// of their clique as peers), aggregates what the node sides report into
// status.status, tells the scheduler through DRA binding conditions when a
// node's daemon is ready, and cleans up behind a finalizer.
//
// The contract with the node side (package imex, the compute-domain.nvidia.com
// kubelet plugin) is this file: the names below, and NodeReports, which is
// how the controller reads what nodes report. docs/compute-domains.md,
// "Node side ↔ controller contract", describes it for people.
package controller

import (
	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
)

// Names shared with NVIDIA's driver, so that users' manifests and tools
// see the same objects.
const (
	// DriverName is the DRA driver of channels and daemons.
	DriverName = "compute-domain.nvidia.com"
	// DeviceClassChannel selects a node's channel 0 (NVIDIA's default
	// channel class); the workload template asks for one device of it.
	// The node side publishes its channels with allowMultipleAllocations,
	// so every workload claim on a node, of any domain, is allocated a
	// share of that device (a result with a shareID), and Prepare gives
	// each its domain's own host channel.
	DeviceClassChannel = "compute-domain-default-channel.nvidia.com"
	// DeviceClassDaemon selects a node's daemon device.
	DeviceClassDaemon = "compute-domain-daemon.nvidia.com"
	// Finalizer holds a deleted domain until its labels, daemons and
	// templates are gone.
	Finalizer = "resource.nvidia.com/computeDomain"
	// LabelDomain carries a domain's UID on its templates and on the
	// claims made from them. (NVIDIA's driver also puts it on Nodes, to
	// pull a daemon pod in, one domain per node; gpu-agent's node side runs
	// daemons itself, one per domain, so no Node is labelled.)
	LabelDomain = "resource.nvidia.com/computeDomain"
	// LabelTarget tells the two templates apart: TargetWorkload or
	// TargetDaemon.
	LabelTarget    = "resource.nvidia.com/computeDomainTarget"
	TargetWorkload = "Workload"
	TargetDaemon   = "Daemon"
	// LabelClique is the node side's label of a node's NVLink clique
	// ("<cluster UUID>.<clique id>"; absent: not fabric-attached). The
	// controller copies it into the node's status entry.
	LabelClique = "nvidia.com/gpu.clique"
	// DaemonTemplatePrefix + the domain's UID names the daemons' template
	// in the controller's namespace.
	DaemonTemplatePrefix = "computedomain-daemon-"
)

// gpu-agent's own names of the contract.
const (
	// ConditionDaemonReady is the binding condition the node side puts on
	// its channel devices (ResourceSlice bindingConditions) where the API
	// server serves them: the controller sets it True in the claim's
	// status.devices once the domain's daemon on the claim's node is
	// Ready, and only then does the scheduler bind the pod.
	ConditionDaemonReady = "compute-domain.nvidia.com/DaemonReady"
	// ConditionDaemonFailed is the binding failure condition: the
	// controller sets it True when the node cannot join the domain (its
	// clique has no free index), and the scheduler then allocates the
	// claim elsewhere.
	ConditionDaemonFailed = "compute-domain.nvidia.com/DaemonFailed"
	// FieldManager is the controller's server-side apply field manager
	// (claims' status.devices conditions).
	FieldManager = "compute-domain.nvidia.com/controller"
	// NodeFieldManagerPrefix + the node's name is the field manager each
	// node side applies its own status.nodes entry under.
	NodeFieldManagerPrefix = "compute-domain.nvidia.com/"
	// MaxNodesPerClique bounds the indices of one clique (0 to 17): an
	// NVL72 rack has 18 compute trays, and the daemons' node list has one
	// name per index.
	MaxNodesPerClique = 18
)

// NodeReport is what one node side says of its part of a domain: whether
// its daemon for the domain is ready. (Its address is the Node's, which
// the controller reads itself.)
type NodeReport struct {
	Status cdv1.Status
}

// NodeReports reads what the node sides reported for a domain, by node
// name. The default, StatusReports, reads the domain's own status.nodes
// entries, where each node side applies the status field of its entry; a
// node side that reports elsewhere (an object of its own per node, or the
// claims' device status) plugs in here without touching the rest of the
// controller.
type NodeReports interface {
	Reports(cd *cdv1.ComputeDomain) map[string]NodeReport
}

// StatusReports reads the reports from status.nodes.
type StatusReports struct{}

// Reports returns each entry's status.
func (StatusReports) Reports(cd *cdv1.ComputeDomain) map[string]NodeReport {
	out := make(map[string]NodeReport, len(cd.Status.Nodes))
	for _, n := range cd.Status.Nodes {
		out[n.Name] = NodeReport{Status: n.Status}
	}
	return out
}

// DaemonTemplateName names the daemons' ResourceClaimTemplate of a domain.
func DaemonTemplateName(uid string) string { return DaemonTemplatePrefix + uid }
