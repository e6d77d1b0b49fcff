// Package v1beta1 holds the Go types of NVIDIA's ComputeDomain API
// (resource.nvidia.com/v1beta1) as users of NVIDIA's DRA driver write it:
// the ComputeDomain custom resource and the opaque device configs of the
// compute-domain.nvidia.com driver. Field names, defaults and enums follow
// NVIDIA's published API so that the same manifests work unchanged; the
// code is gpu-agent's own.
package v1beta1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupName and Version are the API group and version NVIDIA's
// ComputeDomain CRD and opaque configs use.
const (
	GroupName = "resource.nvidia.com"
	Version   = "v1beta1"
	// APIVersion is GroupName/Version, as objects and opaque configs
	// carry it.
	APIVersion = GroupName + "/" + Version
)

// The kinds of this API.
const (
	KindComputeDomain              = "ComputeDomain"
	KindComputeDomainList          = "ComputeDomainList"
	KindComputeDomainChannelConfig = "ComputeDomainChannelConfig"
	KindComputeDomainDaemonConfig  = "ComputeDomainDaemonConfig"
)

// SchemeGroupVersion is the group and version of this API.
var SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: Version}

// AddToScheme registers ComputeDomain and ComputeDomainList with a scheme,
// for typed clients and informers.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &ComputeDomain{}, &ComputeDomainList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}

// ComputeDomain is a set of nodes whose GPUs share a multi-node NVLink
// domain for one workload: the pods of its channel claims get an IMEX
// channel, and IMEX daemons run on their nodes. Namespaced; its spec is
// immutable once created.
type ComputeDomain struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ComputeDomainSpec   `json:"spec,omitempty"`
	Status ComputeDomainStatus `json:"status,omitempty"`
}

// ComputeDomainSpec is what the user asks for.
type ComputeDomainSpec struct {
	// NumNodes is how many nodes the domain is expected to span (0 or
	// more, default 0). Deprecated in NVIDIA's API: with per-node daemon
	// readiness (its default) it only decides when the domain's status
	// turns Ready.
	NumNodes int `json:"numNodes"`
	// Channel describes the resource claim template through which pods
	// join the domain; required.
	Channel *ComputeDomainChannelSpec `json:"channel"`
}

// ComputeDomainChannelSpec names the template of the claims that give
// pods an IMEX channel of the domain.
type ComputeDomainChannelSpec struct {
	// ResourceClaimTemplate is the template the controller creates in
	// the domain's namespace; pods reference it by name.
	ResourceClaimTemplate ComputeDomainResourceClaimTemplate `json:"resourceClaimTemplate"`
	// AllocationMode is how many channels a claim gets: Single (default)
	// or All.
	AllocationMode AllocationMode `json:"allocationMode,omitempty"`
}

// ComputeDomainResourceClaimTemplate names a ResourceClaimTemplate.
type ComputeDomainResourceClaimTemplate struct {
	Name string `json:"name"`
}

// AllocationMode is how many IMEX channels a channel claim gets.
type AllocationMode string

// The allocation modes.
const (
	// AllocationModeSingle gives each claim one channel.
	AllocationModeSingle AllocationMode = "Single"
	// AllocationModeAll gives each claim every channel of the node.
	AllocationModeAll AllocationMode = "All"
)

// Status is a domain's or a node's readiness.
type Status string

// The statuses.
const (
	StatusReady    Status = "Ready"
	StatusNotReady Status = "NotReady"
)

// ComputeDomainStatus is what the controller reports.
type ComputeDomainStatus struct {
	// Status is Ready once every expected node has joined and is ready;
	// NotReady (the default) before.
	Status Status `json:"status"`
	// Nodes are the nodes that joined, one entry per name.
	Nodes []ComputeDomainNode `json:"nodes,omitempty"`
}

// ComputeDomainNode is one node of a domain.
type ComputeDomainNode struct {
	Name      string `json:"name"`
	IPAddress string `json:"ipAddress"`
	// CliqueID is the NVLink clique of the node's GPUs:
	// "<cluster UUID>.<clique id>".
	CliqueID string `json:"cliqueID"`
	// Index is the node's place in its clique: (CliqueID, Index) is
	// unique within the domain and fixes the node's IMEX peer name.
	Index  int    `json:"index"`
	Status Status `json:"status,omitempty"`
}

// ComputeDomainList is a list of ComputeDomains.
type ComputeDomainList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ComputeDomain `json:"items"`
}
