//go:build e2e

package controlplane

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
)

// Names of the domains controllerOffAndOn makes, and of its waiting pod.
const (
	retiredDomain, retiredTemplate = "retired-domain", "retired-channel"
	lateDomain, lateTemplate       = "late-domain", "late-channel"
	latePod, lateDomainPod         = "worker-late", "late-worker"
	finalizer                      = "resource.nvidia.com/computeDomain"
	daemonTemplatePrefix           = "computedomain-daemon-"
)

// offWindow is how long the pod waiting for its domain is watched while no controller runs. The scheduler
// re-reads the claim every 5 s while it waits in PreBind (the DynamicResources plugin's poll in 1.36), and
// nothing tells when it looked again and kept waiting, so the window holds one such re-read and a margin: a
// pod bound, or an attempt given up, shows within it. It is a watch of the pod that ends at once on either,
// not a sleep; the scheduler's event that it waits comes first, from a watch too.
const offWindow = 6 * time.Second

// controllerOffAndOn checks what docs/compute-domains.md ("Turning the feature on and off") promises, with the
// formed domain Ready and its pods bound:
//   - off (computeDomains.enabled=false deletes the Deployment: its process gets SIGTERM): the running pods,
//     their claims' DaemonReady, the domain's entries and its daemons stay as they were; a new pod with a
//     claim from the domain's template, on a node the domain does not list yet, is allocated a channel and
//     waits in the scheduler's PreBind (its BindingConditionsPending event) without being bound, and without
//     the attempt failing or the claim being given up;
//   - a domain deleted while off waits on its finalizer, its templates kept; a domain created while off gets
//     neither finalizer, status nor templates, and a pod created with it (a claim from its template) no claim;
//   - on again (a new controller process): the waiting pod binds once its node's entry is Ready (never
//     before DaemonReady), the domain is Ready with one entry per node and no template twice; the new domain
//     gets its finalizer and both templates and is Ready, and its pod gets its claim (the resource claim
//     controller watches templates) and binds; the deleted one goes, and nothing of it is left.
func (r *domainRun) controllerOffAndOn() {
	t, ctx, cs := r.t, r.ctx, r.cs

	// A domain the controller has taken up, to be deleted while it is off.
	retired := r.createDomain(retiredDomain, retiredTemplate)
	if err := waitFor(ctx, "the controller taking up "+retiredDomain, func() (bool, error) {
		return r.takenUp(retiredDomain, retiredTemplate, retired)
	}); err != nil {
		t.Fatal(err)
	}
	d, err := r.domain()
	if err != nil {
		t.Fatal(err)
	}
	entriesBefore, _, _ := unstructured.NestedSlice(d.Object, "status", "nodes")

	// Off.
	if err := r.ctrl.Stop(10 * time.Second); err != nil {
		t.Fatalf("controller: %v", err)
	}
	if err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Delete(ctx, retiredDomain, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete %s: %v", retiredDomain, err)
	}
	late := r.createDomain(lateDomain, lateTemplate)
	// Its job, submitted with it, on the spare node: a node of the first domain too.
	if _, err := cs.CoreV1().Pods(workNS).Create(ctx, workerPod(lateDomainPod, r.spare.name, lateTemplate), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", lateDomainPod, err)
	}
	podCreated := time.Now()
	if _, err := cs.CoreV1().Pods(workNS).Create(ctx, workerPod(latePod, r.other.name, templateName), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", latePod, err)
	}
	if err := r.waitEvent(latePod, "BindingConditionsPending"); err != nil {
		t.Fatal(err)
	}
	pending := time.Since(podCreated)
	claim := r.claimOf(latePod)
	if claim == nil || claim.Status.Allocation == nil || !reservedFor(claim, latePod) {
		t.Fatalf("claim of %s while the scheduler waits: %+v, want it allocated and reserved for the pod", latePod, claim)
	}
	res := claim.Status.Allocation.Devices.Results
	if len(res) != 1 || res[0].Pool != r.other.name || !slices.Contains(res[0].BindingConditions, daemonReadyCond) {
		t.Fatalf("claim %s: results %+v, want a channel of %s waiting on %s", claim.Name, res, r.other.name, daemonReadyCond)
	}
	allocatedAt := claim.Status.Allocation.AllocationTimestamp
	if err := r.stayUnbound(latePod, offWindow); err != nil {
		t.Fatal(err)
	}

	// Once, after the window: nothing moved.
	if c := r.claimOf(latePod); c == nil || c.Status.Allocation == nil || !reflect.DeepEqual(c.Status.Allocation.AllocationTimestamp, allocatedAt) ||
		len(c.Status.Devices) > 0 {
		t.Errorf("claim of %s after %s without a controller: %+v, want the same allocation (at %v) and no device status", latePod, offWindow, c, allocatedAt)
	}
	if l, err := cs.CoreV1().Events(workNS).List(ctx, metav1.ListOptions{FieldSelector: fields.Set{
		"involvedObject.name": latePod, "reason": "FailedScheduling"}.String()}); err != nil || len(l.Items) > 0 {
		t.Errorf("scheduling of %s failed while waiting for its domain (%v): %+v", latePod, err, l.Items)
	}
	for _, n := range r.live {
		name := podOf(r.claims[n.name])
		pod, err := cs.CoreV1().Pods(workNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil || pod.DeletionTimestamp != nil || pod.Spec.NodeName != n.name {
			t.Errorf("running pod %s without a controller: %+v (err %v), want it bound to %s, not deleted", name, pod, err, n.name)
		}
		c, err := cs.ResourceV1().ResourceClaims(workNS).Get(ctx, r.claims[n.name].Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		checkClaim(t, c, n.name)
	}
	if d, err = r.domain(); err != nil {
		t.Fatal(err)
	}
	if entries, _, _ := unstructured.NestedSlice(d.Object, "status", "nodes"); !reflect.DeepEqual(entries, entriesBefore) {
		t.Errorf("status.nodes without a controller: %v, want them as they were: %v", entries, entriesBefore)
	}
	r.sameDaemons(r.live, "without a controller")
	if rd, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, retiredDomain, metav1.GetOptions{}); err != nil ||
		rd.GetDeletionTimestamp() == nil || !slices.Contains(rd.GetFinalizers(), finalizer) {
		t.Errorf("%s deleted without a controller: %v (err %v), want it held by its finalizer", retiredDomain, rd, err)
	} else if n := r.templates(string(rd.GetUID())); n != 2 {
		t.Errorf("%s deleted without a controller: %d templates, want its 2 kept", retiredDomain, n)
	}
	if ld, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, lateDomain, metav1.GetOptions{}); err != nil ||
		len(ld.GetFinalizers()) > 0 || ld.Object["status"] != nil || r.templates(string(late.GetUID())) != 0 {
		t.Errorf("%s created without a controller: %v (err %v), want no finalizer, status or template", lateDomain, ld, err)
	}
	if c := r.claimOf(lateDomainPod); c != nil {
		t.Errorf("pod %s of %s has claim %s without a controller (no template yet)", lateDomainPod, lateDomain, c.Name)
	}

	// On again.
	onAt := time.Now()
	r.startController()
	var bound, lateReady, lateBound, retiredGone time.Time
	var last, lateClaim *resourceapi.ResourceClaim
	if err := waitFor(ctx, "the waiting pod bound, "+lateDomain+" Ready and its pod bound, "+retiredDomain+" gone", func() (bool, error) {
		if done, err := r.ctrl.Exited(); done {
			return false, fatal(fmt.Errorf("controller exited: %v (see %s)", err, r.ctrl.LogPath))
		}
		now := time.Now()
		// The pod before its claim: a pod seen bound whose claim then lacks DaemonReady was bound before it.
		pod, err := cs.CoreV1().Pods(workNS).Get(ctx, latePod, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if last = r.claimOf(latePod); last == nil {
			return false, fatal(fmt.Errorf("the claim of %s is gone", latePod))
		}
		if pod.Spec.NodeName != "" && bound.IsZero() {
			if !slices.ContainsFunc(last.Status.Devices, func(d resourceapi.AllocatedDeviceStatus) bool { return meta(d.Conditions, daemonReadyCond) }) {
				return false, fatal(fmt.Errorf("pod %s bound to %s while its claim has no %s", latePod, pod.Spec.NodeName, daemonReadyCond))
			}
			bound = now
		}
		if lateBound.IsZero() {
			pod, err := cs.CoreV1().Pods(workNS).Get(ctx, lateDomainPod, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if lateClaim = r.claimOf(lateDomainPod); pod.Spec.NodeName != "" {
				if lateClaim == nil || !slices.ContainsFunc(lateClaim.Status.Devices, func(d resourceapi.AllocatedDeviceStatus) bool { return meta(d.Conditions, daemonReadyCond) }) {
					return false, fatal(fmt.Errorf("pod %s bound to %s while its claim %v has no %s", lateDomainPod, pod.Spec.NodeName, lateClaim, daemonReadyCond))
				}
				lateBound = now
			}
		}
		if lateReady.IsZero() {
			ok, err := r.takenUp(lateDomain, lateTemplate, late)
			if err != nil {
				return false, err
			}
			if ok {
				lateReady = now
			}
		}
		if retiredGone.IsZero() {
			_, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, retiredDomain, metav1.GetOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return false, err
			}
			if err != nil && r.templates(string(retired.GetUID())) == 0 {
				retiredGone = now
			}
		}
		return !bound.IsZero() && !lateReady.IsZero() && !lateBound.IsZero() && !retiredGone.IsZero(), nil
	}); err != nil {
		t.Fatalf("%v (last claim of %s: %+v)", err, latePod, last)
	}
	checkClaim(t, last, r.other.name)
	checkClaim(t, lateClaim, r.spare.name)

	// The domain: its entries as before, the new node's added, one each, all Ready; one template of each kind.
	if err := waitFor(ctx, "every entry of "+domainName+" Ready", func() (bool, error) {
		d, err := r.domain()
		if err != nil {
			return false, err
		}
		for _, e := range harness.DomainStatusNodes(d) {
			if e["status"] != "Ready" {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Error(err)
	}
	if d, err = r.domain(); err != nil {
		t.Fatal(err)
	}
	list, _, _ := unstructured.NestedSlice(d.Object, "status", "nodes")
	entries := harness.DomainStatusNodes(d)
	if len(list) != len(entriesBefore)+1 || len(entries) != len(list) {
		t.Errorf("status.nodes after the controller came back: %v, want the %d before and %s's, once each", list, len(entriesBefore), r.other.name)
	}
	for _, e := range entriesBefore {
		m := e.(map[string]any)
		if got := entries[m["name"].(string)]; fmt.Sprint(got["index"]) != fmt.Sprint(m["index"]) || got["ipAddress"] != m["ipAddress"] {
			t.Errorf("entry %v after the controller came back: %v, want its index and address kept", m, got)
		}
	}
	if e := entries[r.other.name]; e["ipAddress"] != r.other.ip || e["cliqueID"] != r.cliques[r.other.name] {
		t.Errorf("entry of %s: %v, want ipAddress %s and cliqueID %s", r.other.name, e, r.other.ip, r.cliques[r.other.name])
	}
	if st, _, _ := unstructured.NestedString(d.Object, "status", "status"); st != "Ready" {
		t.Errorf("%s: status.status %q after the controller came back, want Ready", domainName, st)
	}
	if n := r.templates(r.domainUID); n != 2 {
		t.Errorf("%s has %d templates after the controller came back, want its 2", domainName, n)
	}
	r.sameDaemons(r.live, "after the controller came back")
	r.claims[r.other.name] = last
	r.pids[r.other.name] = r.runningDaemon(r.other)
	r.prepareSame(r.other)
	r.live = append(r.live, r.other)

	// Nothing of the domain deleted while off is left: claims or Node labels naming it, daemon folders,
	// processes.
	r.nothingLeft(string(retired.GetUID()))

	t.Logf("MEASURED controller off: pod created → scheduler waits on %s (BindingConditionsPending) %s; unbound and its claim kept for %s (window); controller started → waiting pod bound %s; → %s (created while off) Ready, finalizer and templates %s, its pod (created while off) bound %s; → %s (deleted while off) gone with its templates %s",
		daemonReadyCond, pending.Round(time.Millisecond), offWindow, bound.Sub(onAt).Round(time.Millisecond),
		lateDomain, lateReady.Sub(onAt).Round(time.Millisecond), lateBound.Sub(onAt).Round(time.Millisecond),
		retiredDomain, retiredGone.Sub(onAt).Round(time.Millisecond))

	// The late domain goes as any does, with the controller back: its pod (never prepared: no kubelet), then
	// the domain; its daemon on the spare node stops, the first domain's there runs on.
	if err := cs.CoreV1().Pods(workNS).Delete(ctx, lateDomainPod, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		t.Fatalf("delete pod %s: %v", lateDomainPod, err)
	}
	if err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Delete(ctx, lateDomain, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete %s: %v", lateDomain, err)
	}
	lateUID := string(late.GetUID())
	if err := waitFor(ctx, lateDomain+", its claim, templates and daemon gone", func() (bool, error) {
		_, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, lateDomain, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) || r.templates(lateUID) > 0 || r.claimOf(lateDomainPod) != nil {
			return false, harness.IgnoreNotFound(err)
		}
		_, err = os.Stat(filepath.Join(r.spare.stateDir(), "imex", lateUID))
		return errors.Is(err, os.ErrNotExist), nil
	}); err != nil {
		t.Fatal(err)
	}
	r.nothingLeft(lateUID)
	r.sameDaemons(r.live, "after "+lateDomain+" was deleted")
}

// createDomain creates a domain of no node in workNS, as a user writes it.
func (r *domainRun) createDomain(name, template string) *unstructured.Unstructured {
	r.t.Helper()
	d, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Create(r.ctx, &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": name, "namespace": workNS},
		"spec": map[string]any{
			"numNodes": int64(0),
			"channel":  map[string]any{"resourceClaimTemplate": map[string]any{"name": template}},
		},
	}}, metav1.CreateOptions{})
	if err != nil {
		r.t.Fatalf("create ComputeDomain %s: %v", name, err)
	}
	return d
}

// takenUp: the controller has reconciled the domain name (the object created): its finalizer is on, its
// two templates are there by their names, and status.status is Ready.
func (r *domainRun) takenUp(name, template string, created *unstructured.Unstructured) (bool, error) {
	d, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(r.ctx, name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if d.GetUID() != created.GetUID() {
		return false, fatal(fmt.Errorf("%s is another object (uid %s, created %s)", name, d.GetUID(), created.GetUID()))
	}
	if st, _, _ := unstructured.NestedString(d.Object, "status", "status"); st != "Ready" || !slices.Contains(d.GetFinalizers(), finalizer) {
		return false, nil
	}
	if _, err := r.cs.ResourceV1().ResourceClaimTemplates(workNS).Get(r.ctx, template, metav1.GetOptions{}); err != nil {
		return false, harness.IgnoreNotFound(err)
	}
	_, err = r.cs.ResourceV1().ResourceClaimTemplates(controllerNS).Get(r.ctx, daemonTemplatePrefix+string(d.GetUID()), metav1.GetOptions{})
	return err == nil, harness.IgnoreNotFound(err)
}

// templates counts the ResourceClaimTemplates labelled with domain uid, in any namespace.
func (r *domainRun) templates(uid string) int {
	r.t.Helper()
	l, err := r.cs.ResourceV1().ResourceClaimTemplates(metav1.NamespaceAll).List(r.ctx, metav1.ListOptions{LabelSelector: domainLabel + "=" + uid})
	if err != nil {
		r.t.Fatal(err)
	}
	return len(l.Items)
}

// claimOf is the ResourceClaim the resource claim controller made for pod, nil if none.
func (r *domainRun) claimOf(pod string) *resourceapi.ResourceClaim {
	r.t.Helper()
	l, err := r.cs.ResourceV1().ResourceClaims(workNS).List(r.ctx, metav1.ListOptions{})
	if err != nil {
		r.t.Fatal(err)
	}
	for i := range l.Items {
		if podOf(&l.Items[i]) == pod {
			return &l.Items[i]
		}
	}
	return nil
}

// waitEvent waits, on a watch, for an Event of reason about pod, for at most stepLimit.
func (r *domainRun) waitEvent(pod, reason string) error {
	ctx, cancel := context.WithTimeout(r.ctx, stepLimit)
	defer cancel()
	events := r.cs.CoreV1().Events(workNS)
	opts := metav1.ListOptions{FieldSelector: fields.Set{"involvedObject.name": pod, "reason": reason}.String()}
	for {
		l, err := events.List(ctx, opts)
		if err != nil {
			return fmt.Errorf("events of %s: %w", pod, err)
		}
		if len(l.Items) > 0 {
			return nil
		}
		opts.ResourceVersion = l.ResourceVersion
		w, err := events.Watch(ctx, opts)
		if err != nil {
			return fmt.Errorf("watch events of %s: %w", pod, err)
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Added || ev.Type == watch.Modified {
				w.Stop()
				return nil
			}
		}
		w.Stop()
		if ctx.Err() != nil {
			return fmt.Errorf("no %s event of pod %s within %s", reason, pod, stepLimit)
		}
		opts.ResourceVersion = "" // the watch ended early: list again
	}
}

// stayUnbound watches pod for d and fails if it is bound or deleted meanwhile.
func (r *domainRun) stayUnbound(pod string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(r.ctx, d)
	defer cancel()
	pods := r.cs.CoreV1().Pods(workNS)
	for {
		p, err := pods.Get(r.ctx, pod, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("pod %s: %w", pod, err)
		}
		if p.Spec.NodeName != "" || p.DeletionTimestamp != nil {
			return fmt.Errorf("pod %s bound to %q (deleted: %v) while no controller runs", pod, p.Spec.NodeName, p.DeletionTimestamp)
		}
		w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + pod, ResourceVersion: p.ResourceVersion})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("watch pod %s: %w", pod, err)
		}
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				break // a watch error: read the pod again and watch on
			}
			if ev.Type == watch.Deleted || p.Spec.NodeName != "" || p.DeletionTimestamp != nil {
				w.Stop()
				return fmt.Errorf("pod %s: %s, bound to %q, while no controller runs", pod, ev.Type, p.Spec.NodeName)
			}
		}
		w.Stop()
		if ctx.Err() != nil {
			return nil
		}
	}
}

// nothingLeft: no claim or Node label names domain uid, no live node has a daemon folder of it, and no
// process's command line names it.
func (r *domainRun) nothingLeft(uid string) {
	t, ctx := r.t, r.ctx
	if l, err := r.cs.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, metav1.ListOptions{LabelSelector: domainLabel + "=" + uid}); err != nil || len(l.Items) > 0 {
		t.Errorf("claims of domain %s left (%v): %d", uid, err, len(l.Items))
	}
	nodes, err := r.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, node := range nodes.Items {
		for k, v := range node.Labels {
			if v == uid {
				t.Errorf("Node %s keeps label %s=%s", node.Name, k, v)
			}
		}
	}
	for _, n := range r.liveNodes() {
		if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", uid)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: a daemon folder of domain %s: %v", n.name, uid, err)
		}
	}
	if procs := processesNaming(uid); len(procs) > 0 {
		t.Errorf("processes naming domain %s are left: %v", uid, procs)
	}
}
