package deploy

import (
	"reflect"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/admission"
)

var (
	domainsGVR = schema.GroupVersionResource{Group: "resource.nvidia.com", Version: "v1beta1", Resource: "computedomains"}
	domainGVK  = schema.GroupVersionKind{Group: "resource.nvidia.com", Version: "v1beta1", Kind: "ComputeDomain"}
)

// computeDomainInstalls are the manifests with the computedomains component and the chart with
// computeDomains.enabled, with the service account and namespace each runs the agent as.
func computeDomainInstalls(t *testing.T) []install {
	t.Helper()
	m, _ := loadManifests(t)
	comp := loadComputeDomainsComponent(t)
	m.ClusterRoles = append(m.ClusterRoles, comp.ClusterRoles...)
	m.Policies = append(m.Policies, comp.Policies...)
	m.PolicyBindings = append(m.PolicyBindings, comp.PolicyBindings...)
	h, err := renderChart(t, "computeDomains: {enabled: true}\n")
	if err != nil {
		t.Fatal(err)
	}
	ds := agentDaemonSet(h)
	return []install{
		{"manifests", "gpu-agent", "gpu-agent", m},
		{"chart", ds.Spec.Template.Spec.ServiceAccountName, ds.Namespace, h},
	}
}

// cdEntry is one status.nodes entry.
type cdEntry struct {
	name, ip, clique string
	index            int64
	status           string
}

// computeDomain is a ComputeDomain as the controller writes its status.
func computeDomain(status string, entries ...cdEntry) *unstructured.Unstructured {
	var nodes []any
	for _, e := range entries {
		n := map[string]any{"name": e.name, "ipAddress": e.ip, "cliqueID": e.clique, "index": e.index}
		if e.status != "" {
			n["status"] = e.status
		}
		nodes = append(nodes, n)
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": "job", "namespace": "ml", "uid": "9a1c", "resourceVersion": "7"},
		"spec":     map[string]any{"numNodes": int64(2), "channel": map[string]any{"resourceClaimTemplate": map[string]any{"name": "job-channel"}}},
		"status":   map[string]any{"status": status, "nodes": nodes},
	}}
}

// The node side's write of a ComputeDomain's status (docs/compute-domains.md, the contract): the status of its
// own node's entry, and nothing else. The policy is run on the objects before and after the write, as the API
// server gives them to admission after merging an apply.
func TestComputeDomainStatusPolicy(t *testing.T) {
	const clique = "5f8e.1"
	mine := cdEntry{agentNode, "10.0.0.1", clique, 0, "NotReady"}
	theirs := cdEntry{anotherNode, "10.0.0.2", clique, 1, "NotReady"}
	with := func(e cdEntry, f func(e *cdEntry)) cdEntry { f(&e); return e }
	ready := func(e *cdEntry) { e.status = "Ready" }
	old := computeDomain("NotReady", mine, theirs)
	const on = "gpu-agent on node " + agentNode
	const cd = " of ComputeDomain ml/job"
	tests := []struct {
		name     string
		obj, old *unstructured.Unstructured
		node     string
		other    bool
		want     string
	}{
		{name: "its entry Ready", node: agentNode, old: old, obj: computeDomain("NotReady", with(mine, ready), theirs)},
		{name: "its entry NotReady again", node: agentNode, old: computeDomain("Ready", with(mine, ready), with(theirs, ready)),
			obj: computeDomain("Ready", mine, with(theirs, ready))},
		{name: "its entry's status set where none was", node: agentNode,
			old: computeDomain("NotReady", with(mine, func(e *cdEntry) { e.status = "" }), theirs), obj: old},
		{name: "nothing changed", node: agentNode, old: old, obj: old},
		{name: "another node's entry", node: agentNode, old: old, obj: computeDomain("NotReady", mine, with(theirs, ready)),
			want: "Forbidden: " + on + " may not change the status.nodes entries " + anotherNode + cd + ": only its own"},
		{name: "the aggregate", node: agentNode, old: old, obj: computeDomain("Ready", with(mine, ready), theirs),
			want: "Forbidden: " + on + " may not change status.status" + cd + ": only the status of its own entry in status.nodes"},
		{name: "a new entry for itself", node: agentNode, old: computeDomain("NotReady", theirs),
			obj:  computeDomain("NotReady", theirs, with(mine, ready)),
			want: "Forbidden: " + on + " may not add, remove or reorder entries of status.nodes" + cd + ": only the status of its own entry"},
		{name: "another node's entry removed", node: agentNode, old: old, obj: computeDomain("NotReady", mine),
			want: "Forbidden: " + on + " may not add, remove or reorder entries of status.nodes" + cd + ": only the status of its own entry"},
		{name: "its index", node: agentNode, old: old, obj: computeDomain("NotReady", with(mine, func(e *cdEntry) { e.index = 5 }), theirs),
			want: "Forbidden: " + on + " may not change the name, address, clique or index of its entry in status.nodes" + cd + ": only its status"},
		{name: "its address", node: agentNode, old: old, obj: computeDomain("NotReady", with(mine, func(e *cdEntry) { e.ip = "10.9.9.9" }), theirs),
			want: "Forbidden: " + on + " may not change the name, address, clique or index of its entry in status.nodes" + cd + ": only its status"},
		{name: "its clique", node: agentNode, old: old, obj: computeDomain("NotReady", with(mine, func(e *cdEntry) { e.clique = "other.2" }), theirs),
			want: "Forbidden: " + on + " may not change the name, address, clique or index of its entry in status.nodes" + cd + ": only its status"},
		{name: "a token without the node claim", node: "", old: old, obj: computeDomain("NotReady", with(mine, ready), theirs),
			want: "Forbidden: gpu-agent's service account may write ComputeDomain status only with a token bound to a pod on a node: this request's token has no " + nodeNameKey},
		{name: "another service account (the controller)", node: "", other: true, old: old, obj: computeDomain("Ready")},
	}
	ins := computeDomainInstalls(t)
	mp, _ := policyFor(ins[0].o, "computedomains/status")
	hp, _ := policyFor(ins[1].o, "computedomains/status")
	if mp != nil && hp != nil {
		ms, hs := mp.Spec.DeepCopy(), hp.Spec.DeepCopy()
		ms.MatchConditions, hs.MatchConditions = nil, nil
		if !reflect.DeepEqual(ms, hs) {
			t.Error("the chart's ComputeDomain status policy differs from deploy/manifests/computedomains/policy.yaml")
		}
	}
	for _, in := range ins {
		checkPolicies(t, in.o, in.sa, in.ns)
		p, _ := policyFor(in.o, "computedomains/status")
		if p == nil {
			t.Fatalf("%s: no policy on ComputeDomain status", in.name)
		}
		c := compilePolicy(t, p)
		for _, tt := range tests {
			t.Run(in.name+"/"+tt.name, func(t *testing.T) {
				who := saUser(in.ns, in.sa, tt.node)
				if tt.other {
					who = saUser(in.ns, "gpu-agent-controller", tt.node)
				}
				if got := c.admit(t, admission.Update, domainsGVR, domainGVK, tt.obj, tt.old, who); got != tt.want {
					t.Errorf("%s:\n got %q\nwant %q", c.name, got, tt.want)
				}
			})
		}
	}
}
