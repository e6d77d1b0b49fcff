//go:build e2e

package controlplane

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// unreachableToleration is how long a worker pod stays bound to an unreachable node before the taint
// eviction controller evicts it.
const unreachableToleration = 2 * time.Second

// nodeFailure takes the last worker of the formed domain down, as a host failure does, and checks what
// docs/compute-domains.md ("A node that fails or leaves") promises:
//   - once its Node is NotReady, its entry leaves status.nodes; the others keep their indices, their daemons
//     reload without it (same pid, a node list without its address) and report Ready; status.status is
//     NotReady while fewer than numNodes entries are left;
//   - its pod is evicted after its toleration of node.kubernetes.io/unreachable and stays Terminating with
//     its claim allocated (no kubelet confirms it gone); the other pods are left alone;
//   - a replacement pod, as a Job makes, with a claim from the template, on another node of the clique, is
//     allocated and bound there; that node joins at the failed node's index, and the domain is Ready again;
//   - once the Node is deleted, its pod goes (the pod garbage collector, or a force-delete), its claim with
//     it, and its entry does not come back.
func (r *domainRun) nodeFailure() {
	t, ctx, cs := r.t, r.ctx, r.cs
	victim, survivors := r.workers[len(r.workers)-1], slices.Clone(r.workers[:len(r.workers)-1])
	d, err := r.domain()
	if err != nil {
		t.Fatal(err)
	}
	before := harness.DomainStatusNodes(d)
	index := func(entries map[string]map[string]any, n *simNode) string {
		return fmt.Sprint(entries[n.name]["index"])
	}

	// The host goes down: its agent and the IMEX daemon on it die, and stay down.
	r.failed = victim
	failedAt := time.Now()
	victim.agent.Kill()
	if err := syscall.Kill(r.pids[victim.name], syscall.SIGKILL); err != nil {
		t.Fatalf("%s: kill IMEX daemon %d: %v", victim.name, r.pids[victim.name], err)
	}
	// Node lifecycle is off (no Node here has a kubelet): the test does its part once the kubelet's status
	// stops coming.
	if err := markUnreachable(ctx, cs, victim.name); err != nil {
		t.Fatal(err)
	}

	var gone time.Time
	var last any
	err = waitFor(ctx, "the failed node's entry gone and the others Ready without it", func() (bool, error) {
		d, err := r.domain()
		if err != nil {
			return false, err
		}
		last = d.Object["status"]
		entries := harness.DomainStatusNodes(d)
		if _, ok := entries[victim.name]; ok {
			return false, nil
		}
		if gone.IsZero() {
			gone = time.Now()
		}
		if len(entries) != len(survivors) {
			return false, fatal(fmt.Errorf("status.nodes %v: want the %d other workers", entries, len(survivors)))
		}
		for _, n := range survivors {
			if entries[n.name]["status"] != "Ready" || !r.nodeListIs(n, entries) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, last)
	}
	quorum := time.Now()
	d, err = r.domain()
	if err != nil {
		t.Fatal(err)
	}
	after := harness.DomainStatusNodes(d)
	for _, n := range survivors {
		if index(after, n) != index(before, n) {
			t.Errorf("%s: index %s after the failure, %s before: a node leaving renumbered the others", n.name, index(after, n), index(before, n))
		}
	}
	if st, _, _ := unstructured.NestedString(d.Object, "status", "status"); st != "NotReady" {
		t.Errorf("status.status %q with %d of numNodes %d entries, want NotReady", st, len(after), r.size)
	}
	r.sameDaemons(survivors, "after the failure")

	// The failed node's pod: evicted after its toleration, Terminating with its claim allocated. The others'
	// pods run on.
	victimClaim := r.claims[victim.name]
	victimPod := podOf(victimClaim)
	var evicted time.Time
	if err := waitFor(ctx, "pod "+victimPod+" evicted", func() (bool, error) {
		pod, err := cs.CoreV1().Pods(workNS).Get(ctx, victimPod, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		evicted = time.Now()
		return pod.DeletionTimestamp != nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	claim, err := cs.ResourceV1().ResourceClaims(workNS).Get(ctx, victimClaim.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("claim of the evicted pod %s: %v", victimPod, err)
	}
	if claim.Status.Allocation == nil || !reservedFor(claim, victimPod) {
		t.Errorf("claim %s of the Terminating pod %s: allocation %v, reserved for %v; want it allocated and reserved until the pod is gone",
			claim.Name, victimPod, claim.Status.Allocation != nil, claim.Status.ReservedFor)
	}
	for _, n := range survivors {
		name := podOf(r.claims[n.name])
		pod, err := cs.CoreV1().Pods(workNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil || pod.DeletionTimestamp != nil || pod.Spec.NodeName != n.name {
			t.Errorf("pod %s of %s after another node failed: %v (err %v), want it bound there and not deleted", name, n.name, pod.DeletionTimestamp, err)
		}
	}

	// What a Job does next: a new pod for the lost rank, here pinned to the spare node of the clique. The
	// spare joins at the index the failed node gave up.
	replaced := time.Now()
	pod := workerPod(fmt.Sprintf("worker-%d", r.size), r.spare.name, templateName)
	if _, err := cs.CoreV1().Pods(workNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", pod.Name, err)
	}
	prog, _, last, err := r.waitBound([]*simNode{r.spare}, r.size)
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, last)
	}
	rejoined := time.Now()
	d, err = r.domain()
	if err != nil {
		t.Fatal(err)
	}
	entries := harness.DomainStatusNodes(d)
	if e := entries[r.spare.name]; index(entries, r.spare) != index(before, victim) || e["ipAddress"] != r.spare.ip || e["cliqueID"] != r.cliques[r.spare.name] {
		t.Errorf("entry of the replacement's node %s: %v, want index %s (the failed node's), ipAddress %s, cliqueID %s",
			r.spare.name, e, index(before, victim), r.spare.ip, r.cliques[r.spare.name])
	}
	if st, _, _ := unstructured.NestedString(d.Object, "status", "status"); st != "Ready" {
		t.Errorf("status.status %q with the replacement's node in, want Ready", st)
	}
	for _, n := range survivors {
		if index(entries, n) != index(before, n) {
			t.Errorf("%s: index %s after the replacement joined, %s before", n.name, index(entries, n), index(before, n))
		}
	}
	checkClaim(t, prog[r.spare.name].claim, r.spare.name)
	r.claims[r.spare.name] = prog[r.spare.name].claim
	r.pids[r.spare.name] = r.runningDaemon(r.spare)
	if err := waitFor(ctx, "the node lists with the replacement's node", func() (bool, error) {
		for _, n := range append(slices.Clone(survivors), r.spare) {
			if !r.nodeListIs(n, entries) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Error(err)
	}
	r.sameDaemons(survivors, "after the replacement joined")
	r.prepareSame(r.spare)
	r.live = append(survivors, r.spare)

	// The failed Node is deleted (an administrator, the cloud's node controller). Its pod goes: the pod
	// garbage collector deletes the pods of a Node that stays gone; here, without waitPodGC, a force-delete.
	nodeDeleted := time.Now()
	if err := cs.CoreV1().Nodes().Delete(ctx, victim.name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete Node %s: %v", victim.name, err)
	}
	if !r.waitPodGC {
		if err := cs.CoreV1().Pods(workNS).Delete(ctx, victimPod, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			t.Fatalf("force-delete pod %s: %v", victimPod, err)
		}
	}
	if err := waitFor(ctx, "pod "+victimPod+" and its claim gone", func() (bool, error) {
		if _, err := cs.CoreV1().Pods(workNS).Get(ctx, victimPod, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return false, err
		}
		_, err := cs.ResourceV1().ResourceClaims(workNS).Get(ctx, victimClaim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	podGone := time.Now()
	d, err = r.domain()
	if err != nil {
		t.Fatal(err)
	}
	entries = harness.DomainStatusNodes(d)
	if _, ok := entries[victim.name]; ok || len(entries) != r.size {
		t.Errorf("status.nodes after the failed Node was deleted: %v, want the %d live workers", entries, r.size)
	}
	how := "force-deleted"
	if r.waitPodGC {
		how = "by the pod garbage collector"
	}
	t.Logf("MEASURED %d nodes, node failure: killed → entry gone %s → the other %d entries Ready without it %s → pod evicted %s (toleration %s); replacement pod created → its node's entry Ready, pod bound %s; Node deleted → pod (%s) and claim gone %s",
		r.size, gone.Sub(failedAt).Round(time.Millisecond), len(survivors), quorum.Sub(failedAt).Round(time.Millisecond),
		evicted.Sub(failedAt).Round(time.Millisecond), unreachableToleration, rejoined.Sub(replaced).Round(time.Millisecond),
		how, podGone.Sub(nodeDeleted).Round(time.Millisecond))
}

// markUnreachable does to a Node what the node lifecycle controller does when its kubelet stops posting
// status: Ready turns Unknown, and the unreachable taints go on (NoExecute evicts its pods after their
// toleration, NoSchedule keeps new ones off).
func markUnreachable(ctx context.Context, cs kubernetes.Interface, name string) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		for i, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				node.Status.Conditions[i] = corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionUnknown,
					Reason: "NodeStatusUnknown", Message: "Kubelet stopped posting node status.",
					LastHeartbeatTime: c.LastHeartbeatTime, LastTransitionTime: now}
			}
		}
		if node, err = cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("Node %s: Ready Unknown: %w", name, err)
		}
		node.Spec.Taints = append(node.Spec.Taints,
			corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoSchedule},
			corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoExecute, TimeAdded: &now})
		if _, err = cs.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("Node %s: unreachable taints: %w", name, err)
		}
		return nil
	})
}

// nodeListIs: n's daemon of the domain has, as its node list, the addresses of the entries of n's clique in
// the order of their indices.
func (r *domainRun) nodeListIs(n *simNode, entries map[string]map[string]any) bool {
	var want []map[string]any
	for _, e := range entries {
		if e["cliqueID"] == r.cliques[n.name] {
			want = append(want, e)
		}
	}
	slices.SortFunc(want, func(a, b map[string]any) int {
		i, _ := a["index"].(int64)
		j, _ := b["index"].(int64)
		return cmp.Compare(i, j)
	})
	var ips []string
	for _, e := range want {
		ips = append(ips, fmt.Sprint(e["ipAddress"]))
	}
	b, err := os.ReadFile(filepath.Join(n.stateDir(), "imex", r.domainUID, "nodes.cfg"))
	return err == nil && slices.Equal(strings.Fields(string(b)), ips)
}

// sameDaemons: the daemons of nodes run with the pids they had when the domain formed (a changed node list
// reloads a daemon; it does not restart it).
func (r *domainRun) sameDaemons(nodes []*simNode, when string) {
	r.t.Helper()
	for _, n := range nodes {
		pid, err := daemonPID(n, r.domainUID)
		if err != nil || pid != r.pids[n.name] || !harness.ProcessAlive(pid) {
			r.t.Errorf("%s: IMEX daemon %s: pid %d (err %v, alive %v), want %d still running", n.name, when, pid, err, harness.ProcessAlive(pid), r.pids[n.name])
		}
	}
}

// reservedFor: claim is reserved for the pod named pod.
func reservedFor(claim *resourceapi.ResourceClaim, pod string) bool {
	return slices.ContainsFunc(claim.Status.ReservedFor, func(c resourceapi.ResourceClaimConsumerReference) bool {
		return c.Resource == "pods" && c.Name == pod
	})
}
