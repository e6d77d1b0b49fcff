//go:build e2e

package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	metaapply "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// The least-privilege issue's scenario: the ValidatingAdmissionPolicies of deploy/manifests and its DRA
// component hold gpu-agent's service account to the node its pod runs on. RBAC alone lets that service
// account patch every Node, write every ResourceSlice and, on Kubernetes 1.34 and 1.35, patch the status of
// every ResourceClaim.

const (
	otherNode    = "e2e-other-node"
	nodeNameKey  = "authentication.kubernetes.io/node-name"
	agentAccount = "system:serviceaccount:gpu-agent:gpu-agent"
	nicDriver    = "nic.example.com"
	// statusAuthzGate is the 1.36 API server's own check on ResourceClaim status writes (beta, on by default):
	// changing status.allocation or status.reservedFor needs resourceclaims/binding, and changing a driver's
	// status.devices entries needs resourceclaims/driver, whose associated-node: verb (all the agent has)
	// counts only on claims allocated to the node its token names. 1.34 and 1.35 have no such check; with
	// the gate off, a 1.36 API server validates these writes as they do.
	statusAuthzGate = "DRAResourceClaimGranularStatusAuthorization"
)

// agentToken mints a token for the agent's service account, bound to its pod when pod is given (as the
// kubelet's projected token is, so that it carries the pod's node), and returns a client that uses it.
func agentToken(t *testing.T, c *harness.Cluster, pod *corev1.Pod) kubernetes.Interface {
	t.Helper()
	ttl := int64(600)
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &ttl}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tr, err := c.Client.CoreV1().ServiceAccounts("gpu-agent").CreateToken(clusterCtx(t), "gpu-agent", req, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	client, err := c.TokenClient(tr.Status.Token)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// refused checks that err is the API server's refusal by policy with exactly the message want.
func refused(t *testing.T, what string, err error, resource, name, policy, want string) {
	t.Helper()
	full := fmt.Sprintf("%s %q is forbidden: ValidatingAdmissionPolicy '%s' with binding '%s' denied request: %s", resource, name, policy, policy, want)
	if !apierrors.IsForbidden(err) || err.Error() != full {
		t.Errorf("%s: got %v\nwant 403 %s", what, err, full)
		return
	}
	t.Logf("%s: refused: %s", what, want)
}

func probeSlice(name, node, driver string) *resourceapi.ResourceSlice {
	return &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driver,
			NodeName: &node,
			Pool:     resourceapi.ResourcePool{Name: "e2e-probe", ResourceSliceCount: 1},
			Devices:  []resourceapi.Device{{Name: "probe"}},
		},
	}
}

// allocatedClaim creates, as the admin, a ResourceClaim in default allocated the way the scheduler allocates
// a node-local claim: gpu-0 of gpu.nvidia.com and nic-0 of nic.example.com, both from node's pool, and a
// nodeSelector naming the node (one term, one matchFields on metadata.name). It is reserved for a consumer
// that is not a pod, which the resource claim controller leaves alone (it would release a reservation for a
// pod that does not exist, and then the claim), and carries nic.example.com's entry in status.devices, as
// that driver would write it.
func allocatedClaim(t *testing.T, c *harness.Cluster, name, node string) *resourceapi.ResourceClaim {
	t.Helper()
	ctx := clusterCtx(t)
	claims := c.Client.ResourceV1().ResourceClaims("default")
	claim, err := claims.Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{
			{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: draDriver}},
			{Name: "nic", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: nicDriver}},
		}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	claim.Status = resourceapi.ResourceClaimStatus{
		Allocation: &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: draDriver, Pool: node, Device: "gpu-0"},
				{Request: "nic", Driver: nicDriver, Pool: node, Device: "nic-0"},
			}},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{
				{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}},
			}}}},
		},
		ReservedFor: []resourceapi.ResourceClaimConsumerReference{
			{APIGroup: "e2e.example.com", Resource: "jobs", Name: name, UID: types.UID("e2e-job-" + name)},
		},
		Devices: []resourceapi.AllocatedDeviceStatus{{Driver: nicDriver, Pool: node, Device: "nic-0", Conditions: []metav1.Condition{{
			Type: "Ready", Status: metav1.ConditionTrue, Reason: "LinkUp", Message: "written by " + nicDriver, LastTransitionTime: metav1.Now(),
		}}}},
	}
	if claim, err = claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	return claim
}

// applyDeviceStatus writes one status.devices entry of claim as the agent's ClaimStatusWriter does: server-side
// apply of resourceclaims/status with the claim's UID, field manager gpu.nvidia.com/<node>, forced. The entry's
// Ready condition has the message msg: a write that differs from the entry there changes it.
func applyDeviceStatus(t *testing.T, as kubernetes.Interface, claim *resourceapi.ResourceClaim, node, driver, pool, device, msg string, dryRun bool) (*resourceapi.ResourceClaim, error) {
	t.Helper()
	entry := resourceapply.AllocatedDeviceStatus().WithDriver(driver).WithPool(pool).WithDevice(device).
		WithConditions(metaapply.Condition().WithType("Ready").WithStatus(metav1.ConditionTrue).WithReason("Prepared").
			WithMessage(msg).WithLastTransitionTime(metav1.Now()))
	cfg := resourceapply.ResourceClaim(claim.Name, claim.Namespace).WithUID(claim.UID).
		WithStatus(resourceapply.ResourceClaimStatus().WithDevices(entry))
	opts := metav1.ApplyOptions{FieldManager: draDriver + "/" + node, Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	return as.ResourceV1().ResourceClaims(claim.Namespace).ApplyStatus(clusterCtx(t), cfg, opts)
}

// TestClusterAgentTokenPolicy: a token of the agent's service account bound to the agent's pod names the pod's
// node to the API server; with it, patching the labels the agent owns on that Node works, and patching another
// Node, another label, the Node's spec, or writing a ResourceSlice of another node or another driver is refused
// with the policy's message; a ResourceSlice of its own node and driver may be written. A token without the node
// claim is refused outright. The agent itself keeps labelling its Node and publishing its slice.
// ResourceClaim status: the API server runs with statusAuthzGate off, so that it checks these writes no more
// than 1.34 and 1.35 do and the policy alone refuses: releasing a claim (clearing status.reservedFor and
// status.allocation) of its own node, any status write to a claim of another node, and writing another
// driver's status.devices entry; writing gpu.nvidia.com's entry of its own node's claim, as the agent does,
// is allowed.
func TestClusterAgentTokenPolicy(t *testing.T) {
	c, agent := installDRAWith(t, statusAuthzGate+"=false")
	ctx := clusterCtx(t)
	node := c.NodeName()
	pods, err := c.WaitPodsRunning(ctx, "gpu-agent", "app.kubernetes.io/name=gpu-agent", 1)
	if err != nil {
		t.Fatal(err)
	}
	as := agentToken(t, c, &pods[0])

	// What the API server makes of the token: the agent's service account, on the pod's node.
	review, err := as.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ui := review.Status.UserInfo
	if ui.Username != agentAccount || !slices.Equal(ui.Extra[nodeNameKey], []string{node}) {
		t.Fatalf("the pod-bound token is %s with extra %v; want %s with %s=[%s]", ui.Username, ui.Extra, agentAccount, nodeNameKey, node)
	}
	t.Logf("pod-bound token: %s, %s=%v", ui.Username, nodeNameKey, ui.Extra[nodeNameKey])

	// Another GPU node's Node object (no kubelet behind it), and a ResourceSlice of it, as the admin.
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: otherNode, Labels: map[string]string{"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	theirs, err := c.Client.ResourceV1().ResourceSlices().Create(ctx, probeSlice("e2e-other-node-slice", otherNode, draDriver), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	nodes := as.CoreV1().Nodes()
	label := func(key, value string) []byte {
		return fmt.Appendf(nil, `{"metadata":{"labels":{%q:%q}}}`, key, value)
	}
	on := "gpu-agent on node " + node
	// The policies take effect once the API server's admission informers hold them; until then RBAC alone
	// decides, and the patch goes through.
	eventually(t, "the policy refuses the agent's token a patch of another Node", func() bool {
		_, err = nodes.Patch(ctx, otherNode, types.MergePatchType, label("nvidia.com/gpu.count", "0"), metav1.PatchOptions{})
		return apierrors.IsForbidden(err)
	})
	_, err = nodes.Patch(ctx, otherNode, types.MergePatchType, label("nvidia.com/gpu.product", "e2e-stolen"), metav1.PatchOptions{})
	refused(t, "patch another Node's owned label", err, "nodes", otherNode, "gpu-agent-node", on+" may not change Node "+otherNode+": only the Node it runs on")

	// Its own Node: a label it owns, changed and put back.
	before, err := c.Node(ctx)
	if err != nil {
		t.Fatal(err)
	}
	family := before.Labels["nvidia.com/gpu.family"]
	if family == "" || !strings.Contains(before.Annotations["gpu-agent.io/owned-labels"], "nvidia.com/gpu.family") {
		t.Fatalf("node %s: nvidia.com/gpu.family=%q, owned-labels %q; want the agent's label", node, family, before.Annotations["gpu-agent.io/owned-labels"])
	}
	for _, v := range []string{"e2e-probe", family} {
		got, err := nodes.Patch(ctx, node, types.MergePatchType, label("nvidia.com/gpu.family", v), metav1.PatchOptions{})
		if err != nil || got.Labels["nvidia.com/gpu.family"] != v {
			t.Fatalf("patch its own Node's nvidia.com/gpu.family=%s: %v", v, err)
		}
	}
	t.Logf("patch its own Node's owned label nvidia.com/gpu.family: allowed")
	_, err = nodes.Patch(ctx, node, types.MergePatchType, label("gpu-agent.io/config", "e2e-stolen"), metav1.PatchOptions{})
	refused(t, "patch its own Node's config label", err, "nodes", node, "gpu-agent-node",
		on+" may not change the label(s) gpu-agent.io/config of its Node: only the labels it owns")
	_, err = nodes.Patch(ctx, node, types.MergePatchType, []byte(`{"spec":{"unschedulable":true}}`), metav1.PatchOptions{})
	refused(t, "cordon its own Node", err, "nodes", node, "gpu-agent-node",
		on+" may change only the labels and annotations of its Node, not its spec, finalizers or owner references")

	// ResourceSlices.
	slicesAs := as.ResourceV1().ResourceSlices()
	_, err = slicesAs.Create(ctx, probeSlice("e2e-stolen", otherNode, draDriver), metav1.CreateOptions{})
	refused(t, "create another node's ResourceSlice", err, "resourceslices.resource.k8s.io", "e2e-stolen", "gpu-agent-resourceslices",
		on+" may not create ResourceSlice e2e-stolen of node "+otherNode+": only its own node's")
	upd := theirs.DeepCopy()
	upd.Spec.Devices = append(upd.Spec.Devices, resourceapi.Device{Name: "probe-2"})
	_, err = slicesAs.Update(ctx, upd, metav1.UpdateOptions{})
	refused(t, "update another node's ResourceSlice", err, "resourceslices.resource.k8s.io", theirs.Name, "gpu-agent-resourceslices",
		on+" may not update ResourceSlice "+theirs.Name+" of node "+otherNode+": only its own node's")
	err = slicesAs.Delete(ctx, theirs.Name, metav1.DeleteOptions{})
	refused(t, "delete another node's ResourceSlice", err, "resourceslices.resource.k8s.io", theirs.Name, "gpu-agent-resourceslices",
		on+" may not delete ResourceSlice "+theirs.Name+" of node "+otherNode+": only its own node's")
	_, err = slicesAs.Create(ctx, probeSlice("e2e-nic", node, "nic.example.com"), metav1.CreateOptions{})
	refused(t, "create another driver's ResourceSlice on its node", err, "resourceslices.resource.k8s.io", "e2e-nic", "gpu-agent-resourceslices",
		on+" may not create ResourceSlice e2e-nic of driver nic.example.com: only gpu.nvidia.com's and compute-domain.nvidia.com's")
	// Its own node and driver: allowed. The agent's slice controller owns every gpu.nvidia.com slice of the node
	// and may delete this one first (through the same policy).
	if _, err := slicesAs.Create(ctx, probeSlice("e2e-own", node, draDriver), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create a ResourceSlice of its own node and driver: %v", err)
	}
	if err := slicesAs.Delete(ctx, "e2e-own", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("delete a ResourceSlice of its own node and driver: %v", err)
	}
	t.Logf("create and delete a ResourceSlice of its own node and driver: allowed")

	// ResourceClaim status.
	myClaim := allocatedClaim(t, c, "e2e-mine", node)
	theirClaim := allocatedClaim(t, c, "e2e-theirs", otherNode)
	const claimsRes, claimPolicy = "resourceclaims.resource.k8s.io", "gpu-agent-claim-status"
	eventually(t, "the policy refuses the agent's token a status write to a claim of another node", func() bool {
		_, err = applyDeviceStatus(t, as, theirClaim, node, draDriver, otherNode, "gpu-0", "e2e: probe", true)
		return apierrors.IsForbidden(err)
	})
	// (d) The agent's own write: its driver's entry, of its pool, in a claim allocated to its node.
	got, err := applyDeviceStatus(t, as, myClaim, node, draDriver, node, "gpu-0", "prepared on node "+node, false)
	if err != nil {
		t.Fatalf("write gpu.nvidia.com's status.devices entry of a claim allocated to its node: %v", err)
	}
	if len(got.Status.Devices) != 2 || got.Status.Allocation == nil || len(got.Status.ReservedFor) != 1 {
		t.Errorf("claim %s after the agent's write: devices %+v, allocation %v, reservedFor %v; want both drivers' entries, the allocation and the reservation kept",
			myClaim.Name, got.Status.Devices, got.Status.Allocation != nil, got.Status.ReservedFor)
	}
	t.Logf("write gpu.nvidia.com's status.devices entry of its own node's claim: allowed")
	// (c) Another driver's entry in its own node's claim.
	_, err = applyDeviceStatus(t, as, myClaim, node, nicDriver, node, "nic-0", "e2e: stolen", false)
	refused(t, "write another driver's status.devices entry", err, claimsRes, myClaim.Name, claimPolicy,
		on+" may not change the status.devices entries "+nicDriver+"/"+node+"/nic-0 of ResourceClaim default/"+myClaim.Name+": only gpu.nvidia.com's, of pool "+node)
	// A token without the node claim.
	_, err = applyDeviceStatus(t, agentToken(t, c, nil), myClaim, node, draDriver, node, "gpu-0", "e2e: unbound token", false)
	refused(t, "write claim status with an unbound token", err, claimsRes, myClaim.Name, claimPolicy,
		"gpu-agent's service account may write ResourceClaim status only with a token bound to a pod on a node: this request's token has no "+nodeNameKey)
	// (b) A claim allocated to another node: its gpu.nvidia.com entry, and releasing it.
	_, err = applyDeviceStatus(t, as, theirClaim, node, draDriver, otherNode, "gpu-0", "e2e: stolen", false)
	refused(t, "write a status.devices entry of another node's claim", err, claimsRes, theirClaim.Name, claimPolicy,
		on+" may not change the status of ResourceClaim default/"+theirClaim.Name+", allocated to node "+otherNode+": only of claims allocated to its node")
	release := []byte(`{"status":{"reservedFor":null,"allocation":null}}`)
	claimsAs := as.ResourceV1().ResourceClaims("default")
	_, err = claimsAs.Patch(ctx, theirClaim.Name, types.MergePatchType, release, metav1.PatchOptions{}, "status")
	refused(t, "release another node's claim", err, claimsRes, theirClaim.Name, claimPolicy,
		on+" may not change the status of ResourceClaim default/"+theirClaim.Name+", allocated to node "+otherNode+": only of claims allocated to its node")
	// (a) Releasing a claim allocated to its own node: the scheduler and the resource claim controller do that.
	_, err = claimsAs.Patch(ctx, myClaim.Name, types.MergePatchType, release, metav1.PatchOptions{}, "status")
	refused(t, "release its own node's claim", err, claimsRes, myClaim.Name, claimPolicy,
		on+" may not change status.allocation or status.reservedFor of ResourceClaim default/"+myClaim.Name+": only its devices' entries in status.devices")
	// Both claims are as the admin and the agent's allowed write left them.
	for _, cl := range []*resourceapi.ResourceClaim{myClaim, theirClaim} {
		now, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, cl.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var entries []string
		for _, d := range now.Status.Devices {
			msg := ""
			if len(d.Conditions) > 0 {
				msg = d.Conditions[0].Message
			}
			entries = append(entries, d.Driver+"/"+d.Pool+"/"+d.Device+" "+msg)
		}
		t.Logf("claim %s after the refusals: allocated %v, reservedFor %d, status.devices %q", cl.Name, now.Status.Allocation != nil, len(now.Status.ReservedFor), entries)
		want := []string{nicDriver + "/" + cl.Status.Devices[0].Pool + "/nic-0 written by " + nicDriver}
		if cl == myClaim {
			want = append([]string{draDriver + "/" + node + "/gpu-0 prepared on node " + node}, want...)
		}
		slices.Sort(entries)
		if now.Status.Allocation == nil || len(now.Status.ReservedFor) != 1 || !slices.Equal(entries, want) {
			t.Errorf("claim %s after the refusals: allocated %v, reservedFor %v, status.devices %q; want it allocated, reserved, with %q",
				cl.Name, now.Status.Allocation != nil, now.Status.ReservedFor, entries, want)
		}
	}

	// A token of the same service account without the node claim (not bound to a pod).
	_, err = agentToken(t, c, nil).CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, label("nvidia.com/gpu.family", family), metav1.PatchOptions{})
	refused(t, "patch its Node with an unbound token", err, "nodes", node, "gpu-agent-node",
		"gpu-agent's service account may write Nodes only with a token bound to a pod on a node: this request's token has no "+nodeNameKey)

	// Nothing the admin did was undone by the refusals.
	if n, err := c.Client.CoreV1().Nodes().Get(ctx, otherNode, metav1.GetOptions{}); err != nil || n.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-40GB" {
		t.Errorf("node %s after the refusals: %v (%v)", otherNode, n.GetLabels(), err)
	}

	// The agent's own writes go through the policies: a config change relabels its Node and reshapes its slice.
	setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	eventually(t, "the agent labels its Node for time-slicing x4", func() bool {
		l := nodeLabels(t, c)
		return l["nvidia.com/gpu.replicas"] == "4" && l["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
	})
	eventually(t, "gpu-0 shared 4 ways in the agent's ResourceSlice", func() bool {
		q, ok := nodeSlice(t, c)["gpu-0"].Capacity["shares"]
		return ok && q.Value.Value() == 4
	})
	var st struct {
		Cluster clusterStatus `json:"cluster"`
	}
	agentGet(t, agent, "/status", &st)
	if st.Cluster.API != "reachable" || st.Cluster.Labels.Error != "" || len(st.Cluster.Errors) != 0 || !st.Cluster.ConfigMap.InForce {
		t.Errorf("/status cluster %+v, want reachable, labels written, no errors, the ConfigMap in force", st.Cluster)
	}
	t.Logf("the agent under the policies: /status cluster %+v", st.Cluster)
}

// clusterStatus is /status's cluster: the API, the owned labels, the
// ConfigMap read through the API.
type clusterStatus struct {
	API    string   `json:"api"`
	Errors []string `json:"errors"`
	Labels struct {
		Owned int    `json:"owned"`
		Error string `json:"error"`
	} `json:"labels"`
	ConfigMap struct {
		Name    string `json:"name"`
		InForce bool   `json:"inForce"`
	} `json:"configMap"`
}
