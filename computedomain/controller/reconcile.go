package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func (c *Controller) sync(ctx context.Context, key string) error {
	if key == sweepKey {
		return c.sweep(ctx)
	}
	obj, exists, err := c.cdInformer.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	cd, err := toDomain(obj)
	if err != nil {
		return err
	}
	if cd.DeletionTimestamp != nil {
		return c.finalize(ctx, cd)
	}
	if !slices.Contains(cd.Finalizers, Finalizer) {
		if cd, err = c.setFinalizers(ctx, cd, append(slices.Clone(cd.Finalizers), Finalizer)); err != nil {
			return err
		}
	}
	spec := cd.Spec
	spec.Default()
	if err := spec.Validate(); err != nil {
		// The CRD's schema refuses such a spec, and the spec is
		// immutable: retrying cannot help.
		c.opts.Log.Error("compute domain: invalid spec, left alone", "domain", key, "err", err)
		return nil
	}
	cd.Spec = spec
	var errs []error
	if err := c.ensureTemplates(ctx, cd); err != nil {
		errs = append(errs, err)
	}
	claims := c.workloadClaims(string(cd.UID))
	refused := map[string]refusal{}
	status := c.desiredStatus(cd, claims, refused)
	if !apiequality.Semantic.DeepEqual(status, cd.Status) {
		next := cd.DeepCopy()
		next.Status = status
		if err := c.writeStatus(ctx, next); err != nil {
			return errors.Join(append(errs, err)...)
		}
	}
	errs = append(errs, c.bindingConditions(ctx, status, claims, refused))
	return errors.Join(errs...)
}

// ensureTemplates creates the domain's two templates, and puts back one
// that was changed or deleted by hand. A template of the workload's name
// that is not the domain's is left alone (and logged): it is a user's.
func (c *Controller) ensureTemplates(ctx context.Context, cd *cdv1.ComputeDomain) error {
	workload, err := workloadTemplate(cd)
	if err != nil {
		return err
	}
	daemon, err := daemonTemplate(cd, c.opts.Namespace)
	if err != nil {
		return err
	}
	var errs []error
	for _, want := range []*resourcev1.ResourceClaimTemplate{workload, daemon} {
		errs = append(errs, c.ensureTemplate(ctx, cd, want))
	}
	return errors.Join(errs...)
}

func (c *Controller) ensureTemplate(ctx context.Context, cd *cdv1.ComputeDomain, want *resourcev1.ResourceClaimTemplate) error {
	client := c.opts.Kube.ResourceV1().ResourceClaimTemplates(want.Namespace)
	obj, exists, err := c.rctInformer.GetIndexer().GetByKey(want.Namespace + "/" + want.Name)
	if err != nil {
		return err
	}
	if !exists {
		_, err := client.Create(ctx, want, metav1.CreateOptions{})
		if !apierrors.IsAlreadyExists(err) {
			if err != nil {
				return fmt.Errorf("domain %s/%s: create template %s/%s: %w", cd.Namespace, cd.Name, want.Namespace, want.Name, err)
			}
			return nil
		}
		// Made by an earlier pass the informer has not shown yet, or a
		// user's (not labelled, so never in the informer's view).
		if obj, err = client.Get(ctx, want.Name, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("domain %s/%s: template %s/%s: %w", cd.Namespace, cd.Name, want.Namespace, want.Name, err)
		}
	}
	have := obj.(*resourcev1.ResourceClaimTemplate)
	if have.Labels[LabelDomain] != string(cd.UID) {
		c.opts.Log.Error("compute domain: the ResourceClaimTemplate it asks for is not the domain's: left alone",
			"domain", cd.Namespace+"/"+cd.Name, "template", want.Namespace+"/"+want.Name, "of", have.Labels[LabelDomain])
		return nil
	}
	if apiequality.Semantic.DeepEqual(have.Spec, want.Spec) {
		return nil
	}
	// A template's spec is immutable: one edited by hand is replaced.
	// Claims already made from it keep what they were made with.
	if err := client.Delete(ctx, have.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &have.UID}}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("domain %s/%s: replace template %s/%s: %w", cd.Namespace, cd.Name, want.Namespace, want.Name, err)
	}
	_, err = client.Create(ctx, want, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("domain %s/%s: replace template %s/%s: %w", cd.Namespace, cd.Name, want.Namespace, want.Name, err)
	}
	return nil
}

// workloadClaims returns, by node, the allocated claims made from the
// domain's workload template: where the scheduler put the workload, known
// before any pod starts there (with binding conditions, before it is even
// bound).
func (c *Controller) workloadClaims(uid string) map[string][]*resourcev1.ResourceClaim {
	out := map[string][]*resourcev1.ResourceClaim{}
	for _, claim := range listByDomain[*resourcev1.ResourceClaim](c.claimInformer, uid) {
		if node := allocatedNode(claim); node != "" {
			out[node] = append(out[node], claim)
		}
	}
	return out
}

// allocatedNode is the node a claim's channel was allocated on: the
// allocation's node selector names it (a node-local device), or, without
// one, the pool of the driver's result (the kubelet plugin names its pool
// after its node).
func allocatedNode(claim *resourcev1.ResourceClaim) string {
	a := claim.Status.Allocation
	if a == nil {
		return ""
	}
	if ns := a.NodeSelector; ns != nil {
		for _, term := range ns.NodeSelectorTerms {
			for _, f := range term.MatchFields {
				if f.Key == "metadata.name" && f.Operator == corev1.NodeSelectorOpIn && len(f.Values) == 1 {
					return f.Values[0]
				}
			}
		}
	}
	for _, r := range a.Devices.Results {
		if r.Driver == DriverName {
			return r.Pool
		}
	}
	return ""
}

// refusal is why a node the workload landed on cannot join the domain.
type refusal string

func (c *Controller) node(name string) (*corev1.Node, bool) {
	obj, exists, _ := c.nodeInformer.GetIndexer().GetByKey(name)
	if !exists {
		return nil, false
	}
	n, ok := obj.(*corev1.Node)
	return n, ok
}

// nodeIP is the address a node's IMEX daemon binds and its peers reach:
// the daemons run in the agent, on the host network, so the Node's
// InternalIP (its ExternalIP where it has none).
func nodeIP(n *corev1.Node) string {
	for _, t := range []corev1.NodeAddressType{corev1.NodeInternalIP, corev1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			if a.Type == t {
				return a.Address
			}
		}
	}
	return ""
}

// desiredStatus is the domain's status from where its workload is and the
// node sides' reports. The entries are the domain's placement: a node side
// runs the domain's daemon once its node's entry is there, with the
// entries of its clique as peers. A node's entry is there while the
// workload is allocated on it, the Node exists and is Ready, and its
// clique has room; its index, once given, stays while the entry does, so
// a node leaving never renumbers the others (NVIDIA's #1418). A new entry
// takes its clique's smallest free index, the one a node that left gave
// up included. Several domains may share a node: the node side runs a
// daemon per domain, on ports of its own.
func (c *Controller) desiredStatus(cd *cdv1.ComputeDomain, claims map[string][]*resourcev1.ResourceClaim, refused map[string]refusal) cdv1.ComputeDomainStatus {
	reports := c.opts.Reports.Reports(cd)
	members := map[string]*corev1.Node{}
	for name := range claims {
		if node, ok := c.node(name); ok && nodeReady(node) {
			members[name] = node
		}
	}
	var nodes []cdv1.ComputeDomainNode
	used := map[string]map[int]bool{} // clique → indices
	take := func(clique string, index int) {
		if used[clique] == nil {
			used[clique] = map[int]bool{}
		}
		used[clique][index] = true
	}
	for _, e := range cd.Status.Nodes {
		node, ok := members[e.Name]
		if !ok || e.CliqueID != node.Labels[LabelClique] || used[e.CliqueID][e.Index] {
			continue
		}
		take(e.CliqueID, e.Index)
		nodes = append(nodes, e)
	}
	for _, name := range slices.Sorted(maps.Keys(members)) {
		if slices.ContainsFunc(nodes, func(e cdv1.ComputeDomainNode) bool { return e.Name == name }) {
			continue
		}
		clique := members[name].Labels[LabelClique]
		index := 0
		for used[clique][index] {
			index++
		}
		if index >= MaxNodesPerClique {
			refused[name] = refusal(fmt.Sprintf("clique %q has %d nodes of the domain already", clique, MaxNodesPerClique))
			continue
		}
		take(clique, index)
		nodes = append(nodes, cdv1.ComputeDomainNode{Name: name, CliqueID: clique, Index: index, Status: cdv1.StatusNotReady})
	}
	for i := range nodes {
		nodes[i].IPAddress = nodeIP(members[nodes[i].Name])
		if r, ok := reports[nodes[i].Name]; ok && r.Status != "" {
			nodes[i].Status = r.Status
		}
		if nodes[i].Status == "" {
			nodes[i].Status = cdv1.StatusNotReady
		}
	}
	slices.SortFunc(nodes, func(a, b cdv1.ComputeDomainNode) int { return strings.Compare(a.Name, b.Name) })
	// NVIDIA's rule: Ready once numNodes nodes joined and none is NotReady.
	status := cdv1.StatusReady
	if len(nodes) < cd.Spec.NumNodes || slices.ContainsFunc(nodes, func(e cdv1.ComputeDomainNode) bool { return e.Status != cdv1.StatusReady }) {
		status = cdv1.StatusNotReady
	}
	return cdv1.ComputeDomainStatus{Status: status, Nodes: nodes}
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// writeStatus replaces the status, at the resourceVersion read: a node
// side's write in between is a conflict, and the domain is reconciled
// again with it.
func (c *Controller) writeStatus(ctx context.Context, cd *cdv1.ComputeDomain) error {
	u, err := fromDomain(cd)
	if err != nil {
		return err
	}
	if _, err := c.domains.Namespace(cd.Namespace).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("domain %s/%s: status: %w", cd.Namespace, cd.Name, err)
	}
	return nil
}

// bindingConditions tells the scheduler, through each claim's
// status.devices, that the domain is ready for it on its node (the
// node's entry is Ready), or that the node cannot join. Only conditions
// the allocation asks for are written (the node side published them on
// its devices, which it does where the API server serves them); an
// allocation without them, on a cluster without KEP-5007, costs nothing
// here.
func (c *Controller) bindingConditions(ctx context.Context, status cdv1.ComputeDomainStatus, claims map[string][]*resourcev1.ResourceClaim, refused map[string]refusal) error {
	ready := map[string]bool{}
	for _, e := range status.Nodes {
		ready[e.Name] = e.Status == cdv1.StatusReady
	}
	var errs []error
	for _, node := range slices.Sorted(maps.Keys(claims)) {
		for _, claim := range claims[node] {
			errs = append(errs, c.claimConditions(ctx, claim, ready[node], refused[node]))
		}
	}
	return errors.Join(errs...)
}

// claimConditions writes the claim's binding conditions with an update
// of its status at the resourceVersion read (a conflict is retried by the
// domain's requeue). Not server-side apply: the API server compares
// status.allocation of the applied object with the stored one, and an
// apply turns the allocation's opaque parameters into the JSON of a map
// (keys sorted), which reads as a change of the immutable allocation when
// the claim's config was written in another order.
func (c *Controller) claimConditions(ctx context.Context, claim *resourcev1.ResourceClaim, ready bool, refused refusal) error {
	if c.conditionsInFlight(claim) {
		return nil // the informer's event of the write brings the domain back
	}
	next := claim.DeepCopy()
	changed := false
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		var cond *metav1.Condition
		if refused != "" && slices.Contains(r.BindingFailureConditions, ConditionDaemonFailed) {
			cond = condition(ConditionDaemonFailed, "NodeRefused", string(refused), claim.Generation)
		} else if ready && slices.Contains(r.BindingConditions, ConditionDaemonReady) {
			cond = condition(ConditionDaemonReady, "DaemonReady", "the domain's IMEX daemon on the node is ready", claim.Generation)
		}
		if cond == nil || hasTrue(claim, r, cond.Type) {
			continue
		}
		dev := deviceStatus(next, r)
		apimeta.SetStatusCondition(&dev.Conditions, *cond)
		changed = true
	}
	if !changed {
		return nil
	}
	_, err := c.opts.Kube.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, next, metav1.UpdateOptions{FieldManager: FieldManager})
	if err != nil {
		return fmt.Errorf("claim %s/%s: binding conditions: %w", claim.Namespace, claim.Name, err)
	}
	c.mu.Lock()
	c.conditioned[claim.UID] = claim.ResourceVersion
	c.mu.Unlock()
	return nil
}

// conditionsInFlight: this controller wrote claim's conditions at the
// version the informer still shows.
func (c *Controller) conditionsInFlight(claim *resourcev1.ResourceClaim) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	rv, ok := c.conditioned[claim.UID]
	if ok && rv != claim.ResourceVersion {
		delete(c.conditioned, claim.UID)
		return false
	}
	return ok
}

// deviceStatus is claim's status.devices entry of r, added if absent.
func deviceStatus(claim *resourcev1.ResourceClaim, r resourcev1.DeviceRequestAllocationResult) *resourcev1.AllocatedDeviceStatus {
	for i := range claim.Status.Devices {
		if d := &claim.Status.Devices[i]; isStatusOf(d, r) {
			return d
		}
	}
	claim.Status.Devices = append(claim.Status.Devices, resourcev1.AllocatedDeviceStatus{Driver: r.Driver, Pool: r.Pool, Device: r.Device, ShareID: shareID(r.ShareID)})
	return &claim.Status.Devices[len(claim.Status.Devices)-1]
}

func shareID(id *types.UID) *string {
	if id == nil {
		return nil
	}
	s := string(*id)
	return &s
}

// isStatusOf: d is the status.devices entry of result r. The API server
// keys both by driver, pool, device and shareID: a channel that allows
// multiple allocations (the node side publishes its channels so) is one
// device with a share per claim, or per request of one claim, and each
// share's condition is its own.
func isStatusOf(d *resourcev1.AllocatedDeviceStatus, r resourcev1.DeviceRequestAllocationResult) bool {
	return d.Driver == r.Driver && d.Pool == r.Pool && d.Device == r.Device && ptrEqual(d.ShareID, r.ShareID)
}

func ptrEqual(a *string, b *types.UID) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return *a == string(*b)
}

func condition(typ, reason, msg string, generation int64) *metav1.Condition {
	return &metav1.Condition{Type: typ, Status: metav1.ConditionTrue, Reason: reason, Message: msg,
		ObservedGeneration: generation, LastTransitionTime: metav1.Now()}
}

func hasTrue(claim *resourcev1.ResourceClaim, r resourcev1.DeviceRequestAllocationResult, typ string) bool {
	for _, d := range claim.Status.Devices {
		if !isStatusOf(&d, r) {
			continue
		}
		for _, cond := range d.Conditions {
			if cond.Type == typ && cond.Status == metav1.ConditionTrue {
				return true
			}
		}
	}
	return false
}

// finalize cleans up a deleted domain: it empties status.nodes (each node
// side, no longer finding its entry, stops the domain's daemon), deletes
// the templates, then removes the finalizer.
func (c *Controller) finalize(ctx context.Context, cd *cdv1.ComputeDomain) error {
	if !slices.Contains(cd.Finalizers, Finalizer) || c.wasFinalized(cd.UID) {
		return nil
	}
	if len(cd.Status.Nodes) > 0 || cd.Status.Status != cdv1.StatusNotReady {
		next := cd.DeepCopy()
		next.Status = cdv1.ComputeDomainStatus{Status: cdv1.StatusNotReady}
		if err := c.writeStatus(ctx, next); err != nil {
			return err
		}
		// The finalizer goes at the pass the status write's event brings,
		// from the object as written.
		return nil
	}
	if err := c.cleanup(ctx, string(cd.UID)); err != nil {
		return err
	}
	_, err := c.setFinalizers(ctx, cd, slices.DeleteFunc(slices.Clone(cd.Finalizers), func(f string) bool { return f == Finalizer }))
	if err == nil || apierrors.IsNotFound(err) {
		// Events of the cleanup's own writes requeue the domain before
		// the informer shows the finalizer gone: without this, each
		// would clean up again, at a write per node.
		c.mu.Lock()
		c.finalized.Insert(cd.UID)
		c.mu.Unlock()
		return nil
	}
	return err
}

func (c *Controller) wasFinalized(uid types.UID) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.finalized.Has(uid)
}

// cleanup deletes a domain's templates.
func (c *Controller) cleanup(ctx context.Context, uid string) error {
	var errs []error
	for _, t := range listByDomain[*resourcev1.ResourceClaimTemplate](c.rctInformer, uid) {
		err := c.opts.Kube.ResourceV1().ResourceClaimTemplates(t.Namespace).Delete(ctx, t.Name,
			metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &t.UID}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			errs = append(errs, fmt.Errorf("domain %s: delete template %s/%s: %w", uid, t.Namespace, t.Name, err))
		}
	}
	return errors.Join(errs...)
}

func (c *Controller) setFinalizers(ctx context.Context, cd *cdv1.ComputeDomain, finalizers []string) (*cdv1.ComputeDomain, error) {
	next := cd.DeepCopy()
	next.Finalizers = finalizers
	u, err := fromDomain(next)
	if err != nil {
		return nil, err
	}
	out, err := c.domains.Namespace(cd.Namespace).Update(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("domain %s/%s: finalizer: %w", cd.Namespace, cd.Name, err)
	}
	return toDomain(out)
}

// sweep cleans up after domains that are gone without their finalizer
// having run: deleted while no controller ran (the feature turned off,
// the finalizer removed by hand). It runs at start and whenever a
// labelled object names a domain the cache does not have. The workload
// templates are the garbage collector's too (the domain owns them); the
// daemon templates, in another namespace, only the sweep's.
func (c *Controller) sweep(ctx context.Context) error {
	orphans := map[string]bool{}
	for _, uid := range c.rctInformer.GetIndexer().ListIndexFuncValues(byDomain) {
		if objs, _ := c.cdInformer.GetIndexer().ByIndex(byUID, uid); len(objs) == 0 {
			orphans[uid] = true
		}
	}
	var errs []error
	for _, uid := range slices.Sorted(maps.Keys(orphans)) {
		c.opts.Log.Info("compute domain gone: cleaning up after it", "uid", uid)
		errs = append(errs, c.cleanup(ctx, uid))
	}
	return errors.Join(errs...)
}
