package deploy

import (
	"context"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/cel/environment"
	"sigs.k8s.io/yaml"
)

// The ValidatingAdmissionPolicies that hold the agent's service account to its own node. Their CEL is compiled
// and run here with the API server's own admission code (k8s.io/apiserver), in the environment an API server of
// Kubernetes 1.30 (the first with admissionregistration.k8s.io/v1) offers for new expressions; the control-plane
// e2e (TestClusterAgentTokenPolicy) shows the same on a real API server.

const (
	nodeNameKey = "authentication.kubernetes.io/node-name"
	ownedLabels = "gpu-agent.io/owned-labels"
	draDriver   = "gpu.nvidia.com"
	agentNode   = "gpu-node-1"
	anotherNode = "gpu-node-2"
)

var (
	nodesGVR  = schema.GroupVersionResource{Version: "v1", Resource: "nodes"}
	nodeGVK   = schema.GroupVersionKind{Version: "v1", Kind: "Node"}
	slicesGVR = resourcev1.SchemeGroupVersion.WithResource("resourceslices")
	sliceGVK  = resourcev1.SchemeGroupVersion.WithKind("ResourceSlice")
	claimsGVR = resourcev1.SchemeGroupVersion.WithResource("resourceclaims")
	claimGVK  = resourcev1.SchemeGroupVersion.WithKind("ResourceClaim")
)

// policyFor returns the policy whose rules match resource, and its binding; nil if none does.
func policyFor(o *objects, resource string) (*admissionregistrationv1.ValidatingAdmissionPolicy, *admissionregistrationv1.ValidatingAdmissionPolicyBinding) {
	for _, p := range o.Policies {
		if p.Spec.MatchConstraints == nil {
			continue
		}
		for _, r := range p.Spec.MatchConstraints.ResourceRules {
			if slices.Contains(r.Resources, resource) {
				for _, b := range o.PolicyBindings {
					if b.Spec.PolicyName == p.Name {
						return p, b
					}
				}
				return p, nil
			}
		}
	}
	return nil, nil
}

// checkPolicies asserts that the install holds the agent's service account sa in namespace ns to its own node:
// a policy on Nodes and, for each of ResourceSlices and ResourceClaim status where RBAC lets it write them, one
// on those, each bound with Deny, failing closed, and matching that service account only.
func checkPolicies(t *testing.T, o *objects, sa, ns string) {
	t.Helper()
	resources := []string{"nodes"}
	for _, res := range []string{"resourceslices", "resourceclaims/status", "computedomains/status"} {
		if hasRule(o.ClusterRoles, res) {
			resources = append(resources, res)
		}
	}
	if len(o.Policies) != len(resources) || len(o.PolicyBindings) != len(resources) {
		t.Fatalf("got %d ValidatingAdmissionPolicies and %d bindings, want one each for %v", len(o.Policies), len(o.PolicyBindings), resources)
	}
	username := fmt.Sprintf("request.userInfo.username == 'system:serviceaccount:%s:%s'", ns, sa)
	groups := map[string]string{"nodes": "", "resourceslices": "resource.k8s.io", "resourceclaims/status": "resource.k8s.io",
		"computedomains/status": "resource.nvidia.com"}
	// A subresource is only ever updated (a patch or an apply is an UPDATE to admission).
	ops := map[string][]admissionregistrationv1.OperationType{"resourceclaims/status": {"UPDATE"}, "computedomains/status": {"UPDATE"}}
	for _, res := range resources {
		p, b := policyFor(o, res)
		if p == nil || b == nil {
			t.Errorf("no bound ValidatingAdmissionPolicy for %s", res)
			continue
		}
		if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionregistrationv1.Fail {
			t.Errorf("policy %s: failurePolicy %v, want Fail", p.Name, p.Spec.FailurePolicy)
		}
		if mc := p.Spec.MatchConditions; len(mc) != 1 || mc[0].Expression != username {
			t.Errorf("policy %s: matchConditions %+v, want only %q", p.Name, mc, username)
		}
		rules := p.Spec.MatchConstraints.ResourceRules
		wantOps, ok := ops[res]
		if !ok {
			wantOps = []admissionregistrationv1.OperationType{"CREATE", "UPDATE", "DELETE"}
		}
		if len(rules) != 1 || !slices.Equal(rules[0].APIGroups, []string{groups[res]}) || !slices.Equal(rules[0].Resources, []string{res}) ||
			!slices.Equal(rules[0].Operations, wantOps) {
			t.Errorf("policy %s: rules %+v, want %v of %s only", p.Name, rules, wantOps, res)
		}
		if !slices.Equal(b.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) ||
			b.Spec.MatchResources != nil || b.Spec.ParamRef != nil {
			t.Errorf("binding %s: %+v, want Deny on everything the policy matches", b.Name, b.Spec)
		}
	}
}

// compiledPolicy is a policy compiled as the API server compiles it (validating.compilePolicy): variables, then
// matchConditions, validations and their messageExpressions.
type compiledPolicy struct {
	name      string
	validator validating.Validator
}

func compilePolicy(t *testing.T, p *admissionregistrationv1.ValidatingAdmissionPolicy) compiledPolicy {
	t.Helper()
	envs := environment.MustBaseEnvSet(version.MajorMinor(1, 30))
	c, err := plugincel.NewCompositedCompiler(envs)
	if err != nil {
		t.Fatal(err)
	}
	// An expression that does not compile only shows when it is evaluated, and then as a denial like any
	// other: check each one here.
	withAuthz := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	for _, v := range p.Spec.Variables {
		if r := c.CompileAndStoreVariable(&validating.Variable{Name: v.Name, Expression: v.Expression}, withAuthz, environment.NewExpressions); r.Error != nil {
			t.Fatalf("policy %s: variable %s: %v", p.Name, v.Name, r.Error)
		}
	}
	var conds, messages []plugincel.ExpressionAccessor
	for _, v := range p.Spec.Validations {
		cond := &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason}
		if r := c.CompileCELExpression(cond, withAuthz, environment.NewExpressions); r.Error != nil {
			t.Fatalf("policy %s: validation %q: %v", p.Name, v.Expression, r.Error)
		}
		conds = append(conds, cond)
		var msg plugincel.ExpressionAccessor
		if v.MessageExpression != "" {
			m := &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression}
			if r := c.CompileCELExpression(m, plugincel.OptionalVariableDeclarations{}, environment.NewExpressions); r.Error != nil {
				t.Fatalf("policy %s: messageExpression %q: %v", p.Name, v.MessageExpression, r.Error)
			}
			msg = m
		}
		messages = append(messages, msg)
	}
	var match []plugincel.ExpressionAccessor
	for i := range p.Spec.MatchConditions {
		m := (*matchconditions.MatchCondition)(&p.Spec.MatchConditions[i])
		if r := c.CompileCELExpression(m, withAuthz, environment.NewExpressions); r.Error != nil {
			t.Fatalf("policy %s: matchCondition %q: %v", p.Name, m.Expression, r.Error)
		}
		match = append(match, m)
	}
	matcher := matchconditions.NewMatcher(c.CompileCondition(match, withAuthz, environment.NewExpressions),
		p.Spec.FailurePolicy, "policy", "validate", p.Name)
	return compiledPolicy{name: p.Name, validator: validating.NewValidator(
		c.CompileCondition(conds, withAuthz, environment.NewExpressions), matcher,
		c.CompileCondition(nil, withAuthz, environment.NewExpressions), // no audit annotations
		c.CompileCondition(messages, plugincel.OptionalVariableDeclarations{}, environment.NewExpressions),
		p.Spec.FailurePolicy, nil)}
}

// admit runs the policy on one request and returns "" if it lets the request through, else the message of
// the first validation that refused it (the one the API server returns), prefixed by the reason.
func (p compiledPolicy) admit(t *testing.T, op admission.Operation, gvr schema.GroupVersionResource, gvk schema.GroupVersionKind,
	obj, old runtime.Object, who user.Info) string {
	t.Helper()
	name := ""
	for _, o := range []runtime.Object{obj, old} {
		if o != nil {
			name = o.(metav1.Object).GetName()
		}
	}
	attr := admission.NewAttributesRecord(obj, old, gvk, "", name, gvr, "", op, nil, false, who)
	va := &admission.VersionedAttributes{Attributes: attr, VersionedKind: gvk,
		VersionedObject: admission.NewLazyObject(obj), VersionedOldObject: admission.NewLazyObject(old)}
	res := p.validator.Validate(context.Background(), gvr, va, nil, nil, celconfig.RuntimeCELCostBudget, nil)
	for _, d := range res.Decisions {
		if d.Action == validating.ActionDeny {
			if d.Evaluation == validating.EvalError {
				t.Errorf("policy %s: evaluation error: %s", p.name, d.Message)
			}
			return string(d.Reason) + ": " + d.Message
		}
	}
	return ""
}

// saUser is the agent's service account as the API server sees a token of it bound to a pod on node ("": a
// token without the node claim, like a legacy Secret token).
func saUser(ns, sa, node string) user.Info {
	u := &user.DefaultInfo{Name: "system:serviceaccount:" + ns + ":" + sa,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	if node != "" {
		u.Extra = map[string][]string{
			"authentication.kubernetes.io/pod-name": {"gpu-agent-x7k2p"},
			"authentication.kubernetes.io/pod-uid":  {"0b8e7f4c-4a3e-4c55-9a4e-1d7f0d6c2a11"},
			nodeNameKey:                             {node},
		}
	}
	return u
}

// gpuNode is a Node as the kubelet registers it, with labels and annotations.
func gpuNode(name string, labels, annotations map[string]string) *corev1.Node {
	l := map[string]string{"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"}
	maps.Copy(l, labels)
	a := map[string]string{"node.alpha.kubernetes.io/ttl": "0"}
	maps.Copy(a, annotations)
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("6f1c3c9e-node-" + name), ResourceVersion: "42", Labels: l, Annotations: a},
		Spec:       corev1.NodeSpec{PodCIDR: "10.244.1.0/24"},
		Status:     corev1.NodeStatus{Capacity: corev1.ResourceList{}},
	}
}

// installs are the objects of the manifests (with the DRA component) and of the chart (dra.enabled), with the
// service account and namespace each runs the agent as.
type install struct {
	name, sa, ns string
	o            *objects
}

func policyInstalls(t *testing.T) []install {
	t.Helper()
	m, _ := loadManifests(t)
	comp := loadDRAComponent(t)
	m.ClusterRoles = append(m.ClusterRoles, comp.ClusterRoles...)
	m.Policies = append(m.Policies, comp.Policies...)
	m.PolicyBindings = append(m.PolicyBindings, comp.PolicyBindings...)
	h, err := renderChart(t, "dra: {enabled: true}\n")
	if err != nil {
		t.Fatal(err)
	}
	ds := agentDaemonSet(h)
	return []install{
		{"manifests", "gpu-agent", "gpu-agent", m},
		{"chart", ds.Spec.Template.Spec.ServiceAccountName, ds.Namespace, h},
	}
}

func TestNodePolicy(t *testing.T) {
	owned := map[string]string{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.count": "8"}
	ownedList := map[string]string{ownedLabels: "nvidia.com/gpu.count,nvidia.com/gpu.product"}
	mine := gpuNode(agentNode, owned, ownedList)
	with := func(n *corev1.Node, f func(n *corev1.Node)) *corev1.Node {
		n = n.DeepCopy()
		f(n)
		return n
	}
	relabel := func(n *corev1.Node, set map[string]string, remove ...string) *corev1.Node {
		return with(n, func(n *corev1.Node) {
			maps.Copy(n.Labels, set)
			for _, k := range remove {
				delete(n.Labels, k)
			}
		})
	}
	annotate := func(n *corev1.Node, key, value string) *corev1.Node {
		return with(n, func(n *corev1.Node) { n.Annotations[key] = value })
	}
	const on = "gpu-agent on node " + agentNode
	tests := []struct {
		name     string
		op       admission.Operation
		obj, old *corev1.Node
		node     string // the token's node claim
		other    bool   // another service account (same name, another namespace)
		want     string // "": admitted
	}{
		{name: "own labels on its node", op: admission.Update, node: agentNode,
			old: gpuNode(agentNode, nil, nil), obj: gpuNode(agentNode, owned, ownedList)},
		{name: "MIG labels and mig.config.state", op: admission.Update, node: agentNode, old: mine,
			obj: annotate(relabel(mine, map[string]string{"nvidia.com/mig-1g.10gb.count": "7", "nvidia.com/mig-1g.10gb.slices.gi": "1",
				"nvidia.com/mig.config.state": "success"}), ownedLabels, "nvidia.com/gpu.count,nvidia.com/gpu.product,nvidia.com/mig-1g.10gb.count,nvidia.com/mig-1g.10gb.slices.gi,nvidia.com/mig.config.state")},
		{name: "removes what it owns (node-cleanup)", op: admission.Update, node: agentNode, old: mine,
			obj: with(mine, func(n *corev1.Node) {
				delete(n.Labels, "nvidia.com/gpu.product")
				delete(n.Labels, "nvidia.com/gpu.count")
				delete(n.Annotations, ownedLabels)
			})},
		{name: "another Node", op: admission.Update, node: agentNode,
			old: gpuNode(anotherNode, nil, nil), obj: gpuNode(anotherNode, owned, ownedList),
			want: "Forbidden: " + on + " may not change Node " + anotherNode + ": only the Node it runs on"},
		{name: "a label that picks its config", op: admission.Update, node: agentNode, old: mine,
			obj:  relabel(mine, map[string]string{"gpu-agent.io/config": "a100-ts4", "nvidia.com/mig.config": "all-1g.5gb"}),
			want: "Forbidden: " + on + " may not change the label(s) gpu-agent.io/config, nvidia.com/mig.config of its Node: only the labels it owns"},
		{name: "removes a label it does not own", op: admission.Update, node: agentNode, old: mine,
			obj:  relabel(mine, nil, "kubernetes.io/hostname"),
			want: "Forbidden: " + on + " may not change the label(s) kubernetes.io/hostname of its Node: only the labels it owns"},
		{name: "an operator label under nvidia.com", op: admission.Update, node: agentNode, old: mine,
			obj:  relabel(mine, map[string]string{"nvidia.com/gpu.deploy.driver": "false"}),
			want: "Forbidden: " + on + " may not change the label(s) nvidia.com/gpu.deploy.driver of its Node: only the labels it owns"},
		{name: "a taint", op: admission.Update, node: agentNode, old: mine,
			obj: with(mine, func(n *corev1.Node) {
				n.Spec.Taints = []corev1.Taint{{Key: "nvidia.com/gpu", Effect: corev1.TaintEffectNoSchedule}}
			}),
			want: "Forbidden: " + on + " may change only the labels and annotations of its Node, not its spec, finalizers or owner references"},
		{name: "a finalizer", op: admission.Update, node: agentNode, old: mine,
			obj:  with(mine, func(n *corev1.Node) { n.Finalizers = []string{"gpu-agent.io/hold"} }),
			want: "Forbidden: " + on + " may change only the labels and annotations of its Node, not its spec, finalizers or owner references"},
		{name: "another annotation", op: admission.Update, node: agentNode, old: mine,
			obj:  annotate(mine, "node.alpha.kubernetes.io/ttl", "30"),
			want: "Forbidden: " + on + " may not change the annotation(s) node.alpha.kubernetes.io/ttl of its Node: only " + ownedLabels},
		{name: "claims a label it does not own", op: admission.Update, node: agentNode, old: mine,
			obj:  annotate(mine, ownedLabels, "kubernetes.io/hostname,nvidia.com/gpu.count,nvidia.com/gpu.product"),
			want: "Forbidden: " + on + " may not list kubernetes.io/hostname in " + ownedLabels + ": only the labels it owns"},
		{name: "a token without the node claim", op: admission.Update, node: "", old: mine, obj: mine,
			want: "Forbidden: gpu-agent's service account may write Nodes only with a token bound to a pod on a node: this request's token has no " + nodeNameKey},
		{name: "create a Node", op: admission.Create, node: agentNode, obj: gpuNode(anotherNode, nil, nil),
			want: "Forbidden: " + on + " may not create Nodes"},
		{name: "delete its Node", op: admission.Delete, node: agentNode, old: mine,
			want: "Forbidden: " + on + " may not delete Nodes"},
		{name: "another service account", op: admission.Update, node: agentNode, other: true,
			old: gpuNode(anotherNode, nil, nil), obj: relabel(gpuNode(anotherNode, nil, nil), map[string]string{"gpu-agent.io/config": "x"})},
	}
	for _, in := range policyInstalls(t) {
		p, _ := policyFor(in.o, "nodes")
		if p == nil {
			t.Fatalf("%s: no policy on Nodes", in.name)
		}
		c := compilePolicy(t, p)
		for _, tt := range tests {
			t.Run(in.name+"/"+tt.name, func(t *testing.T) {
				who := saUser(in.ns, in.sa, tt.node)
				if tt.other {
					who = saUser("other", in.sa, tt.node)
				}
				var obj, old runtime.Object
				if tt.obj != nil {
					obj = tt.obj
				}
				if tt.old != nil {
					old = tt.old
				}
				// CEL filters a map in Go's map order, so a message that
				// lists several labels lists them in any order.
				if got := c.admit(t, tt.op, nodesGVR, nodeGVK, obj, old, who); sortedLists(got) != sortedLists(tt.want) {
					t.Errorf("%s %s:\n got %q\nwant %q", tt.op, c.name, got, tt.want)
				}
			})
		}
	}
}

func TestResourceSlicePolicy(t *testing.T) {
	slice := func(name, node, driver string) *resourcev1.ResourceSlice {
		s := &resourcev1.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourcev1.ResourceSliceSpec{Driver: driver, Pool: resourcev1.ResourcePool{Name: node, ResourceSliceCount: 1},
				Devices: []resourcev1.Device{{Name: "gpu-0"}}},
		}
		if node != "" {
			s.Spec.NodeName = &node
		} else {
			all := true
			s.Spec.AllNodes = &all
		}
		return s
	}
	mine := slice(agentNode+"-gpu.nvidia.com-7xq2d", agentNode, draDriver)
	theirs := slice(anotherNode+"-gpu.nvidia.com-k2w9c", anotherNode, draDriver)
	const on = "gpu-agent on node " + agentNode
	tests := []struct {
		name     string
		op       admission.Operation
		obj, old *resourcev1.ResourceSlice
		node     string
		want     string
	}{
		{name: "create its own", op: admission.Create, node: agentNode, obj: mine},
		{name: "update its own", op: admission.Update, node: agentNode, old: mine, obj: mine},
		{name: "delete its own", op: admission.Delete, node: agentNode, old: mine},
		{name: "create another node's", op: admission.Create, node: agentNode, obj: theirs,
			want: "Forbidden: " + on + " may not create ResourceSlice " + theirs.Name + " of node " + anotherNode + ": only its own node's"},
		{name: "update another node's", op: admission.Update, node: agentNode, old: theirs, obj: theirs,
			want: "Forbidden: " + on + " may not update ResourceSlice " + theirs.Name + " of node " + anotherNode + ": only its own node's"},
		{name: "delete another node's", op: admission.Delete, node: agentNode, old: theirs,
			want: "Forbidden: " + on + " may not delete ResourceSlice " + theirs.Name + " of node " + anotherNode + ": only its own node's"},
		{name: "a slice for all nodes", op: admission.Create, node: agentNode, obj: slice("fabric", "", draDriver),
			want: "Forbidden: " + on + " may not create ResourceSlice fabric of no single node: only its own node's"},
		{name: "another driver on its node", op: admission.Create, node: agentNode, obj: slice("nic", agentNode, "nic.example.com"),
			want: "Forbidden: " + on + " may not create ResourceSlice nic of driver nic.example.com: only gpu.nvidia.com's and compute-domain.nvidia.com's"},
		// The compute-domain.nvidia.com driver it serves on fabric-attached nodes.
		{name: "its compute domain slice", op: admission.Create, node: agentNode, obj: slice("imex", agentNode, "compute-domain.nvidia.com")},
		{name: "a token without the node claim", op: admission.Create, node: "", obj: mine,
			want: "Forbidden: gpu-agent's service account may write ResourceSlices only with a token bound to a pod on a node: this request's token has no " + nodeNameKey},
	}
	for _, in := range policyInstalls(t) {
		p, _ := policyFor(in.o, "resourceslices")
		if p == nil {
			t.Fatalf("%s: no policy on ResourceSlices", in.name)
		}
		c := compilePolicy(t, p)
		for _, tt := range tests {
			t.Run(in.name+"/"+tt.name, func(t *testing.T) {
				var obj, old runtime.Object
				if tt.obj != nil {
					obj = tt.obj
				}
				if tt.old != nil {
					old = tt.old
				}
				if got := c.admit(t, tt.op, slicesGVR, sliceGVK, obj, old, saUser(in.ns, in.sa, tt.node)); got != tt.want {
					t.Errorf("%s %s:\n got %q\nwant %q", tt.op, c.name, got, tt.want)
				}
			})
		}
		// Nobody else is held to it: the kubelet deletes a node's slices when the driver goes.
		kubelet := &user.DefaultInfo{Name: "system:node:" + anotherNode, Groups: []string{"system:nodes"}}
		if got := c.admit(t, admission.Delete, slicesGVR, sliceGVK, nil, theirs, kubelet); got != "" {
			t.Errorf("%s: the kubelet deleting its node's slice: %s", in.name, got)
		}
	}
}

// claimOn is a ResourceClaim allocated as the scheduler allocates a node-local claim on node: gpu-0 of
// gpu.nvidia.com and nic-0 of nic.example.com from node's pools, the nodeSelector naming node, reserved for a
// pod, with nic.example.com's entry in status.devices. node "": not allocated.
func claimOn(node string) *resourcev1.ResourceClaim {
	c := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "train-0-gpu", Namespace: "ml", UID: "3d1f0c2e-claim", ResourceVersion: "7"},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{
			{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: draDriver}},
			{Name: "nic", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: "nic.example.com"}},
		}}},
	}
	if node == "" {
		return c
	}
	c.Status = resourcev1.ResourceClaimStatus{
		Allocation: &resourcev1.AllocationResult{
			Devices: resourcev1.DeviceAllocationResult{Results: []resourcev1.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: draDriver, Pool: node, Device: "gpu-0"},
				{Request: "nic", Driver: "nic.example.com", Pool: node, Device: "nic-0"},
			}},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{
				{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}},
			}}}},
		},
		ReservedFor: []resourcev1.ResourceClaimConsumerReference{{Resource: "pods", Name: "train-0", UID: "9a2b7c4d-pod"}},
		Devices:     []resourcev1.AllocatedDeviceStatus{deviceStatus("nic.example.com", node, "nic-0", "", "LinkUp")},
	}
	return c
}

func deviceStatus(driver, pool, device, shareID, reason string) resourcev1.AllocatedDeviceStatus {
	d := resourcev1.AllocatedDeviceStatus{Driver: driver, Pool: pool, Device: device, Conditions: []metav1.Condition{{
		Type: "Ready", Status: metav1.ConditionTrue, Reason: reason, LastTransitionTime: metav1.Unix(1767225600, 0),
	}}}
	if shareID != "" {
		d.ShareID = &shareID
	}
	return d
}

func TestResourceClaimStatusPolicy(t *testing.T) {
	with := func(c *resourcev1.ResourceClaim, f func(c *resourcev1.ResourceClaim)) *resourcev1.ResourceClaim {
		c = c.DeepCopy()
		f(c)
		return c
	}
	addEntry := func(c *resourcev1.ResourceClaim, d resourcev1.AllocatedDeviceStatus) *resourcev1.ResourceClaim {
		return with(c, func(c *resourcev1.ResourceClaim) { c.Status.Devices = append(c.Status.Devices, d) })
	}
	mine := claimOn(agentNode)
	prepared := addEntry(mine, deviceStatus(draDriver, agentNode, "gpu-0", "", "Prepared"))
	theirs := claimOn(anotherNode)
	released := func(c *resourcev1.ResourceClaim) *resourcev1.ResourceClaim {
		return with(c, func(c *resourcev1.ResourceClaim) { c.Status = resourcev1.ResourceClaimStatus{} })
	}
	selector := func(c *resourcev1.ResourceClaim, sel *corev1.NodeSelector) *resourcev1.ResourceClaim {
		return with(c, func(c *resourcev1.ResourceClaim) { c.Status.Allocation.NodeSelector = sel })
	}
	byName := func(op corev1.NodeSelectorOperator, names ...string) []corev1.NodeSelectorRequirement {
		return []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: op, Values: names}}
	}
	const on = "gpu-agent on node " + agentNode
	const claim = "ResourceClaim ml/train-0-gpu"
	notOneNode := "Forbidden: " + on + " may not change the status of " + claim + ", not allocated to one node: only of claims allocated to its node"
	entries := func(list string) string {
		return "Forbidden: " + on + " may not change the status.devices entries " + list + " of " + claim + ": only gpu.nvidia.com's, of pool " + agentNode
	}
	tests := []struct {
		name     string
		obj, old *resourcev1.ResourceClaim
		node     string
		other    bool
		want     string
	}{
		{name: "its entry, added", node: agentNode, old: mine, obj: prepared},
		{name: "its entry, changed", node: agentNode, old: prepared,
			obj: with(prepared, func(c *resourcev1.ResourceClaim) {
				c.Status.Devices[1].Conditions[0].Status = metav1.ConditionFalse
				c.Status.Devices[1].Conditions[0].Reason = "Unhealthy"
			})},
		{name: "its entry, removed", node: agentNode, old: prepared, obj: mine},
		{name: "entries of shares of one device", node: agentNode, old: mine,
			obj: addEntry(addEntry(mine, deviceStatus(draDriver, agentNode, "gpu-0", "6c0d", "Prepared")), deviceStatus(draDriver, agentNode, "gpu-0", "9e1a", "Prepared"))},
		{name: "nothing changed", node: agentNode, old: prepared, obj: prepared},
		{name: "release its node's claim", node: agentNode, old: mine, obj: released(mine),
			want: "Forbidden: " + on + " may not change status.allocation or status.reservedFor of " + claim + ": only its devices' entries in status.devices"},
		{name: "drop the reservation", node: agentNode, old: mine,
			obj:  with(mine, func(c *resourcev1.ResourceClaim) { c.Status.ReservedFor = nil }),
			want: "Forbidden: " + on + " may not change status.allocation or status.reservedFor of " + claim + ": only its devices' entries in status.devices"},
		{name: "another driver's entry, changed", node: agentNode, old: prepared,
			obj:  with(prepared, func(c *resourcev1.ResourceClaim) { c.Status.Devices[0].Conditions[0].Reason = "LinkDown" }),
			want: entries("nic.example.com/" + agentNode + "/nic-0")},
		{name: "another driver's entry, removed", node: agentNode, old: prepared,
			obj:  with(prepared, func(c *resourcev1.ResourceClaim) { c.Status.Devices = c.Status.Devices[1:] }),
			want: entries("nic.example.com/" + agentNode + "/nic-0")},
		{name: "another driver's entry, added", node: agentNode, old: with(prepared, func(c *resourcev1.ResourceClaim) { c.Status.Devices = c.Status.Devices[1:] }),
			obj: prepared, want: entries("nic.example.com/" + agentNode + "/nic-0")},
		{name: "allocate a claim to its node", node: agentNode, old: released(mine), obj: mine, want: notOneNode},
		{name: "another pool's entry", node: agentNode, old: mine,
			obj:  addEntry(mine, deviceStatus(draDriver, anotherNode, "gpu-0", "", "Prepared")),
			want: entries(draDriver + "/" + anotherNode + "/gpu-0")},
		{name: "a claim of another node", node: agentNode, old: theirs,
			obj:  addEntry(theirs, deviceStatus(draDriver, anotherNode, "gpu-0", "", "Prepared")),
			want: "Forbidden: " + on + " may not change the status of " + claim + ", allocated to node " + anotherNode + ": only of claims allocated to its node"},
		{name: "release a claim of another node", node: agentNode, old: theirs, obj: released(theirs),
			want: "Forbidden: " + on + " may not change the status of " + claim + ", allocated to node " + anotherNode + ": only of claims allocated to its node"},
		{name: "a claim not allocated", node: agentNode, old: claimOn(""), obj: claimOn(""), want: notOneNode},
		{name: "a claim on its node or another", node: agentNode,
			old:  selector(mine, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpIn, agentNode, anotherNode)}}}),
			obj:  selector(prepared, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpIn, agentNode, anotherNode)}}}),
			want: notOneNode},
		{name: "a claim on every node but another", node: agentNode,
			old:  selector(mine, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpNotIn, anotherNode)}}}),
			obj:  selector(prepared, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpNotIn, anotherNode)}}}),
			want: notOneNode},
		{name: "a claim on its node, by a label too", node: agentNode,
			old: selector(mine, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpIn, agentNode),
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}}}}}),
			obj: selector(prepared, &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: byName(corev1.NodeSelectorOpIn, agentNode),
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}}}}}),
			want: notOneNode},
		{name: "a claim with no node selector", node: agentNode, old: selector(mine, nil), obj: selector(prepared, nil), want: notOneNode},
		{name: "a token without the node claim", node: "", old: mine, obj: prepared,
			want: "Forbidden: gpu-agent's service account may write ResourceClaim status only with a token bound to a pod on a node: this request's token has no " + nodeNameKey},
		{name: "another service account", node: agentNode, other: true, old: theirs, obj: released(theirs)},
	}
	for _, in := range policyInstalls(t) {
		p, _ := policyFor(in.o, "resourceclaims/status")
		if p == nil {
			t.Fatalf("%s: no policy on ResourceClaim status", in.name)
		}
		c := compilePolicy(t, p)
		for _, tt := range tests {
			t.Run(in.name+"/"+tt.name, func(t *testing.T) {
				who := saUser(in.ns, in.sa, tt.node)
				if tt.other {
					who = saUser("other", in.sa, tt.node)
				}
				if got := c.admit(t, admission.Update, claimsGVR, claimGVK, tt.obj, tt.old, who); got != tt.want {
					t.Errorf("%s:\n got %q\nwant %q", c.name, got, tt.want)
				}
			})
		}
	}
}

// The chart's policies are the manifests', but for their names and the service account they match.
func TestPolicyChartMatchesManifests(t *testing.T) {
	ins := policyInstalls(t)
	m, h := ins[0], ins[1]
	for _, res := range []string{"nodes", "resourceslices", "resourceclaims/status"} {
		mp, _ := policyFor(m.o, res)
		hp, _ := policyFor(h.o, res)
		if mp == nil || hp == nil {
			t.Fatalf("%s: manifests policy %v, chart policy %v", res, mp, hp)
		}
		ms, hs := mp.Spec.DeepCopy(), hp.Spec.DeepCopy()
		ms.MatchConditions, hs.MatchConditions = nil, nil
		if !reflect.DeepEqual(ms, hs) {
			a, _ := yaml.Marshal(ms)
			b, _ := yaml.Marshal(hs)
			t.Errorf("%s: the chart's policy differs from the manifests':\nmanifests:\n%s\nchart:\n%s", res, a, b)
		}
	}
	off, err := renderChart(t, "admissionPolicy: {enabled: false}\ndra: {enabled: true}\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(off.Policies) != 0 || len(off.PolicyBindings) != 0 {
		t.Errorf("admissionPolicy.enabled false: %d policies, %d bindings rendered", len(off.Policies), len(off.PolicyBindings))
	}
}

// listInMessage is the comma-separated list a policy message names after
// "label(s) " or "annotation(s) ".
var listInMessage = regexp.MustCompile(`((?:label|annotation)\(s\) )([^ ,]+(?:, [^ ,]+)*)`)

// sortedLists is msg with each list of labels or annotations it names sorted.
func sortedLists(msg string) string {
	return listInMessage.ReplaceAllStringFunc(msg, func(m string) string {
		sub := listInMessage.FindStringSubmatch(m)
		items := strings.Split(sub[2], ", ")
		slices.Sort(items)
		return sub[1] + strings.Join(items, ", ")
	})
}

func TestSortedLists(t *testing.T) {
	for in, want := range map[string]string{
		"may not change the label(s) b.io/x, a.io/y of its Node":  "may not change the label(s) a.io/y, b.io/x of its Node",
		"may not change the annotation(s) z, y of its Node: only": "may not change the annotation(s) y, z of its Node: only",
		"may not change Node other: only the Node it runs on":     "may not change Node other: only the Node it runs on",
	} {
		if got := sortedLists(in); got != want {
			t.Errorf("sortedLists(%q) = %q, want %q", in, got, want)
		}
	}
}
