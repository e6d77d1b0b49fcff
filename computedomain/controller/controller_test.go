package controller

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
)

const ctlNamespace = "gpu-agent"

// testLog writes the controller's log to the test's.
type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// counter counts the API calls the controller makes, by verb and resource.
type counter struct {
	mu    sync.Mutex
	calls map[string]int
}

func (c *counter) react(a clienttesting.Action) (bool, runtime.Object, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := a.GetVerb() + " " + a.GetResource().Resource
	if sub := a.GetSubresource(); sub != "" {
		key += "/" + sub
	}
	c.calls[key]++
	return false, nil, nil
}

func (c *counter) watchReact(a clienttesting.Action) (bool, watch.Interface, error) {
	c.react(a)
	return false, nil, nil
}

func (c *counter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.calls)
}

// writes sums the calls that change something.
func writes(calls map[string]int) int {
	n := 0
	for k, v := range calls {
		switch strings.Fields(k)[0] {
		case "create", "update", "patch", "delete":
			n += v
		}
	}
	return n
}

// versions gives the fake's ComputeDomains the API server's optimistic
// concurrency, which the fake lacks: an update of an object at another
// resourceVersion than stored is a conflict. Without it a node side's
// report written between the controller's read and write would be lost,
// which the API server never allows.
type versions struct {
	mu sync.Mutex
	rv map[string]int
}

func (v *versions) react(a clienttesting.Action) (bool, runtime.Object, error) {
	var obj runtime.Object
	switch a := a.(type) {
	case clienttesting.CreateAction:
		obj = a.GetObject()
	case clienttesting.UpdateAction:
		obj = a.GetObject()
	default:
		return false, nil, nil
	}
	m, err := meta(obj)
	if err != nil {
		return true, nil, err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	key := m.GetNamespace() + "/" + m.GetName()
	have, known := v.rv[key]
	if a.GetVerb() == "update" && known && m.GetResourceVersion() != fmt.Sprint(have) {
		return true, nil, apierrors.NewConflict(Resource.GroupResource(), m.GetName(),
			fmt.Errorf("resourceVersion %s, stored %d", m.GetResourceVersion(), have))
	}
	v.rv[key] = have + 1
	m.SetResourceVersion(fmt.Sprint(have + 1))
	return false, nil, nil
}

type harness struct {
	t     *testing.T
	dyn   *dynamicfake.FakeDynamicClient
	kube  *fake.Clientset
	calls *counter
	ctl   *Controller
	stop  func()
	done  chan struct{}
}

func newHarness(t *testing.T, objs ...runtime.Object) *harness {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := cdv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	var domains, others []runtime.Object
	for _, o := range objs {
		if _, ok := o.(*cdv1.ComputeDomain); ok {
			domains = append(domains, o)
		} else {
			others = append(others, o)
		}
	}
	h := &harness{t: t, calls: &counter{calls: map[string]int{}}, done: make(chan struct{})}
	h.dyn = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(scheme,
		map[schema.GroupVersionResource]string{Resource: cdv1.KindComputeDomainList}, domains...)
	h.kube = fake.NewClientset(others...)
	h.dyn.PrependReactor("*", "computedomains", (&versions{rv: map[string]int{}}).react)
	h.dyn.PrependReactor("*", "*", h.calls.react)
	h.dyn.PrependWatchReactor("*", h.calls.watchReact)
	h.kube.PrependReactor("*", "*", h.calls.react)
	h.kube.PrependWatchReactor("*", h.calls.watchReact)
	ctl, err := New(Options{Dynamic: h.dyn, Kube: h.kube, Namespace: ctlNamespace,
		Log: slog.New(slog.NewTextHandler(testLog{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	h.ctl = ctl
	ctx, cancel := context.WithCancel(context.Background())
	h.stop = cancel
	go func() {
		defer close(h.done)
		if err := ctl.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-h.done })
	testwait.For(t, "informers synced", ctl.Synced)
	return h
}

func domain(name string, numNodes int, mode cdv1.AllocationMode) *cdv1.ComputeDomain {
	return &cdv1.ComputeDomain{
		TypeMeta:   metav1.TypeMeta{APIVersion: cdv1.APIVersion, Kind: cdv1.KindComputeDomain},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "team", UID: types.UID("uid-" + name)},
		Spec: cdv1.ComputeDomainSpec{NumNodes: numNodes, Channel: &cdv1.ComputeDomainChannelSpec{
			ResourceClaimTemplate: cdv1.ComputeDomainResourceClaimTemplate{Name: name + "-channel"},
			AllocationMode:        mode,
		}},
	}
}

func node(name, clique string) *corev1.Node {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1", Labels: map[string]string{"kubernetes.io/hostname": name}},
		Status: corev1.NodeStatus{
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}},
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: name},
				{Type: corev1.NodeInternalIP, Address: "10.0.0." + strings.TrimLeft(name, "abcdefghijklmnopqrstuvwxyz-")}},
		},
	}
	if clique != "" {
		n.Labels[LabelClique] = clique
	}
	return n
}

// claim is a claim made from a domain's workload template, allocated on
// node (unallocated with node ""), its channel published with binding
// conditions when bc is set.
func claim(cd *cdv1.ComputeDomain, name, node string, bc bool) *resourcev1.ResourceClaim {
	c := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cd.Namespace, UID: types.UID("claim-" + name),
			Labels: map[string]string{LabelDomain: string(cd.UID), LabelTarget: TargetWorkload}},
	}
	if node != "" {
		r := resourcev1.DeviceRequestAllocationResult{Request: requestChannel, Driver: DriverName, Pool: node, Device: "channel-0"}
		if bc {
			r.BindingConditions = []string{ConditionDaemonReady}
			r.BindingFailureConditions = []string{ConditionDaemonFailed}
		}
		c.Status.Allocation = &resourcev1.AllocationResult{
			Devices: resourcev1.DeviceAllocationResult{Results: []resourcev1.DeviceRequestAllocationResult{r}},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}}},
			}}},
		}
	}
	return c
}

func (h *harness) domain(ns, name string) *cdv1.ComputeDomain {
	h.t.Helper()
	u, err := h.dyn.Resource(Resource).Namespace(ns).Get(context.Background(), name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		h.t.Fatal(err)
	}
	cd, err := toDomain(u)
	if err != nil {
		h.t.Fatal(err)
	}
	return cd
}

func (h *harness) create(cd *cdv1.ComputeDomain) {
	h.t.Helper()
	u, err := fromDomain(cd)
	if err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.dyn.Resource(Resource).Namespace(cd.Namespace).Create(context.Background(), u, metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

// report is a node side applying the status of its entry.
func (h *harness) report(cd *cdv1.ComputeDomain, nodeName string, st cdv1.Status) {
	h.t.Helper()
	testwait.For(h.t, nodeName+" reports "+string(st), func() bool {
		have := h.domain(cd.Namespace, cd.Name)
		i := slices.IndexFunc(have.Status.Nodes, func(e cdv1.ComputeDomainNode) bool { return e.Name == nodeName })
		if i < 0 {
			return false
		}
		have.Status.Nodes[i].Status = st
		u, err := fromDomain(have)
		if err != nil {
			h.t.Fatal(err)
		}
		_, err = h.dyn.Resource(Resource).Namespace(cd.Namespace).UpdateStatus(context.Background(), u, metav1.UpdateOptions{})
		return err == nil
	})
}

func (h *harness) template(ns, name string) *resourcev1.ResourceClaimTemplate {
	h.t.Helper()
	t, err := h.kube.ResourceV1().ResourceClaimTemplates(ns).Get(context.Background(), name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		h.t.Fatal(err)
	}
	return t
}

func (h *harness) waitStatus(cd *cdv1.ComputeDomain, what string, ok func(cdv1.ComputeDomainStatus) bool) cdv1.ComputeDomainStatus {
	h.t.Helper()
	var st cdv1.ComputeDomainStatus
	testwait.For(h.t, what, func() bool {
		have := h.domain(cd.Namespace, cd.Name)
		if have == nil {
			return false
		}
		st = have.Status
		return ok(st)
	})
	return st
}

func entries(st cdv1.ComputeDomainStatus) string {
	var parts []string
	for _, e := range st.Nodes {
		parts = append(parts, fmt.Sprintf("%s@%s:%s#%d:%s", e.Name, e.IPAddress, e.CliqueID, e.Index, e.Status))
	}
	return string(st.Status) + " [" + strings.Join(parts, " ") + "]"
}

func TestDomainCreatedMakesTemplatesAndFinalizer(t *testing.T) {
	for _, mode := range []cdv1.AllocationMode{"", cdv1.AllocationModeSingle, cdv1.AllocationModeAll} {
		t.Run(string(mode), func(t *testing.T) {
			h := newHarness(t)
			cd := domain("train", 2, mode)
			h.create(cd)
			testwait.For(t, "workload and daemon templates", func() bool {
				return h.template("team", "train-channel") != nil && h.template(ctlNamespace, DaemonTemplateName("uid-train")) != nil
			})
			wl := h.template("team", "train-channel")
			want := mode
			if want == "" {
				want = cdv1.AllocationModeSingle
			}
			checkTemplate(t, wl, requestChannel, DeviceClassChannel, TargetWorkload, fmt.Sprintf(
				`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"uid-train","allocationMode":%q}`, want))
			if len(wl.OwnerReferences) != 1 || wl.OwnerReferences[0].UID != "uid-train" || !*wl.OwnerReferences[0].Controller {
				t.Errorf("workload template owner references %+v, want the domain as controller", wl.OwnerReferences)
			}
			checkTemplate(t, h.template(ctlNamespace, DaemonTemplateName("uid-train")), requestDaemon, DeviceClassDaemon, TargetDaemon,
				`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainDaemonConfig","domainID":"uid-train"}`)
			st := h.waitStatus(cd, "finalizer and NotReady", func(st cdv1.ComputeDomainStatus) bool { return st.Status == cdv1.StatusNotReady })
			if got := h.domain("team", "train").Finalizers; !slices.Equal(got, []string{Finalizer}) {
				t.Errorf("finalizers %v, want [%s]", got, Finalizer)
			}
			if len(st.Nodes) != 0 {
				t.Errorf("nodes %v before any workload", entries(st))
			}
		})
	}
}

func checkTemplate(t *testing.T, rct *resourcev1.ResourceClaimTemplate, request, class, target, config string) {
	t.Helper()
	if rct.Labels[LabelTarget] != target || rct.Spec.Labels[LabelDomain] == "" {
		t.Errorf("template %s labels %v, claims' labels %v: want target %s and the domain on both", rct.Name, rct.Labels, rct.Spec.Labels, target)
	}
	d := rct.Spec.Spec.Devices
	if len(d.Requests) != 1 || d.Requests[0].Name != request || d.Requests[0].Exactly == nil ||
		d.Requests[0].Exactly.DeviceClassName != class || d.Requests[0].Exactly.Count != 1 {
		t.Fatalf("template %s requests %+v, want one %s of class %s", rct.Name, d.Requests, request, class)
	}
	if len(d.Config) != 1 || d.Config[0].Opaque == nil || d.Config[0].Opaque.Driver != DriverName {
		t.Fatalf("template %s config %+v, want one opaque config for %s", rct.Name, d.Config, DriverName)
	}
	raw := d.Config[0].Opaque.Parameters.Raw
	if string(raw) != config {
		t.Errorf("template %s config\n %s\nwant\n %s", rct.Name, raw, config)
	}
	// The node side's strict decoder reads what the controller writes.
	if _, err := cdv1.DecodeConfig(raw); err != nil {
		t.Errorf("template %s: the node side refuses its config: %v", rct.Name, err)
	}
}

func TestWorkloadPlacementStatusAndBindingConditions(t *testing.T) {
	cd := domain("train", 2, "")
	h := newHarness(t, node("n1", "cu.1"), node("n2", "cu.1"), node("n3", "cu.1"),
		claim(cd, "w1", "n1", true), claim(cd, "w2", "n2", true), claim(cd, "w3", "", true))
	h.create(cd)
	st := h.waitStatus(cd, "both nodes joined", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 2 })
	if got := entries(st); got != "NotReady [n1@10.0.0.1:cu.1#0:NotReady n2@10.0.0.2:cu.1#1:NotReady]" {
		t.Errorf("status %s, want n1 and n2 at their InternalIPs, NotReady, with indices 0 and 1", got)
	}
	h.report(cd, "n1", cdv1.StatusReady)
	st = h.waitStatus(cd, "n1 ready", func(st cdv1.ComputeDomainStatus) bool { return st.Nodes[0].Status == cdv1.StatusReady })
	if st.Status != cdv1.StatusNotReady {
		t.Errorf("domain %s with one of two nodes ready", entries(st))
	}
	// n1's daemon is ready: its claim may bind; n2's may not yet.
	testwait.For(t, "n1's claim has DaemonReady", func() bool { return claimCondition(h, "w1", ConditionDaemonReady) })
	if claimCondition(h, "w2", ConditionDaemonReady) {
		t.Error("n2's claim is released before its daemon is ready")
	}
	h.report(cd, "n2", cdv1.StatusReady)
	st = h.waitStatus(cd, "domain ready", func(st cdv1.ComputeDomainStatus) bool { return st.Status == cdv1.StatusReady })
	if got := entries(st); got != "Ready [n1@10.0.0.1:cu.1#0:Ready n2@10.0.0.2:cu.1#1:Ready]" {
		t.Errorf("status %s", got)
	}
	testwait.For(t, "n2's claim has DaemonReady", func() bool { return claimCondition(h, "w2", ConditionDaemonReady) })
}

func claimCondition(h *harness, name, typ string) bool {
	c, err := h.kube.ResourceV1().ResourceClaims("team").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, d := range c.Status.Devices {
		if d.Driver == DriverName && d.Device == "channel-0" {
			for _, cond := range d.Conditions {
				if cond.Type == typ && cond.Status == metav1.ConditionTrue {
					return true
				}
			}
		}
	}
	return false
}

func TestNodeLeaves(t *testing.T) {
	cd := domain("train", 3, "")
	h := newHarness(t, node("n1", "cu.1"), node("n2", "cu.1"), node("n3", "cu.1"),
		claim(cd, "w1", "n1", false), claim(cd, "w2", "n2", false), claim(cd, "w3", "n3", false))
	h.create(cd)
	h.waitStatus(cd, "three nodes", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 3 })
	for _, n := range []string{"n1", "n2", "n3"} {
		h.report(cd, n, cdv1.StatusReady)
	}
	h.waitStatus(cd, "ready", func(st cdv1.ComputeDomainStatus) bool { return st.Status == cdv1.StatusReady })

	// n2 fails: its entry leaves, n1 and n3 keep their indices (their
	// daemons keep their peers' names), and numNodes 3 is no longer met.
	ctx := context.Background()
	n2, _ := h.kube.CoreV1().Nodes().Get(ctx, "n2", metav1.GetOptions{})
	n2.Status.Conditions[0].Status = corev1.ConditionUnknown
	if _, err := h.kube.CoreV1().Nodes().UpdateStatus(ctx, n2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	st := h.waitStatus(cd, "n2 left", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 2 })
	if got := entries(st); got != "NotReady [n1@10.0.0.1:cu.1#0:Ready n3@10.0.0.3:cu.1#2:Ready]" {
		t.Errorf("after n2 failed: %s", got)
	}
	// Its workload moves to n4 (the Job's new pod, a new claim): n4 takes
	// the free index 1.
	if _, err := h.kube.CoreV1().Nodes().Create(ctx, node("n4", "cu.1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.kube.ResourceV1().ResourceClaims("team").Create(ctx, claim(cd, "w4", "n4", false), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitStatus(cd, "n4 joined", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 3 })
	h.report(cd, "n4", cdv1.StatusReady)
	st = h.waitStatus(cd, "ready again", func(st cdv1.ComputeDomainStatus) bool { return st.Status == cdv1.StatusReady })
	if got := entries(st); got != "Ready [n1@10.0.0.1:cu.1#0:Ready n3@10.0.0.3:cu.1#2:Ready n4@10.0.0.4:cu.1#1:Ready]" {
		t.Errorf("after n4 joined: %s", got)
	}
	// n2 comes back while the pod stuck there still holds its claim: it
	// rejoins, at the next free index, NotReady until its daemon is.
	n2.Status.Conditions[0].Status = corev1.ConditionTrue
	if _, err := h.kube.CoreV1().Nodes().UpdateStatus(ctx, n2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	st = h.waitStatus(cd, "n2 back", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 4 })
	if got := entries(st); got != "NotReady [n1@10.0.0.1:cu.1#0:Ready n2@10.0.0.2:cu.1#3:NotReady n3@10.0.0.3:cu.1#2:Ready n4@10.0.0.4:cu.1#1:Ready]" {
		t.Errorf("after n2 came back: %s", got)
	}
	// The stuck pod is deleted, its claim with it: n2 leaves (its node side
	// stops the daemon). n3's Node is deleted: its entry goes.
	if err := h.kube.ResourceV1().ResourceClaims("team").Delete(ctx, "w2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitStatus(cd, "n2 left again", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 3 })
	if err := h.kube.CoreV1().Nodes().Delete(ctx, "n3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	st = h.waitStatus(cd, "n3 gone", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 2 })
	if got := entries(st); got != "NotReady [n1@10.0.0.1:cu.1#0:Ready n4@10.0.0.4:cu.1#1:Ready]" {
		t.Errorf("after n3 was deleted: %s", got)
	}
}

func TestCliquesIndexSeparately(t *testing.T) {
	cd := domain("train", 0, "")
	h := newHarness(t, node("a1", "cu.1"), node("a2", "cu.1"), node("b1", "cu.2"), node("x", ""),
		claim(cd, "w1", "a1", false), claim(cd, "w2", "a2", false), claim(cd, "w3", "b1", false), claim(cd, "w4", "x", false))
	h.create(cd)
	st := h.waitStatus(cd, "four nodes", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 4 })
	if got := entries(st); got != "NotReady [a1@10.0.0.1:cu.1#0:NotReady a2@10.0.0.2:cu.1#1:NotReady b1@10.0.0.1:cu.2#0:NotReady x@10.0.0.:#0:NotReady]" {
		t.Errorf("status %s", got)
	}
}

// TestDomainsShareANode: two domains' workloads on one node both list it
// (the node side runs a daemon per domain); each indexes its own nodes.
func TestDomainsShareANode(t *testing.T) {
	a, b := domain("a", 0, ""), domain("b", 0, "")
	h := newHarness(t, a, b, node("n1", "cu.1"), node("n2", "cu.1"),
		claim(a, "a1", "n1", false), claim(b, "b1", "n2", false), claim(b, "b2", "n1", false))
	sa := h.waitStatus(a, "a placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 1 })
	sb := h.waitStatus(b, "b placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 2 })
	if got := entries(sa) + " " + entries(sb); got != "NotReady [n1@10.0.0.1:cu.1#0:NotReady] NotReady [n1@10.0.0.1:cu.1#0:NotReady n2@10.0.0.2:cu.1#1:NotReady]" {
		t.Errorf("statuses %s", got)
	}
}

// TestFullCliqueRefuses: a clique holds 18 nodes of a domain; a 19th
// claim's node is refused, and with binding conditions the scheduler is
// told to place it elsewhere.
func TestFullCliqueRefuses(t *testing.T) {
	cd := domain("big", 0, "")
	var objs []runtime.Object
	for i := range MaxNodesPerClique + 1 {
		name := fmt.Sprintf("n%02d", i)
		objs = append(objs, node(name, "cu.1"), claim(cd, name, name, true))
	}
	h := newHarness(t, objs...)
	h.create(cd)
	st := h.waitStatus(cd, "18 placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == MaxNodesPerClique })
	if last := st.Nodes[len(st.Nodes)-1]; last.Name != "n17" || last.Index != 17 {
		t.Errorf("last entry %+v, want n17 at index 17", last)
	}
	testwait.For(t, "n18's claim has DaemonFailed", func() bool { return claimCondition(h, "n18", ConditionDaemonFailed) })
}

// markDeleted does what the API server does to a deleted object with
// finalizers (the fake client deletes at once).
func (h *harness) markDeleted(cd *cdv1.ComputeDomain) {
	h.t.Helper()
	have := h.domain(cd.Namespace, cd.Name)
	now := metav1.Now()
	have.DeletionTimestamp = &now
	u, err := fromDomain(have)
	if err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.dyn.Resource(Resource).Namespace(cd.Namespace).Update(context.Background(), u, metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func TestDeletionCleansUp(t *testing.T) {
	cd := domain("train", 2, "")
	h := newHarness(t, node("n1", "cu.1"), node("n2", "cu.1"),
		claim(cd, "w1", "n1", false), claim(cd, "w2", "n2", false))
	h.create(cd)
	h.waitStatus(cd, "placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == 2 })
	testwait.For(t, "finalizer", func() bool { return slices.Contains(h.domain("team", "train").Finalizers, Finalizer) })
	h.markDeleted(cd)
	testwait.For(t, "finalizer removed", func() bool {
		d := h.domain("team", "train")
		return d == nil || !slices.Contains(d.Finalizers, Finalizer)
	})
	// The node sides, no longer listed, stop the domain's daemons.
	if d := h.domain("team", "train"); d != nil && len(d.Status.Nodes) != 0 {
		t.Errorf("status.nodes %s left after the finalizer", entries(d.Status))
	}
	if h.template("team", "train-channel") != nil || h.template(ctlNamespace, DaemonTemplateName("uid-train")) != nil {
		t.Error("templates left behind")
	}
}

// TestSweepAfterControllerWasOff: a domain deleted while no controller ran
// (its finalizer removed by hand) left its daemon template; the
// controller's start removes it, and leaves a live domain's alone.
func TestSweepAfterControllerWasOff(t *testing.T) {
	live, gone := domain("live", 0, ""), domain("gone", 0, "")
	stale, err := daemonTemplate(gone, ctlNamespace)
	if err != nil {
		t.Fatal(err)
	}
	kept, err := daemonTemplate(live, ctlNamespace)
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, live, stale, kept)
	testwait.For(t, "stale template removed", func() bool { return h.template(ctlNamespace, DaemonTemplateName("uid-gone")) == nil })
	if h.template(ctlNamespace, DaemonTemplateName("uid-live")) == nil {
		t.Error("the live domain's template was deleted")
	}
}

func TestAllocatedNode(t *testing.T) {
	cd := domain("d", 0, "")
	bySelector := claim(cd, "a", "node-a", false)
	bySelector.Status.Allocation.Devices.Results[0].Pool = "pool-x"
	byPool := claim(cd, "b", "node-b", false)
	byPool.Status.Allocation.NodeSelector = nil
	otherDriver := claim(cd, "c", "node-c", false)
	otherDriver.Status.Allocation.NodeSelector = nil
	otherDriver.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	for _, tc := range []struct {
		claim *resourcev1.ResourceClaim
		want  string
	}{
		{bySelector, "node-a"},
		{byPool, "node-b"},
		{otherDriver, ""},
		{claim(cd, "d", "", false), ""},
	} {
		if got := allocatedNode(tc.claim); got != tc.want {
			t.Errorf("claim %s: node %q, want %q", tc.claim.Name, got, tc.want)
		}
	}
}

// TestAPICost measures what one domain costs the API server at 18 nodes:
// the controller's writes from creation through all nodes ready to
// deletion, and its watches, which do not grow with domains or nodes.
func TestAPICost(t *testing.T) {
	for _, tc := range []struct {
		nodes int
		// bc: the channels carry binding conditions (KEP-5007 served).
		bc bool
	}{{2, false}, {18, false}, {18, true}} {
		t.Run(fmt.Sprintf("%d nodes, binding conditions %v", tc.nodes, tc.bc), func(t *testing.T) {
			calls := measure(t, tc.nodes, 1, tc.bc)
			t.Logf("1 domain on %d nodes, binding conditions %v: %d writes; %v", tc.nodes, tc.bc, writes(calls), calls)
			// Per domain: two templates made and deleted, the finalizer
			// added and removed, and status writes, which coalesce: the
			// entries placed, Ready, emptied at deletion, and a few more
			// where events split a change. Per claim, where binding
			// conditions are served: one apply of its condition.
			limit := 4 + 2 + 6
			if tc.bc {
				limit += tc.nodes + 2
				// A reconcile retried after a status conflict may apply a
				// condition again that its informer has not shown yet (seen
				// once under -race on two busy cores): allow two such.
				if n := calls["patch resourceclaims/status"]; n < tc.nodes || n > tc.nodes+2 {
					t.Errorf("%d claim status applies, want one per claim (%d), or two more after retries", n, tc.nodes)
				}
			}
			if w := writes(calls); w > limit {
				t.Errorf("%d writes for one domain on %d nodes, want at most %d: %v", w, tc.nodes, limit, calls)
			}
			if w := calls["watch computedomains"] + calls["watch nodes"] + calls["watch resourceclaims"] + calls["watch resourceclaimtemplates"]; w != 4 {
				t.Errorf("%d watches, want 4 (one per kind)", w)
			}
		})
	}
}

// measure runs domains domains of nodes nodes each through their life and
// returns the controller's calls (the node sides' reports excluded).
func measure(t *testing.T, nodes, domains int, bc bool) map[string]int {
	var objs []runtime.Object
	var cds []*cdv1.ComputeDomain
	for d := range domains {
		cd := domain(fmt.Sprintf("d%d", d), nodes, "")
		cds = append(cds, cd)
		for i := range nodes {
			name := fmt.Sprintf("d%d-n%02d", d, i)
			objs = append(objs, node(name, "cu.1"), claim(cd, name, name, bc))
		}
	}
	h := newHarness(t, objs...)
	for _, cd := range cds {
		h.create(cd)
	}
	var reports int
	for _, cd := range cds {
		h.waitStatus(cd, "all placed", func(st cdv1.ComputeDomainStatus) bool { return len(st.Nodes) == nodes })
		for _, e := range h.domain(cd.Namespace, cd.Name).Status.Nodes {
			before := h.calls.snapshot()["update computedomains/status"]
			h.report(cd, e.Name, cdv1.StatusReady)
			reports += h.calls.snapshot()["update computedomains/status"] - before
		}
		h.waitStatus(cd, "ready", func(st cdv1.ComputeDomainStatus) bool { return st.Status == cdv1.StatusReady })
	}
	for _, cd := range cds {
		h.markDeleted(cd)
	}
	for _, cd := range cds {
		testwait.For(t, "cleaned up", func() bool {
			d := h.domain(cd.Namespace, cd.Name)
			return d == nil || !slices.Contains(d.Finalizers, Finalizer)
		})
	}
	h.stop()
	<-h.done
	calls := h.calls.snapshot()
	// The test's own calls: creating the domains, the node sides'
	// reports, marking them deleted.
	calls["create computedomains"] -= domains
	calls["update computedomains/status"] -= reports
	calls["update computedomains"] -= domains
	for k, v := range calls {
		if v == 0 || strings.HasPrefix(k, "get ") {
			delete(calls, k)
		}
	}
	return calls
}

func TestAPICostFlatPerDomain(t *testing.T) {
	one, three := measure(t, 18, 1, false), measure(t, 18, 3, false)
	// Status writes coalesce more or less depending on timing: a few
	// writes per domain of slack.
	if w1, w3 := writes(one), writes(three); w3 > 3*(w1+3) {
		t.Errorf("3 domains cost %d writes, 1 costs %d: not linear", w3, w1)
	}
	keys := slices.Collect(maps.Keys(three))
	sort.Strings(keys)
	for _, k := range keys {
		if strings.HasPrefix(k, "watch ") && three[k] != one[k] {
			t.Errorf("%s: %d with 3 domains, %d with 1", k, three[k], one[k])
		}
	}
}
