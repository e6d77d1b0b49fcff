//go:build e2e

package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// Names of the compute-domain contract (computedomain/controller/contract.go; this module does not import
// the agent's).
const (
	cdDriver        = "compute-domain.nvidia.com"
	gpuDriver       = "gpu.nvidia.com"
	cliqueLabel     = "nvidia.com/gpu.clique"
	domainLabel     = "resource.nvidia.com/computeDomain"
	daemonReadyCond = "compute-domain.nvidia.com/DaemonReady"
	channelDir      = "/dev/nvidia-caps-imex-channels/"
	// controllerNS is the controller's namespace (its daemon templates), workNS the workload's.
	controllerNS, workNS = "gpu-agent", "team"
	// stepLimit bounds each wait: a step that takes longer on two busy cores is a failure.
	stepLimit = 3 * time.Minute
)

var (
	cdGVR  = schema.GroupVersionResource{Group: "resource.nvidia.com", Version: "v1beta1", Resource: "computedomains"}
	crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	dcGVR  = schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "deviceclasses"}
)

// simNode is one fake Node and the gpu-agent serving it.
type simNode struct {
	name   string
	clique int
	ip     string // the Node's InternalIP: the address its IMEX daemons bind (a loopback address of its own)
	dir    string // the agent's directories: state, cdi, plugins, the sim root
	agent  *harness.Process
}

func (n *simNode) stateDir() string  { return filepath.Join(n.dir, "state") }
func (n *simNode) cdiDir() string    { return filepath.Join(n.dir, "cdi") }
func (n *simNode) simRoot() string   { return filepath.Join(n.dir, "root") }
func (n *simNode) pluginDir() string { return filepath.Join(n.dir, "plugins") }

// draSocket is the compute-domain.nvidia.com kubelet plugin's socket: the agent puts it beside
// --dra-plugin-dir's, in the kubelet's plugins/<driver> layout.
func (n *simNode) draSocket() string { return filepath.Join(n.pluginDir(), cdDriver, "dra.sock") }

// TestComputeDomainControlPlane runs the compute-domain pieces as processes against a real control plane (etcd,
// kube-apiserver, kube-scheduler, kube-controller-manager) with no kubelet: fake Ready Nodes, three in NVLink
// clique 1 and one in clique 2, each served by a real `gpu-agent run --dra` on a simulated GB200 tray, and
// `gpu-agent controller`. A ComputeDomain of two nodes gets two pods pinned to two clique-1 nodes; the real
// scheduler allocates their channel claims and waits on the binding condition, the controller lists the nodes
// in status.nodes, the agents start their IMEX stand-ins and report Ready, and the pods bind. The test then
// plays the kubelet: Prepare over each agent's DRA socket (the CDI spec names the domain's channel under the
// sim root). One node then fails (nodeFailure). The controller is then stopped and started again, with a pod
// waiting for the domain, a domain deleted and one created meanwhile (controllerOffAndOn). Last come Unprepare
// and the deletion of the pods and the domain, after which nothing of the domain is left (the finalizer,
// templates, claims, daemons, CDI specs).
//
// The agents and the controller use the admin kubeconfig: their RBAC and the status admission policy are
// tested in test/deploy, not here. What no kubelet means: nothing runs the pods, so no container sees its
// channel, and the pods are force-deleted (the kubelet would confirm their deletion).
func TestComputeDomainControlPlane(t *testing.T) {
	runComputeDomain(t, domainCase{size: 2})
}

// rackEnv turns on TestComputeDomainRack: a full NVL72 rack is 20 agents on the machine, too much for every
// `make test` on two cores (see docs/compute-domains.md for its duration).
const rackEnv = "E2E_COMPUTE_DOMAIN_RACK"

// TestComputeDomainRack is TestComputeDomainControlPlane at the size of an NVL72 rack: a domain of 18 trays of
// one clique (72 GPUs), 18 pods each with its channel claim, every node's daemon READY and the same channel
// from every Prepare; one tray fails, and after the domain is deleted nothing is left on any node. The failed
// Node's pod is left to the pod garbage collector, as no one force-deletes it on a real cluster either.
func TestComputeDomainRack(t *testing.T) {
	if os.Getenv(rackEnv) == "" {
		t.Skipf("%s is not set: the 18-node domain runs only when asked (docs/compute-domains.md)", rackEnv)
	}
	runComputeDomain(t, domainCase{size: 18, waitPodGC: true})
}

// domainCase is one shape of the test.
type domainCase struct {
	// size is the domain's numNodes, and the number of clique-1 nodes its workload lands on (18 at most: the
	// nodes of one clique, of which the controller indexes 18).
	size int
	// waitPodGC leaves the failed Node's pod to the pod garbage collector once the Node is deleted (40 s of
	// quarantine and a 20 s period), rather than force-deleting it as an administrator would.
	waitPodGC bool
}

// domainRun is one run of a domainCase: the cluster, and what the test learnt of the domain so far.
type domainRun struct {
	domainCase
	t   *testing.T
	ctx context.Context
	cp  *harness.ControlPlane
	cs  kubernetes.Interface
	// workers are the clique-1 nodes the domain's pods are pinned to, spare another clique-1 node (where a
	// failed worker's replacement goes), other the clique-2 node; nodes are all of them.
	workers      []*simNode
	spare, other *simNode
	nodes        []*simNode
	cliques      map[string]string // the clique label, by node
	// failed is the worker nodeFailure took down (its agent and daemon stay down).
	failed *simNode
	// ctrl is the running `gpu-agent controller`; startController starts another (controllerOffAndOn).
	ctrl            *harness.Process
	startController func()

	domainUID string
	// live are the nodes with a running worker pod, and claims their pods' claims (by node).
	live   []*simNode
	claims map[string]*resourceapi.ResourceClaim
	pids   map[string]int // the domain's IMEX daemon, by node
	// channel is the host channel every Prepare of the domain gave.
	channel string
}

const domainName, templateName = "job-domain", "job-channel"

func runComputeDomain(t *testing.T, c domainCase) {
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	r := &domainRun{domainCase: c, t: t, ctx: ctx, claims: map[string]*resourceapi.ResourceClaim{}, pids: map[string]int{}}
	r.startCluster(bins)
	r.formDomain()
	r.nodeFailure()
	r.controllerOffAndOn()
	r.deleteDomain()
}

// startCluster starts the control plane, the nodes with their agents and the controller, and waits until
// every agent has published its slices and labelled its Node.
func (r *domainRun) startCluster(bins binaryPaths) {
	t, ctx := r.t, r.ctx
	// Short: the sockets under it must stay within the 108 bytes of a unix socket path.
	dir, err := os.MkdirTemp("", "cdcp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	})
	cp, err := harness.StartControlPlane(ctx, harness.ControlPlaneConfig{
		APIServer: bins.apiserver, Etcd: bins.etcd, ControllerManager: bins.controllerManager, Scheduler: bins.scheduler,
		Dir: filepath.Join(dir, "cp"), LogDir: filepath.Join(dir, "logs"),
		// The resource claim controller makes the pods' claims from the template and deletes them with the
		// pods; the taint eviction controller evicts a failed node's pods, the pod garbage collector removes
		// the pods of a deleted Node. Node lifecycle is off: these Nodes have no kubelet to heartbeat, and the
		// test plays its part for the node that fails.
		ControllerManagerControllers: "*,-node-lifecycle-controller",
	})
	if err != nil {
		t.Fatalf("control plane: %v (logs in %s)", err, dir)
	}
	t.Cleanup(func() {
		if err := cp.Stop(10 * time.Second); err != nil {
			t.Logf("control plane stop: %v", err)
		}
	})
	r.cp, r.cs = cp, cp.Client
	applyComputeDomainAPI(ctx, t, cp)
	for _, ns := range []string{controllerNS, workNS} {
		if _, err := r.cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("namespace %s: %v", ns, err)
		}
	}

	// Trays 1…size+1 of rack 1 (clique 1), at 127.0.1.<tray>; tray 1 of rack 2 (clique 2) at 127.0.2.1.
	for i := 1; i <= r.size+1; i++ {
		r.nodes = append(r.nodes, &simNode{name: fmt.Sprintf("rack1-tray%d", i), clique: 1, ip: fmt.Sprintf("127.0.1.%d", i)})
	}
	r.nodes = append(r.nodes, &simNode{name: "rack2-tray1", clique: 2, ip: "127.0.2.1"})
	r.workers, r.spare, r.other = r.nodes[:r.size], r.nodes[r.size], r.nodes[r.size+1]
	for i, n := range r.nodes {
		n.dir = filepath.Join(dir, "n"+strconv.Itoa(i))
		if err := createNode(ctx, r.cs, n); err != nil {
			t.Fatal(err)
		}
		startAgent(t, bins.agent, cp.AdminKubeconfig(), n)
	}
	t.Cleanup(func() { killDaemons(t, r.nodes) })
	r.startController = func() {
		ctrl, err := harness.StartProcess("gpu-agent-controller", filepath.Join(dir, "logs", "controller.log"), nil,
			bins.agent, "controller", "--kubeconfig", cp.AdminKubeconfig(), "--namespace", controllerNS,
			"--leader-elect=false", "--listen", "")
		if err != nil {
			t.Fatal(err)
		}
		r.ctrl = ctrl
		t.Cleanup(func() {
			if err := ctrl.Stop(10 * time.Second); err != nil {
				t.Logf("controller stop: %v", err)
			}
		})
	}
	r.startController()

	// Each agent publishes both drivers' slices, the channels with the binding condition, and labels its
	// Node with its clique.
	for _, n := range r.nodes {
		waitAgentPublished(ctx, t, r.cs, n)
	}
	r.cliques = map[string]string{}
	for _, n := range r.nodes {
		node, err := r.cs.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		r.cliques[n.name] = node.Labels[cliqueLabel]
	}
	for _, n := range r.nodes {
		if same := r.cliques[n.name] == r.cliques[r.nodes[0].name]; same != (n.clique == 1) {
			t.Fatalf("clique labels %v: want the rack1 nodes' equal and rack2's different", r.cliques)
		}
	}
	if err := waitFor(ctx, "the default ServiceAccount of "+workNS, func() (bool, error) {
		_, err := r.cs.CoreV1().ServiceAccounts(workNS).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
}

// domain reads the ComputeDomain.
func (r *domainRun) domain() (*unstructured.Unstructured, error) {
	return r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(r.ctx, domainName, metav1.GetOptions{})
}

// formDomain creates the domain and a pod per worker, waits until every entry is Ready and every pod bound,
// checks what the domain, the claims and the nodes say, and prepares each claim as the kubelet would.
func (r *domainRun) formDomain() {
	t, ctx, cs := r.t, r.ctx, r.cs
	// The domain, as a user writes it.
	domain := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": domainName, "namespace": workNS},
		"spec": map[string]any{
			"numNodes": int64(r.size),
			"channel":  map[string]any{"resourceClaimTemplate": map[string]any{"name": templateName}},
		},
	}}
	domainCreated := time.Now()
	domain, err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Create(ctx, domain, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create ComputeDomain: %v", err)
	}
	r.domainUID = string(domain.GetUID())
	if err := waitFor(ctx, "the workload template "+templateName, func() (bool, error) {
		_, err := cs.ResourceV1().ResourceClaimTemplates(workNS).Get(ctx, templateName, metav1.GetOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	templateSeen := time.Since(domainCreated)

	// The job's pods, one per worker node, each with a claim from the domain's template.
	podCreated := map[string]time.Time{} // by node
	for i, n := range r.workers {
		pod := workerPod(fmt.Sprintf("worker-%d", i), n.name, templateName)
		if _, err := cs.CoreV1().Pods(workNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create pod %s: %v", pod.Name, err)
		}
		podCreated[n.name] = time.Now()
	}
	prog, allReady, last, err := r.waitBound(r.workers, r.size)
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, last)
	}

	// What the domain says: the workers, at their addresses and clique, each with an index of its own, Ready.
	d, err := r.domain()
	if err != nil {
		t.Fatal(err)
	}
	if st, _, _ := unstructured.NestedString(d.Object, "status", "status"); st != "Ready" {
		t.Errorf("status.status %q, want Ready", st)
	}
	entries := harness.DomainStatusNodes(d)
	if len(entries) != r.size {
		t.Errorf("status.nodes has %d entries, want the %d workers: %v", len(entries), r.size, entries)
	}
	indices := map[string]bool{}
	for _, n := range r.workers {
		e := entries[n.name]
		if e["ipAddress"] != n.ip || e["cliqueID"] != r.cliques[n.name] {
			t.Errorf("entry of %s: %v, want ipAddress %s and cliqueID %s", n.name, e, n.ip, r.cliques[n.name])
		}
		indices[fmt.Sprint(e["index"])] = true
	}
	for i := range r.size {
		if !indices[strconv.Itoa(i)] {
			t.Errorf("status.nodes: no entry has index %d (want 0…%d, one each): %v", i, r.size-1, entries)
		}
	}
	// Each claim: allocated a channel of its pod's node, with the binding condition set by the controller.
	for _, n := range r.workers {
		checkClaim(t, prog[n.name].claim, n.name)
		r.claims[n.name] = prog[n.name].claim
	}

	// The daemons run where the domain is, not on the spare or the clique-2 node.
	for _, n := range r.workers {
		r.pids[n.name] = r.runningDaemon(n)
	}
	for _, n := range []*simNode{r.spare, r.other} {
		if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", r.domainUID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s has a folder for the domain's daemon: %v", n.name, err)
		}
	}

	// The kubelet's part: Prepare on each node, as the kubelet calls it (namespace, name, UID). Every node
	// injects the same host channel.
	r.live = slices.Clone(r.workers)
	for _, n := range r.workers {
		r.prepareSame(n)
	}

	var bound []time.Duration
	var lastAllocated time.Time
	for _, n := range r.workers {
		p := prog[n.name]
		bound = append(bound, p.bound.Sub(p.claimSeen))
		if p.allocated.After(lastAllocated) {
			lastAllocated = p.allocated
		}
		if r.size <= 2 {
			since := func(at time.Time) time.Duration { return at.Sub(podCreated[n.name]).Round(time.Millisecond) }
			t.Logf("figures: %s: pod created → claim seen %s → allocated %s → entry Ready %s → %s set %s → pod bound %s (claim → bound %s)", n.name,
				since(p.claimSeen), since(p.allocated), since(p.entryReady), daemonReadyCond, since(p.conditioned), since(p.bound),
				p.bound.Sub(p.claimSeen).Round(time.Millisecond))
		}
	}
	t.Logf("MEASURED %d nodes (polled every 100ms, two busy cores): ComputeDomain created → workload template %s; → last claim allocated %s; → all %d entries Ready (daemons READY) %s; claim → pod bound %s to %s",
		r.size, templateSeen.Round(time.Millisecond), lastAllocated.Sub(domainCreated).Round(time.Millisecond), r.size,
		allReady.Sub(domainCreated).Round(time.Millisecond), slices.Min(bound).Round(time.Millisecond), slices.Max(bound).Round(time.Millisecond))
}

// progress is what the test saw of one node's pod, claim and entry, and when.
type progress struct {
	claimSeen, allocated, entryReady, conditioned, bound time.Time
	claim                                                *resourceapi.ResourceClaim
}

// waitBound waits until the pods pinned to nodes are bound and the domain has want entries, all Ready. It
// returns each node's progress, when all entries were first seen Ready at once, and the last status read.
// Pods are read before claims in each round: a pod seen bound whose claim then lacks DaemonReady was bound
// before its node's daemon was ready. (An entry may turn NotReady again for a moment as nodes join: its
// daemon reloads and asks the new peers.)
func (r *domainRun) waitBound(nodes []*simNode, want int) (map[string]*progress, time.Time, any, error) {
	ctx, cs := r.ctx, r.cs
	prog := map[string]*progress{}
	for _, n := range nodes {
		prog[n.name] = &progress{}
	}
	var allReady time.Time
	var last any
	err := waitFor(ctx, fmt.Sprintf("%d entries Ready and %d pods bound", want, len(nodes)), func() (bool, error) {
		pods, err := cs.CoreV1().Pods(workNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		claims, err := cs.ResourceV1().ResourceClaims(workNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		d, err := r.domain()
		if err != nil {
			return false, err
		}
		last = d.Object["status"]
		now := time.Now()
		entries := harness.DomainStatusNodes(d)
		for _, pod := range pods.Items {
			p := prog[pod.Spec.NodeSelector[corev1.LabelHostname]]
			if p == nil || pod.DeletionTimestamp != nil {
				continue // a pod of another phase
			}
			bound := pod.Spec.NodeName != "" && p.bound.IsZero()
			if bound {
				p.bound = now
			}
			for _, c := range claims.Items {
				if !metav1.IsControlledBy(&c, &pod) {
					continue
				}
				if p.claimSeen.IsZero() {
					p.claimSeen = now
				}
				if c.Status.Allocation != nil && p.allocated.IsZero() {
					p.allocated = now
				}
				cond := slices.ContainsFunc(c.Status.Devices, func(d resourceapi.AllocatedDeviceStatus) bool {
					return meta(d.Conditions, daemonReadyCond)
				})
				if cond && p.conditioned.IsZero() {
					p.conditioned = now
				}
				if bound && !cond {
					return false, fatal(fmt.Errorf("pod %s bound to %s while its claim %s has no %s", pod.Name, pod.Spec.NodeName, c.Name, daemonReadyCond))
				}
				p.claim = c.DeepCopy()
			}
		}
		ready := 0
		for name, e := range entries {
			if e["status"] != "Ready" {
				continue
			}
			ready++
			if p := prog[name]; p != nil && p.entryReady.IsZero() {
				p.entryReady = now
			}
		}
		if ready == want && len(entries) == want && allReady.IsZero() {
			allReady = now
		}
		for _, p := range prog {
			if p.bound.IsZero() {
				return false, nil
			}
		}
		return ready == want && len(entries) == want, nil
	})
	return prog, allReady, last, err
}

// runningDaemon is the pid of the domain's IMEX daemon on n, which must be running.
func (r *domainRun) runningDaemon(n *simNode) int {
	r.t.Helper()
	pid, err := daemonPID(n, r.domainUID)
	if err != nil {
		r.t.Fatalf("IMEX daemon of %s: %v", n.name, err)
	}
	if !harness.ProcessAlive(pid) {
		r.t.Fatalf("IMEX daemon of %s: pid %d not running", n.name, pid)
	}
	return pid
}

// prepareSame prepares n's claim and checks the channel is the domain's, the same on every node.
func (r *domainRun) prepareSame(n *simNode) {
	r.t.Helper()
	ch := prepare(r.ctx, r.t, n, r.claims[n.name])
	if r.channel == "" {
		r.channel = ch
	}
	if ch != r.channel {
		r.t.Errorf("%s: Prepare gave channel %s, but another node of the domain gave %s", n.name, ch, r.channel)
	}
}

// deleteDomain does the teardown as the kubelet and the user do it: Unprepare, the pods go (and with their
// claims, the entries and the daemons), then the domain. It checks that nothing of the domain is left: no
// template or claim labelled with it, no Node label of it, no CDI spec under any live node's CDI dir, no
// IMEX daemon folder or process of it anywhere.
func (r *domainRun) deleteDomain() {
	t, ctx, cs := r.t, r.ctx, r.cs
	for _, n := range r.live {
		unprepare(ctx, t, n, r.claims[n.name])
	}
	podsDeleted := time.Now()
	for _, n := range r.live {
		name := podOf(r.claims[n.name])
		if err := cs.CoreV1().Pods(workNS).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			t.Fatalf("delete pod %s: %v", name, err)
		}
	}
	if err := waitFor(ctx, "the pods' claims deleted", func() (bool, error) {
		l, err := cs.ResourceV1().ResourceClaims(workNS).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0, err
	}); err != nil {
		t.Fatal(err)
	}
	// The workload left every node: each entry goes, and each daemon stops (process and folder), while the
	// domain is still there.
	if err := waitFor(ctx, "the entries gone and the domain's daemons stopped", func() (bool, error) {
		d, err := r.domain()
		if err != nil || len(harness.DomainStatusNodes(d)) > 0 {
			return false, err
		}
		for _, n := range r.liveNodes() {
			if pid, ok := r.pids[n.name]; ok && harness.ProcessAlive(pid) {
				return false, nil
			}
			if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", r.domainUID)); !errors.Is(err, os.ErrNotExist) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	stopped := time.Since(podsDeleted)
	deleted := time.Now()
	if err := r.cp.Dynamic.Resource(cdGVR).Namespace(workNS).Delete(ctx, domainName, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete ComputeDomain: %v", err)
	}
	sel := metav1.ListOptions{LabelSelector: domainLabel + "=" + r.domainUID}
	if err := waitFor(ctx, "the domain and its templates gone", func() (bool, error) {
		if _, err := r.domain(); !apierrors.IsNotFound(err) {
			return false, err
		}
		for _, ns := range []string{workNS, controllerNS} {
			l, err := cs.ResourceV1().ResourceClaimTemplates(ns).List(ctx, sel)
			if err != nil || len(l.Items) > 0 {
				return false, err
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("MEASURED %d nodes: pods deleted → their claims, the entries and every daemon gone %s; ComputeDomain deleted → it and its templates gone %s",
		r.size, stopped.Round(time.Millisecond), time.Since(deleted).Round(time.Millisecond))

	// Nothing else is left: claims of the domain in any namespace (the daemon template's included), a Node
	// label naming it, a CDI spec on a live node, a process whose command line names it.
	if l, err := cs.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, sel); err != nil || len(l.Items) > 0 {
		t.Errorf("claims of the domain left (%v): %d", err, len(l.Items))
	}
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, node := range nodes.Items {
		for k, v := range node.Labels {
			if k == domainLabel || v == r.domainUID {
				t.Errorf("Node %s keeps label %s=%s", node.Name, k, v)
			}
		}
		if node.Labels[cliqueLabel] == "" {
			t.Errorf("Node %s lost its %s label (the agent's, not the domain's)", node.Name, cliqueLabel)
		}
	}
	for _, n := range r.liveNodes() {
		if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", r.domainUID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: the domain's daemon folder is left: %v", n.name, err)
		}
		specs, _ := filepath.Glob(filepath.Join(n.cdiDir(), "compute-domain-claim-*"))
		if len(specs) > 0 {
			t.Errorf("%s: CDI specs left: %v", n.name, specs)
		}
	}
	if procs := processesNaming(r.domainUID); len(procs) > 0 {
		t.Errorf("processes naming the domain %s are left: %v", r.domainUID, procs)
	}
	for _, n := range r.liveNodes() {
		if done, err := n.agent.Exited(); done {
			t.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, n.agent.LogPath)
		}
	}
}

// liveNodes are the nodes but the one nodeFailure took down.
func (r *domainRun) liveNodes() []*simNode {
	return slices.DeleteFunc(slices.Clone(r.nodes), func(n *simNode) bool { return n == r.failed })
}

// processesNaming lists the processes (pid: command line) whose command line contains s.
func processesNaming(s string) []string {
	var out []string
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range cmdlines {
		b, err := os.ReadFile(f)
		if err != nil || !strings.Contains(string(b), s) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
		if pid == os.Getpid() || !harness.ProcessAlive(pid) {
			continue
		}
		out = append(out, fmt.Sprintf("%d: %s", pid, strings.ReplaceAll(string(b), "\x00", " ")))
	}
	return out
}

type binaryPaths struct{ etcd, apiserver, scheduler, controllerManager, agent string }

// binaries reads the paths run.sh exports; a missing one fails the test (the suite never skips).
func binaries(t *testing.T) binaryPaths {
	t.Helper()
	var b binaryPaths
	for _, v := range []struct {
		dst *string
		env string
	}{{&b.etcd, "E2E_ETCD"}, {&b.apiserver, "E2E_KUBE_APISERVER"}, {&b.scheduler, "E2E_KUBE_SCHEDULER"},
		{&b.controllerManager, "E2E_KUBE_CONTROLLER_MANAGER"}, {&b.agent, "E2E_GPU_AGENT"}} {
		*v.dst = os.Getenv(v.env)
		if *v.dst == "" {
			t.Fatalf("%s is not set; run ../run.sh", v.env)
		}
		if _, err := os.Stat(*v.dst); err != nil {
			t.Fatalf("%s: %v", v.env, err)
		}
	}
	return b
}

// repoRoot is the gpu-agent repository (this file is test/e2e/controlplane/computedomain_test.go).
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// applyComputeDomainAPI creates the CRD and NVIDIA's two DeviceClasses from deploy/manifests/computedomains, as
// shipped, and waits for the CRD to be served.
func applyComputeDomainAPI(ctx context.Context, t *testing.T, cp *harness.ControlPlane) {
	t.Helper()
	dir := filepath.Join(repoRoot(), "deploy", "manifests", "computedomains")
	for _, f := range []struct {
		file string
		gvr  schema.GroupVersionResource
	}{{"crd.yaml", crdGVR}, {"deviceclasses.yaml", dcGVR}} {
		objs, err := harness.ReadObjects(filepath.Join(dir, f.file))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if _, err := cp.Dynamic.Resource(f.gvr).Create(ctx, o, metav1.CreateOptions{}); err != nil {
				t.Fatalf("%s: create %s %s: %v", f.file, o.GetKind(), o.GetName(), err)
			}
		}
	}
	if err := waitFor(ctx, "ComputeDomains served", func() (bool, error) {
		_, err := cp.Dynamic.Resource(cdGVR).Namespace("default").List(ctx, metav1.ListOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
}

// createNode makes a Ready Node with no kubelet behind it, at its own loopback address, with no taint. The
// controller manager may touch a new Node (its TTL annotation) between the writes, so each is retried on a
// conflict against the Node as it is then.
func createNode(ctx context.Context, cs kubernetes.Interface, n *simNode) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: map[string]string{
		corev1.LabelHostname: n.name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
	}}}
	if _, err := cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create Node %s: %w", n.name, err)
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU: apiresource.MustParse("144"), corev1.ResourceMemory: apiresource.MustParse("1Ti"),
		corev1.ResourcePods: apiresource.MustParse("110"),
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := cs.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		node.Status = corev1.NodeStatus{
			Capacity: res, Allocatable: res,
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: n.ip}, {Type: corev1.NodeHostName, Address: n.name}},
			Conditions: []corev1.NodeCondition{{
				Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "E2EControlPlane",
				Message: "a fake node (no kubelet)", LastHeartbeatTime: now, LastTransitionTime: now,
			}},
		}
		if node, err = cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("Node %s: set Ready: %w", n.name, err)
		}
		if len(node.Spec.Taints) > 0 {
			node.Spec.Taints = nil
			if _, err = cs.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("Node %s: remove the not-ready taint: %w", n.name, err)
			}
		}
		return nil
	})
}

// startAgent runs `gpu-agent run --dra` for n as the DaemonSet runs it, every host path moved under n.dir, on
// a simulated GB200 tray of n's clique whose driver files (channels) are under its own root.
func startAgent(t *testing.T, agent, kubeconfig string, n *simNode) {
	t.Helper()
	for _, d := range []string{"device-plugins", "pod-resources", "state", "mps", "cdi", "plugins/" + gpuDriver, "plugins_registry", "root"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := l.Addr().String()
	l.Close()
	p, err := harness.StartProcess("gpu-agent "+n.name, filepath.Join(n.dir, "gpu-agent.log"), nil,
		agent, "run", "--dra",
		"--kubeconfig", kubeconfig,
		"--node-name", n.name,
		"--backend", fmt.Sprintf("sim:gb200-tray,clique=%d,root=%s,state=%s", n.clique, n.simRoot(), filepath.Join(n.dir, "sim-state.json")),
		// No kubelet answers the device plugin and pod-resources sockets; the agent logs that and retries.
		"--device-plugin-dir", filepath.Join(n.dir, "device-plugins"),
		"--pod-resources-socket", filepath.Join(n.dir, "pod-resources", "kubelet.sock"),
		"--state-dir", n.stateDir(),
		"--mps-root", filepath.Join(n.dir, "mps"),
		"--cdi-spec-dir", n.cdiDir(),
		"--dra-plugin-dir", filepath.Join(n.pluginDir(), gpuDriver),
		"--kubelet-registry-dir", filepath.Join(n.dir, "plugins_registry"),
		"--listen", listen)
	if err != nil {
		t.Fatal(err)
	}
	n.agent = p
	t.Cleanup(func() {
		if err := p.Stop(10 * time.Second); err != nil {
			t.Logf("gpu-agent %s: %v", n.name, err)
		}
	})
}

// waitAgentPublished waits until n's agent has published slices of both drivers, its channels carrying the
// DaemonReady binding condition, its kubelet plugin socket is there, and its Node has the clique label.
func waitAgentPublished(ctx context.Context, t *testing.T, cs kubernetes.Interface, n *simNode) {
	t.Helper()
	var why string
	err := waitFor(ctx, "the agent of "+n.name+" published", func() (bool, error) {
		if done, err := n.agent.Exited(); done {
			return false, fatal(fmt.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, n.agent.LogPath))
		}
		l, err := cs.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + n.name})
		if err != nil {
			return false, err
		}
		var gpus, channels, bound, daemons int
		for _, s := range l.Items {
			for _, d := range s.Spec.Devices {
				switch {
				case s.Spec.Driver == gpuDriver:
					gpus++
				case s.Spec.Driver == cdDriver && strings.HasPrefix(d.Name, "channel-"):
					channels++
					if slices.Contains(d.BindingConditions, daemonReadyCond) {
						bound++
					}
				case s.Spec.Driver == cdDriver && strings.HasPrefix(d.Name, "daemon-"):
					daemons++
				}
			}
		}
		why = fmt.Sprintf("%d %s devices, %d channels (%d with %s), %d daemon devices", gpus, gpuDriver, channels, bound, daemonReadyCond, daemons)
		if gpus == 0 || channels == 0 || bound != channels || daemons != 1 {
			return false, nil
		}
		if _, err := os.Stat(n.draSocket()); err != nil {
			why = err.Error()
			return false, nil
		}
		node, err := cs.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		why = "no label " + cliqueLabel
		return node.Labels[cliqueLabel] != "", nil
	})
	if err != nil {
		t.Fatalf("%v (last: %s; see %s)", err, why, n.agent.LogPath)
	}
}

// workerPod is one rank of the job: pinned to node, with one claim from the domain's template. It tolerates
// an unreachable node for unreachableToleration, not the 300 s the API server gives a pod by default, as a job
// that wants a lost rank replaced soon writes.
func workerPod(name, node, template string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: workNS},
		Spec: corev1.PodSpec{
			NodeSelector:  map[string]string{corev1.LabelHostname: node},
			RestartPolicy: corev1.RestartPolicyNever,
			Tolerations: []corev1.Toleration{{
				Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute,
				TolerationSeconds: ptr.To(int64(unreachableToleration / time.Second)),
			}},
			Containers: []corev1.Container{{
				Name: "rank", Image: "busybox", Command: []string{"ls", "-l", channelDir},
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "imex-channel"}}},
			}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "imex-channel", ResourceClaimTemplateName: ptr.To(template)}},
		},
	}
}

// checkClaim: c holds one channel of node's compute-domain pool, and its device status has DaemonReady True.
func checkClaim(t *testing.T, c *resourceapi.ResourceClaim, node string) {
	t.Helper()
	if c == nil || c.Status.Allocation == nil {
		t.Fatalf("claim of %s not allocated: %+v", node, c)
	}
	res := c.Status.Allocation.Devices.Results
	if len(res) != 1 || res[0].Driver != cdDriver || res[0].Pool != node || !strings.HasPrefix(res[0].Device, "channel-") {
		t.Errorf("claim %s: results %+v, want one channel of %s's %s pool", c.Name, res, node, cdDriver)
		return
	}
	if !slices.Contains(res[0].BindingConditions, daemonReadyCond) {
		t.Errorf("claim %s: allocation's binding conditions %v, want %s", c.Name, res[0].BindingConditions, daemonReadyCond)
	}
	for _, d := range c.Status.Devices {
		if d.Device == res[0].Device && meta(d.Conditions, daemonReadyCond) {
			return
		}
	}
	t.Errorf("claim %s: status.devices %+v has no %s True for %s", c.Name, c.Status.Devices, daemonReadyCond, res[0].Device)
}

func meta(conds []metav1.Condition, typ string) bool {
	for _, c := range conds {
		if c.Type == typ {
			return c.Status == metav1.ConditionTrue
		}
	}
	return false
}

func podOf(c *resourceapi.ResourceClaim) string {
	for _, o := range c.OwnerReferences {
		if o.Kind == "Pod" {
			return o.Name
		}
	}
	return ""
}

// prepare calls n's compute-domain.nvidia.com plugin as the kubelet does and returns the channel its CDI spec
// injects, after checking the spec: one character device, /dev/nvidia-caps-imex-channels/channel<K>, whose
// host node is the sim root's.
func prepare(ctx context.Context, t *testing.T, n *simNode, c *resourceapi.ResourceClaim) string {
	t.Helper()
	client, done := draClient(t, n)
	defer done()
	resp, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
	if err != nil {
		t.Fatalf("%s: NodePrepareResources: %v", n.name, err)
	}
	r := resp.Claims[string(c.UID)]
	if r == nil || r.Error != "" || len(r.Devices) != 1 {
		t.Fatalf("%s: NodePrepareResources of %s: %+v", n.name, c.Name, r)
	}
	specPath := filepath.Join(n.cdiDir(), "compute-domain-claim-"+string(c.UID)+".json")
	b, err := os.ReadFile(specPath)
	if err != nil {
		t.Fatalf("%s: CDI spec: %v", n.name, err)
	}
	var spec struct {
		Kind    string `json:"kind"`
		Devices []struct {
			Name           string `json:"name"`
			ContainerEdits struct {
				DeviceNodes []struct {
					Path, HostPath, Type string
				} `json:"deviceNodes"`
			} `json:"containerEdits"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatalf("%s: %s: %v", n.name, specPath, err)
	}
	want := spec.Kind + "=" + string(c.UID)
	if !slices.Contains(r.Devices[0].CdiDeviceIds, want) {
		t.Errorf("%s: Prepare answered CDI ids %v, want %s (the spec's)", n.name, r.Devices[0].CdiDeviceIds, want)
	}
	if len(spec.Devices) != 1 || len(spec.Devices[0].ContainerEdits.DeviceNodes) != 1 {
		t.Fatalf("%s: %s: want one device with one device node: %s", n.name, specPath, b)
	}
	dn := spec.Devices[0].ContainerEdits.DeviceNodes[0]
	ch, ok := strings.CutPrefix(dn.Path, channelDir+"channel")
	if !ok || dn.HostPath != filepath.Join(n.simRoot(), dn.Path) || dn.Type != "c" {
		t.Fatalf("%s: device node %+v: want a channel under %s", n.name, dn, n.simRoot())
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dn.HostPath, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFCHR {
		t.Errorf("%s: %s: not a character device (%v)", n.name, dn.HostPath, err)
	}
	t.Logf("%s: Prepare of %s: %s → %s", n.name, c.Name, want, dn.HostPath)
	return ch
}

// unprepare calls NodeUnprepareResources as the kubelet does once the pod's containers are gone, and checks
// the claim's CDI spec went with it.
func unprepare(ctx context.Context, t *testing.T, n *simNode, c *resourceapi.ResourceClaim) {
	t.Helper()
	client, done := draClient(t, n)
	defer done()
	resp, err := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}})
	if err != nil {
		t.Fatalf("%s: NodeUnprepareResources: %v", n.name, err)
	}
	if r := resp.Claims[string(c.UID)]; r == nil || r.Error != "" {
		t.Fatalf("%s: NodeUnprepareResources of %s: %+v", n.name, c.Name, r)
	}
	if _, err := os.Stat(filepath.Join(n.cdiDir(), "compute-domain-claim-"+string(c.UID)+".json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s: CDI spec of %s after Unprepare: %v", n.name, c.Name, err)
	}
}

func draClient(t *testing.T, n *simNode) (drapb.DRAPluginClient, func()) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+n.draSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("%s: %v", n.name, err)
	}
	return drapb.NewDRAPluginClient(conn), func() { conn.Close() }
}

// daemonPID reads the pid file n's agent keeps for its daemon of domain.
func daemonPID(n *simNode, domain string) (int, error) {
	return harness.IMEXDaemonPID(n.stateDir(), domain)
}

// killDaemons ends IMEX daemons a failed run left on nodes.
func killDaemons(t *testing.T, nodes []*simNode) {
	for _, n := range nodes {
		harness.KillIMEXDaemons(t, n.name, n.stateDir())
	}
}

// fatal ends a waitFor at once; other errors of a condition (an API call that failed) are retried.
func fatal(err error) error { return harness.Fatal(err) }

// waitFor polls cond every 100ms until it is true, fails fatally, or stepLimit (or ctx) ends.
func waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	return harness.WaitFor(ctx, what, stepLimit, cond)
}
