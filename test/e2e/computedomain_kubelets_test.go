//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// Names of the compute-domain contract (computedomain/controller/contract.go; this module does not import
// the agent's).
const (
	cdDriver       = "compute-domain.nvidia.com"
	cdCliqueLabel  = "nvidia.com/gpu.clique"
	cdDomainLabel  = "resource.nvidia.com/computeDomain"
	cdChannelDir   = "/dev/nvidia-caps-imex-channels"
	cdControllerNS = "gpu-agent"
	cdWorkNS       = "team"
	// trayGPUs is a GB200 compute tray's GPU count; each worker takes them all, as NVIDIA's job does.
	trayGPUs = 4
	// cdStep bounds each wait of TestComputeDomainKubelets on two busy cores.
	cdStep = 3 * time.Minute
)

var cdGVR = schema.GroupVersionResource{Group: "resource.nvidia.com", Version: "v1beta1", Resource: "computedomains"}

// cdNode is one kubelet of the rack and the gpu-agent serving it.
type cdNode struct {
	env    *harness.Env
	name   string
	clique int
	ip     string
	agent  *harness.Process
	agentN int // starts, to name the logs
}

func (n *cdNode) agentDir() string { return n.env.NodeDirs().Agent }
func (n *cdNode) stateDir() string { return filepath.Join(n.agentDir(), "state") }
func (n *cdNode) simRoot() string  { return filepath.Join(n.agentDir(), "root") }

// TestComputeDomainKubelets runs a ComputeDomain on three real kubelets: a real control plane, the Cluster's
// node and two further ones (each its own containerd 2.x, in a mount namespace of its own, at an address of its
// own; see harness/nodes.go), each served by `gpu-agent run --dra` on a simulated GB200 tray as a host process
// (the DaemonSet's flags, pointed at that node's kubelet), two trays in NVLink clique 1 and one in clique 2,
// and `gpu-agent controller`. The workload has the shape of NVIDIA's nvbandwidth-test-job: a ComputeDomain of
// numNodes 2 and a two-rank job whose workers each take the tray's four GPUs (device plugin) and a channel from
// the domain's template, one worker per node of one clique; each worker is an own-written shell script in the
// suite's busybox image that checks its GPUs, its IMEX channel device and its environment, and prints them. The
// test checks:
//   - the domain turns Ready, listing the two clique-1 nodes at their addresses, with an IMEX daemon on each
//     and none on the clique-2 node;
//   - the real kubelets prepare the claims and each container has its four GPUs and exactly one channel, a
//     character device with the host channel's numbers, the same channel on both nodes;
//   - a second domain, whose two-worker job (no GPUs: the first's workers hold them all) lands on the same two
//     clique-1 nodes while the first runs, turns Ready too: NVIDIA's default channel class selects channel-0
//     alone, which the node sides publish with allowMultipleAllocations, so the scheduler allocates every
//     worker's claim a share of it (a shareID), and each domain's workers have their own domain's host channel,
//     the same on both nodes and another than the first's; deleting it leaves the first's workers and daemons
//     running and the first Ready;
//   - a pod with a claim from the domain's daemon template gets the domain's identity in its environment;
//   - a node that fails (its kubelet, agent and IMEX daemon killed) leaves status.nodes once its Node is
//     NotReady, the other keeps its index and its daemon (reloaded, not restarted) and turns Ready alone, its
//     pod runs on, and the domain is NotReady (one node of two); the node comes back and rejoins;
//   - deleting a job and then its domain leaves nothing: no claim, CDI spec, template, daemon (process or
//     folder), or Node label naming the domain.
func TestComputeDomainKubelets(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	rack := startCDRack(ctx, t, cdRackOptions{})
	c, nodes, cliques, started := rack.c, rack.nodes, rack.cliques, rack.started

	// The domain and the job, as NVIDIA's nvbandwidth-test-job writes them.
	first := runDomainJob(ctx, t, c, nodes, cliques, "nvbandwidth-test-compute-domain", "nvbandwidth-test-worker", trayGPUs)

	// A second domain whose job lands on the same two nodes while the first runs; then it goes, and the first
	// runs on.
	secondDomain(ctx, t, c, nodes, cliques, first)

	// A pod with a claim from the domain's daemon template, as NVIDIA's daemon pods have, beside the worker.
	daemonClaimPod(ctx, t, c, nodes[0], first, cliques[nodes[0].name])

	// One node fails.
	nodeFailure(ctx, t, c, nodes[0], nodes[1], first.name, first.uid, first.pids[nodes[0].name], first.byNode[nodes[0].name].pod.Name)

	// Deletion: the job, then the domain; then nothing of it is left anywhere.
	deleteDomainJob(ctx, t, c, nodes, first)
	checkDomainLeftNothing(ctx, t, rack, first.uid)
	t.Logf("MEASURED TestComputeDomainKubelets: %s from start", time.Since(started).Round(time.Second))
}

// cdRack is the rack TestComputeDomainKubelets and TestNVIDIAComputeDomainManifests run on: a real control
// plane with three kubelets, each served by a gpu-agent on a simulated GB200 tray, and gpu-agent controller.
type cdRack struct {
	c       *harness.Cluster
	nodes   []*cdNode         // rack1-tray1 and rack1-tray2 in clique 1, rack2-tray1 in clique 2
	cliques map[string]string // each node's nvidia.com/gpu.clique label, by name
	started time.Time
}

// cdRackOptions is what a test's rack has beyond the common one.
type cdRackOptions struct {
	// PodNetwork: see harness.ClusterConfig.PodNetwork.
	PodNetwork bool
	// Images are imported into every node beside the suite's own.
	Images []string
}

// startCDRack starts the rack: the Cluster's node and two further ones (each its own containerd 2.x, in a
// mount namespace of its own, at an address of its own; see harness/nodes.go), the compute-domain CRD and
// DeviceClasses as deploy/manifests ships them, the controller's namespace and cdWorkNS, a `gpu-agent run
// --dra` per node (startCDAgent) and `gpu-agent controller`; it returns once every agent has published and
// labelled its Node.
func startCDRack(ctx context.Context, t *testing.T, opts cdRackOptions) *cdRack {
	t.Helper()
	in := clusterInputs(t)
	started := time.Now()
	c := harness.StartCluster(t, harness.ClusterConfig{
		Kubelet: inputs.kubelet, APIServer: in.apiserver, ControllerManager: in.controllerManager,
		Scheduler: in.scheduler, Etcd: in.etcd, Images: append(slices.Clone(inputs.images), opts.Images...), NodeName: "rack1-tray1",
		NodeIP: "198.18.30.1", LedgerPath: inputs.ledger, Containerd2: inputs.containerd2, PodNetwork: opts.PodNetwork,
		// A node that stops is NotReady about 10 s later rather than about 50: each kubelet renews its Lease
		// every 2 s, and the node lifecycle controller looks every second.
		NodeLeaseDurationSeconds: 8,
		ControllerManagerArgs:    []string{"--node-monitor-grace-period=10s", "--node-monitor-period=1s"},
	})
	nodes := []*cdNode{
		{env: c.Env, name: "rack1-tray1", clique: 1, ip: "198.18.30.1"},
		{name: "rack1-tray2", clique: 1, ip: "198.18.30.2"},
		{name: "rack2-tray1", clique: 2, ip: "198.18.30.3"},
	}
	for _, n := range nodes[1:] {
		n.env = c.AddNode(ctx, harness.NodeOptions{Name: n.name, IP: n.ip})
	}
	t.Logf("MEASURED three kubelets Ready on the control plane: %s after start", time.Since(started).Round(100*time.Millisecond))

	cs := c.Client
	applyComputeDomainManifests(ctx, t, c)
	for _, ns := range []string{cdControllerNS, cdWorkNS} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("namespace %s: %v", ns, err)
		}
	}
	for _, n := range nodes {
		startCDAgent(ctx, t, c, n)
	}
	t.Cleanup(func() { killIMEXDaemons(t, nodes) })
	ctrl, err := harness.StartProcess("gpu-agent controller", filepath.Join(c.NodeDirs().Logs, "gpu-agent-controller.log"), nil,
		inputs.agent, "controller", "--kubeconfig", c.AdminKubeconfig(), "--namespace", cdControllerNS,
		"--leader-elect=false", "--listen", "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ctrl.Stop(10 * time.Second); err != nil {
			t.Logf("controller: %v", err)
		}
	})
	cliques := map[string]string{}
	for _, n := range nodes {
		cliques[n.name] = waitCDAgentPublished(ctx, t, c, n)
	}
	if cliques[nodes[0].name] != cliques[nodes[1].name] || cliques[nodes[0].name] == cliques[nodes[2].name] {
		t.Fatalf("clique labels %v: want the first two equal and the third different", cliques)
	}
	if err := cdWait(ctx, "the default ServiceAccount of "+cdWorkNS, func() (bool, error) {
		_, err := cs.CoreV1().ServiceAccounts(cdWorkNS).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	return &cdRack{c: c, nodes: nodes, cliques: cliques, started: started}
}

// checkDomainLeftNothing checks, once a domain (UID uid) and its workload are deleted, that no node keeps
// anything of it or of any claim: no claim CDI spec, no IMEX daemon folder, no Node label naming the domain
// (uid "": naming any domain); the node's clique label stays (it is the node's), and every agent still runs.
func checkDomainLeftNothing(ctx context.Context, t *testing.T, rack *cdRack, uid string) {
	t.Helper()
	for _, n := range rack.nodes {
		specs, _ := filepath.Glob(filepath.Join(n.env.NodeDirs().CDISpecs, "compute-domain-claim-*.json"))
		if len(specs) > 0 {
			t.Errorf("%s: CDI specs of claims left: %v", n.name, specs)
		}
		if dirs, _ := filepath.Glob(filepath.Join(n.stateDir(), "imex", "*")); len(dirs) > 0 {
			t.Errorf("%s: IMEX daemon folders left: %v", n.name, dirs)
		}
		node, err := rack.c.Client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range node.Labels {
			if uid != "" && (strings.Contains(k, uid) || strings.Contains(v, uid)) || k == cdDomainLabel {
				t.Errorf("Node %s keeps label %s=%s of the deleted domain", n.name, k, v)
			}
		}
		if node.Labels[cdCliqueLabel] != rack.cliques[n.name] {
			t.Errorf("Node %s: %s=%q, want the node's clique %q kept (it is the node's, not the domain's)", n.name, cdCliqueLabel, node.Labels[cdCliqueLabel], rack.cliques[n.name])
		}
		if done, err := n.agent.Exited(); done {
			t.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, n.agent.LogPath)
		}
	}
}

// cdRank is one worker of a domain's job, as the test watched it.
type cdRank struct {
	pod                                          corev1.Pod
	claim                                        *resourceapi.ResourceClaim
	claimSeen, allocated, bound, running, envSet time.Time
	env                                          map[string]string
}

// cdDomainRun is a ComputeDomain and its two-worker job.
type cdDomainRun struct {
	name, template, job, uid string
	channel                  string         // the host channel both workers have, "channel<K>"
	pids                     map[string]int // its IMEX daemons, by node
	byNode                   map[string]*cdRank
}

// runDomainJob creates a ComputeDomain of numNodes 2 named name and, once its workload template is there, a
// two-worker job (nvbandwidthWorkers, gpus GPUs each) kept on the clique of nodes[0] and nodes[1]. It watches
// the chain every 100ms (each worker's claim made, allocated, the pod bound, running and done checking its
// channel; the domain's entries Ready), checks what the domain lists and what each worker has, and logs the
// figures.
func runDomainJob(ctx context.Context, t *testing.T, c *harness.Cluster, nodes []*cdNode, cliques map[string]string, name, job string, gpus int) *cdDomainRun {
	t.Helper()
	cs := c.Client
	d := &cdDomainRun{name: name, template: name + "-channel", job: job, pids: map[string]int{}, byNode: map[string]*cdRank{}}
	domain := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": name, "namespace": cdWorkNS},
		"spec": map[string]any{
			"numNodes": int64(2),
			"channel":  map[string]any{"resourceClaimTemplate": map[string]any{"name": d.template}},
		},
	}}
	created := time.Now()
	domain, err := c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Create(ctx, domain, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create ComputeDomain %s: %v", name, err)
	}
	d.uid = string(domain.GetUID())
	if err := cdWait(ctx, "the workload template "+d.template, func() (bool, error) {
		_, err := cs.ResourceV1().ResourceClaimTemplates(cdWorkNS).Get(ctx, d.template, metav1.GetOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.BatchV1().Jobs(cdWorkNS).Create(ctx, nvbandwidthWorkers(job, d.template, cliques[nodes[0].name], gpus), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Job %s: %v", job, err)
	}

	ranks := map[string]*cdRank{} // by pod name
	var domainReady, entriesReady time.Time
	var last *unstructured.Unstructured
	envs := map[string]*harness.Env{}
	for _, n := range nodes {
		envs[n.name] = n.env
	}
	err = cdWait(ctx, job+"'s workers running with their channel and "+name+" Ready", func() (bool, error) {
		pods, err := cs.CoreV1().Pods(cdWorkNS).List(ctx, metav1.ListOptions{LabelSelector: "app=" + job})
		if err != nil {
			return false, err
		}
		claims, err := cs.ResourceV1().ResourceClaims(cdWorkNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		if last, err = c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, err
		}
		now := time.Now()
		for _, p := range pods.Items {
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				log := "(on no node of the test)"
				if e := envs[p.Spec.NodeName]; e != nil {
					if log, err = e.ContainerLog(&p, "worker"); err != nil {
						log = err.Error()
					}
				}
				return false, cdFatal(fmt.Errorf("worker %s ended: %s; its log:\n%s", p.Name, harness.DescribeAPIPod(&p), log))
			}
			r := ranks[p.Name]
			if r == nil {
				r = &cdRank{}
				ranks[p.Name] = r
			}
			r.pod = p
			for i := range claims.Items {
				cl := &claims.Items[i]
				if !metav1.IsControlledBy(cl, &p) {
					continue
				}
				if r.claimSeen.IsZero() {
					r.claimSeen = now
				}
				if cl.Status.Allocation != nil && r.allocated.IsZero() {
					r.allocated = now
				}
				r.claim = cl.DeepCopy()
			}
			if p.Spec.NodeName != "" && r.bound.IsZero() {
				r.bound = now
			}
			if harness.PodRunning(&p) && r.running.IsZero() {
				r.running = now
			}
			if !r.running.IsZero() && r.env == nil {
				short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
				env, err := envs[p.Spec.NodeName].PodContainerEnvOf(short, &p, "worker")
				cancel()
				if err == nil {
					r.env, r.envSet = env, now
				}
			}
		}
		entries := harness.DomainStatusNodes(last)
		if len(entries) == 2 && entries[nodes[0].name]["status"] == "Ready" && entries[nodes[1].name]["status"] == "Ready" && entriesReady.IsZero() {
			entriesReady = now
		}
		if st, _, _ := unstructured.NestedString(last.Object, "status", "status"); st == "Ready" && domainReady.IsZero() {
			domainReady = now
		}
		if len(ranks) != 2 || entriesReady.IsZero() || domainReady.IsZero() {
			return false, nil
		}
		for _, r := range ranks {
			if r.env == nil {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		for name, r := range ranks {
			t.Logf("worker %s: %s", name, harness.DescribeAPIPod(&r.pod))
		}
		t.Fatalf("%v\nlast status of %s: %v", err, name, last.Object["status"])
	}

	// Where the workers are and what they have.
	for _, r := range ranks {
		d.byNode[r.pod.Spec.NodeName] = r
	}
	if d.byNode[nodes[0].name] == nil || d.byNode[nodes[1].name] == nil {
		t.Fatalf("%s's workers on %v, want one on each clique-1 node (%s, %s)", job, slices.Collect(maps.Keys(d.byNode)), nodes[0].name, nodes[1].name)
	}
	entries := harness.DomainStatusNodes(last)
	for _, n := range nodes[:2] {
		e := entries[n.name]
		if e["ipAddress"] != n.ip || e["cliqueID"] != cliques[n.name] {
			t.Errorf("%s: status.nodes entry of %s: %v, want ipAddress %s and cliqueID %s", name, n.name, e, n.ip, cliques[n.name])
		}
	}
	indices := map[string]bool{}
	for _, n := range nodes[:2] {
		r := d.byNode[n.name]
		idx := r.env["JOB_COMPLETION_INDEX"]
		if idx != "0" && idx != "1" || indices[idx] {
			t.Errorf("worker %s: JOB_COMPLETION_INDEX %q, want 0 and 1 once each", r.pod.Name, idx)
		}
		indices[idx] = true
		ch := r.env["E2E_CHANNEL"]
		if d.channel == "" {
			d.channel = ch
		} else if ch != d.channel {
			t.Errorf("worker %s has %s, the other %s: a domain's channel is the same on every node", r.pod.Name, ch, d.channel)
		}
		// The container's device has the numbers of the sim's host channel node, which the CDI spec named.
		var st syscall.Stat_t
		host := filepath.Join(n.simRoot(), cdChannelDir, ch)
		if err := syscall.Stat(host, &st); err != nil {
			t.Fatalf("worker %s: its channel %q on the host: %v", r.pod.Name, ch, err)
		}
		if want := fmt.Sprintf("%x:%x", unixMajor(st.Rdev), unixMinor(st.Rdev)); r.env["E2E_CHANNEL_DEVNO"] != want {
			t.Errorf("worker %s: %s is %s in the container, %s (%s) on the host", r.pod.Name, ch, r.env["E2E_CHANNEL_DEVNO"], want, host)
		}
		// The GPUs, as the kubelet assigned them (pod-resources) and the container got them.
		var visible []string
		if v := r.env["NVIDIA_VISIBLE_DEVICES"]; v != "" {
			visible = strings.Split(v, ",")
		}
		assigned, err := n.env.PodDevicesOf(ctx, &r.pod, gpuResource)
		slices.Sort(visible)
		slices.Sort(assigned)
		if err != nil || len(slices.Compact(slices.Clone(visible))) != gpus || !slices.Equal(visible, assigned) {
			t.Errorf("worker %s: NVIDIA_VISIBLE_DEVICES %v, the kubelet assigned %v (%v): want %d GPUs", r.pod.Name, visible, assigned, err, gpus)
		}
		// A channel claim gets the device node only; the domain's identity is a daemon claim's.
		for _, k := range []string{"COMPUTE_DOMAIN_UUID", "COMPUTE_DOMAIN_NAME", "CLIQUE_ID"} {
			if v, ok := r.env[k]; ok {
				t.Errorf("worker %s: %s=%s in a channel claim's container", r.pod.Name, k, v)
			}
		}
		// NVIDIA's class selects channel-0; the node side publishes it with allowMultipleAllocations, which the
		// 1.36 API server and scheduler serve (DRAConsumableCapacity, beta and on), so the claim has a share.
		res := r.claim.Status.Allocation.Devices.Results
		if len(res) != 1 || res[0].Driver != cdDriver || res[0].Pool != n.name || res[0].Device != "channel-0" || res[0].ShareID == nil {
			t.Errorf("worker %s: claim %s allocated %+v, want a share of %s's channel-0", r.pod.Name, r.claim.Name, res, n.name)
		}
		if _, err := os.Stat(filepath.Join(n.env.NodeDirs().CDISpecs, "compute-domain-claim-"+string(r.claim.UID)+".json")); err != nil {
			t.Errorf("worker %s: the claim's CDI spec on %s: %v", r.pod.Name, n.name, err)
		}
	}
	for _, n := range nodes[:2] {
		pid, err := imexDaemonPID(n, d.uid)
		if err != nil || !harness.ProcessAlive(pid) {
			t.Fatalf("IMEX daemon of %s on %s: pid %d, %v", name, n.name, pid, err)
		}
		d.pids[n.name] = pid
	}
	if _, err := os.Stat(filepath.Join(nodes[2].stateDir(), "imex", d.uid)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s (clique 2) has a folder for %s's daemon: %v", nodes[2].name, name, err)
	}
	t.Logf("%s: workers %s on %s and %s on %s, both with %s (%s), %d GPUs each", name, d.byNode[nodes[0].name].pod.Name, nodes[0].name,
		d.byNode[nodes[1].name].pod.Name, nodes[1].name, filepath.Join(cdChannelDir, d.channel), d.byNode[nodes[0].name].env["E2E_CHANNEL_DEVNO"], gpus)
	t.Logf("MEASURED %s: ComputeDomain created -> both daemons READY (entries Ready): %s; -> status Ready: %s (includes the job's scheduling)", name,
		entriesReady.Sub(created).Round(10*time.Millisecond), domainReady.Sub(created).Round(10*time.Millisecond))
	for _, n := range nodes[:2] {
		r := d.byNode[n.name]
		since := func(at time.Time) time.Duration { return at.Sub(r.claimSeen).Round(10 * time.Millisecond) }
		t.Logf("MEASURED %s on %s: claim -> pod running with its channel: %s (claim -> allocated %s -> bound %s -> running %s -> channel checked %s)", name, n.name,
			since(r.envSet), since(r.allocated), since(r.bound), since(r.running), since(r.envSet))
	}
	return d
}

// secondDomain runs a second domain beside first (NVIDIA's #892: several domains in one clique): its job of two
// workers without GPUs lands on the same two clique-1 nodes while first's workers run there, each worker's claim
// allocated a share of the node's channel-0 like first's. Both domains are Ready; the second's workers share a
// host channel, another than first's; each node runs a daemon per domain. Deleting the second (job, then
// domain) leaves first's workers running, its daemons the same processes, and first Ready.
func secondDomain(ctx context.Context, t *testing.T, c *harness.Cluster, nodes []*cdNode, cliques map[string]string, first *cdDomainRun) {
	t.Helper()
	cs := c.Client
	second := runDomainJob(ctx, t, c, nodes, cliques, "second-compute-domain", "second-worker", 0)
	if second.channel == first.channel {
		t.Errorf("%s and %s both have %s on the same nodes: each domain has a host channel of its own", first.name, second.name, first.channel)
	}
	for _, n := range nodes[:2] {
		a, b := first.byNode[n.name].claim.Status.Allocation.Devices.Results[0], second.byNode[n.name].claim.Status.Allocation.Devices.Results[0]
		if a.Device != b.Device || a.ShareID == nil || b.ShareID == nil || *a.ShareID == *b.ShareID {
			t.Errorf("%s: the two domains' claims were allocated %s (share %v) and %s (share %v), want two shares of one device",
				n.name, a.Device, a.ShareID, b.Device, b.ShareID)
		}
		if second.pids[n.name] == first.pids[n.name] {
			t.Errorf("%s: one IMEX daemon (pid %d) for both domains", n.name, first.pids[n.name])
		}
	}
	st, err := c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Get(ctx, first.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s, _, _ := unstructured.NestedString(st.Object, "status", "status"); s != "Ready" {
		t.Errorf("%s is %s while %s runs beside it, want Ready", first.name, s, second.name)
	}
	t.Logf("two domains on %s and %s: %s with %s, %s with %s", nodes[0].name, nodes[1].name, first.name, first.channel, second.name, second.channel)

	deleteDomainJob(ctx, t, c, nodes, second)
	st, err = c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Get(ctx, first.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s, _, _ := unstructured.NestedString(st.Object, "status", "status"); s != "Ready" || len(harness.DomainStatusNodes(st)) != 2 {
		t.Errorf("%s after %s was deleted: %v, want Ready with both nodes", first.name, second.name, st.Object["status"])
	}
	for _, n := range nodes[:2] {
		r := first.byNode[n.name]
		pod, err := cs.CoreV1().Pods(cdWorkNS).Get(ctx, r.pod.Name, metav1.GetOptions{})
		if err != nil || !harness.PodRunning(pod) || pod.DeletionTimestamp != nil {
			t.Errorf("%s's worker %s after %s was deleted: %s (%v), want it running on", first.name, r.pod.Name, second.name, harness.DescribeAPIPod(pod), err)
		}
		if pid, err := imexDaemonPID(n, first.uid); err != nil || pid != first.pids[n.name] || !harness.ProcessAlive(pid) {
			t.Errorf("%s's IMEX daemon on %s after %s was deleted: pid %d (%v), want %d running on", first.name, n.name, second.name, pid, err, first.pids[n.name])
		}
		if _, err := os.Stat(filepath.Join(n.env.NodeDirs().CDISpecs, "compute-domain-claim-"+string(r.claim.UID)+".json")); err != nil {
			t.Errorf("%s: the CDI spec of %s's claim after %s was deleted: %v", n.name, r.pod.Name, second.name, err)
		}
	}
}

// deleteDomainJob deletes d's job and, once its workers and their claims are gone (the kubelets unprepared
// them: their CDI specs are gone), the domain, and waits until the domain, its templates and its daemons
// (process and folder, on every node) are gone.
func deleteDomainJob(ctx context.Context, t *testing.T, c *harness.Cluster, nodes []*cdNode, d *cdDomainRun) {
	t.Helper()
	cs := c.Client
	if err := cs.BatchV1().Jobs(cdWorkNS).Delete(ctx, d.job, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground)}); err != nil {
		t.Fatalf("delete Job %s: %v", d.job, err)
	}
	if err := cdWait(ctx, d.job+"'s workers and their claims gone", func() (bool, error) {
		pods, err := cs.CoreV1().Pods(cdWorkNS).List(ctx, metav1.ListOptions{LabelSelector: "app=" + d.job})
		if err != nil || len(pods.Items) > 0 {
			return false, err
		}
		claims, err := cs.ResourceV1().ResourceClaims(cdWorkNS).List(ctx, metav1.ListOptions{LabelSelector: cdDomainLabel + "=" + d.uid})
		return err == nil && len(claims.Items) == 0, err
	}); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes[:2] {
		r := d.byNode[n.name]
		if _, err := os.Stat(filepath.Join(n.env.NodeDirs().CDISpecs, "compute-domain-claim-"+string(r.claim.UID)+".json")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: the CDI spec of %s's claim after the pod went: %v", n.name, r.pod.Name, err)
		}
	}
	if err := c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Delete(ctx, d.name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete ComputeDomain %s: %v", d.name, err)
	}
	gone := waitDomainGone(ctx, t, c, nodes, cdWorkNS, d.name, d.uid)
	for node, pid := range d.pids {
		if harness.ProcessAlive(pid) {
			t.Errorf("%s's IMEX daemon on %s, pid %d, still runs", d.name, node, pid)
		}
	}
	t.Logf("MEASURED %s: ComputeDomain deleted -> domain, templates and daemons gone: %s", d.name, gone.Round(10*time.Millisecond))
}

// waitDomainGone waits, once the ComputeDomain namespace/name (UID uid) was deleted, until it, its templates
// (in its namespace and the controller's) and its daemons (process and folder, on every node) are gone, and
// returns how long that took.
func waitDomainGone(ctx context.Context, t *testing.T, c *harness.Cluster, nodes []*cdNode, namespace, name, uid string) time.Duration {
	t.Helper()
	cs := c.Client
	deleted := time.Now()
	if err := cdWait(ctx, name+", its templates and its daemons gone", func() (bool, error) {
		if _, err := c.Dynamic.Resource(cdGVR).Namespace(namespace).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return false, err
		}
		sel := metav1.ListOptions{LabelSelector: cdDomainLabel + "=" + uid}
		for _, ns := range []string{namespace, cdControllerNS} {
			if l, err := cs.ResourceV1().ResourceClaimTemplates(ns).List(ctx, sel); err != nil || len(l.Items) > 0 {
				return false, err
			}
		}
		for _, n := range nodes {
			if pid, err := imexDaemonPID(n, uid); err == nil && harness.ProcessAlive(pid) {
				return false, nil
			}
			if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", uid)); !errors.Is(err, os.ErrNotExist) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	return time.Since(deleted)
}

// daemonClaimPod runs a pod in the controller's namespace on n with a claim from d's daemon template
// (computedomain-daemon-<UID>): its container gets the domain's identity in its environment, as NVIDIA's
// driver gives its daemon pods, and no channel. Deleting the pod unprepares the claim (its CDI spec goes) and
// leaves the domain's daemon on n running.
func daemonClaimPod(ctx context.Context, t *testing.T, c *harness.Cluster, n *cdNode, d *cdDomainRun, clique string) {
	t.Helper()
	cs := c.Client
	if err := cdWait(ctx, "the default ServiceAccount of "+cdControllerNS, func() (bool, error) {
		_, err := cs.CoreV1().ServiceAccounts(cdControllerNS).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	grace := int64(1)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "imex-daemon-claim", Namespace: cdControllerNS},
		Spec: corev1.PodSpec{
			HostNetwork:                   true,
			NodeSelector:                  map[string]string{corev1.LabelHostname: n.name},
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{
				Name: "daemon", Image: "docker.io/" + harness.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sh", "-c", "echo E2E_CHANNELS=$(ls " + cdChannelDir + " 2>/dev/null); env; echo " +
					harness.ReadyMarker + "; exec sleep 86400"},
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "daemon"}}},
			}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "daemon", ResourceClaimTemplateName: ptr.To("computedomain-daemon-" + d.uid)}},
		},
	}
	created := time.Now()
	pod, err := cs.CoreV1().Pods(cdControllerNS).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod with a daemon claim: %v", err)
	}
	var env map[string]string
	if err := cdWait(ctx, "the daemon claim's pod running", func() (bool, error) {
		p, err := cs.CoreV1().Pods(cdControllerNS).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			return false, cdFatal(fmt.Errorf("pod %s ended: %s", p.Name, harness.DescribeAPIPod(p)))
		}
		pod = p
		if !harness.PodRunning(p) {
			return false, nil
		}
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		env, err = n.env.PodContainerEnvOf(short, p, "daemon")
		return err == nil, nil
	}); err != nil {
		t.Fatalf("%v: %s", err, harness.DescribeAPIPod(pod))
	}
	t.Logf("MEASURED daemon claim pod created -> running with the domain's identity: %s", time.Since(created).Round(10*time.Millisecond))
	for k, want := range map[string]string{"COMPUTE_DOMAIN_UUID": d.uid, "COMPUTE_DOMAIN_NAME": d.name,
		"COMPUTE_DOMAIN_NAMESPACE": cdWorkNS, "CLIQUE_ID": clique, "E2E_CHANNELS": ""} {
		if env[k] != want {
			t.Errorf("daemon claim's container: %s=%q, want %q", k, env[k], want)
		}
	}
	claim := pod.Status.ResourceClaimStatuses
	if len(claim) != 1 || claim[0].ResourceClaimName == nil {
		t.Fatalf("pod %s: resource claim statuses %+v", pod.Name, claim)
	}
	cl, err := cs.ResourceV1().ResourceClaims(cdControllerNS).Get(ctx, *claim[0].ResourceClaimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	spec := filepath.Join(n.env.NodeDirs().CDISpecs, "compute-domain-claim-"+string(cl.UID)+".json")
	if _, err := os.Stat(spec); err != nil {
		t.Errorf("daemon claim's CDI spec on %s: %v", n.name, err)
	}
	if err := cs.CoreV1().Pods(cdControllerNS).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cdWait(ctx, "the daemon claim's pod and claim gone", func() (bool, error) {
		if _, err := cs.CoreV1().Pods(cdControllerNS).Get(ctx, pod.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return false, err
		}
		_, err := cs.ResourceV1().ResourceClaims(cdControllerNS).Get(ctx, cl.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), harness.IgnoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(spec); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("daemon claim's CDI spec on %s after the pod went: %v", n.name, err)
	}
	if pid, err := imexDaemonPID(n, d.uid); err != nil || pid != d.pids[n.name] || !harness.ProcessAlive(pid) {
		t.Errorf("%s's IMEX daemon on %s after the daemon claim went: pid %d (%v), want %d running on", d.name, n.name, pid, err, d.pids[n.name])
	}
}

// nodeFailure kills failing's kubelet, agent and IMEX daemon, as a node that crashes, and checks what
// docs/compute-domains.md says: once the Node is NotReady its entry leaves status.nodes, the survivor keeps its
// index, its daemon is reloaded without the peer (same process) and its entry is Ready alone, its worker runs
// on, and the domain is NotReady. Then the node comes back (kubelet and agent started again): it rejoins at a
// free index and the domain is Ready again.
func nodeFailure(ctx context.Context, t *testing.T, c *harness.Cluster, survivor, failing *cdNode, domainName, domainUID string, survivorPID int, survivorPod string) {
	t.Helper()
	cs := c.Client
	get := func() (*unstructured.Unstructured, error) {
		return c.Dynamic.Resource(cdGVR).Namespace(cdWorkNS).Get(ctx, domainName, metav1.GetOptions{})
	}
	before, err := get()
	if err != nil {
		t.Fatal(err)
	}
	survivorIndex := harness.DomainStatusNodes(before)[survivor.name]["index"]
	failingPID, err := imexDaemonPID(failing, domainUID)
	if err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	failing.env.Kubelet().Kill()
	failing.agent.Kill()
	_ = syscall.Kill(failingPID, syscall.SIGKILL)
	t.Logf("node %s fails: kubelet, gpu-agent and IMEX daemon (pid %d) killed", failing.name, failingPID)

	var notReady, left time.Time
	var last *unstructured.Unstructured
	err = cdWait(ctx, failing.name+"'s entry out of status.nodes and "+survivor.name+"'s Ready alone", func() (bool, error) {
		n, err := cs.CoreV1().Nodes().Get(ctx, failing.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		now := time.Now()
		if notReady.IsZero() && !nodeIsReady(n) {
			notReady = now
		}
		if last, err = get(); err != nil {
			return false, err
		}
		entries := harness.DomainStatusNodes(last)
		if _, ok := entries[failing.name]; ok {
			return false, nil
		}
		if left.IsZero() {
			left = now
			if notReady.IsZero() {
				return false, cdFatal(fmt.Errorf("%s's entry left status.nodes while its Node is Ready", failing.name))
			}
		}
		st, _, _ := unstructured.NestedString(last.Object, "status", "status")
		return len(entries) == 1 && entries[survivor.name]["status"] == "Ready" && st == "NotReady", nil
	})
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, last.Object["status"])
	}
	if got := harness.DomainStatusNodes(last)[survivor.name]["index"]; fmt.Sprint(got) != fmt.Sprint(survivorIndex) {
		t.Errorf("%s's index went from %v to %v when %s left", survivor.name, survivorIndex, got, failing.name)
	}
	if pid, err := imexDaemonPID(survivor, domainUID); err != nil || pid != survivorPID || !harness.ProcessAlive(pid) {
		t.Errorf("%s's IMEX daemon: pid %d (%v), want %d still running (reloaded, not restarted)", survivor.name, pid, err, survivorPID)
	}
	nodesCfg, err := os.ReadFile(filepath.Join(survivor.stateDir(), "imex", domainUID, "nodes.cfg"))
	if err != nil || strings.Contains(string(nodesCfg), failing.ip) || !strings.Contains(string(nodesCfg), survivor.ip) {
		t.Errorf("%s's node list after %s left: %q (%v), want %s and not %s", survivor.name, failing.name, nodesCfg, err, survivor.ip, failing.ip)
	}
	pod, err := cs.CoreV1().Pods(cdWorkNS).Get(ctx, survivorPod, metav1.GetOptions{})
	if err != nil || !harness.PodRunning(pod) || pod.DeletionTimestamp != nil {
		t.Errorf("worker %s on %s after %s failed: %s (%v), want it running on", survivorPod, survivor.name, failing.name, harness.DescribeAPIPod(pod), err)
	}
	t.Logf("MEASURED node %s killed -> Node NotReady %s -> entry out of status.nodes %s -> %s Ready alone, domain NotReady %s",
		failing.name, notReady.Sub(killed).Round(10*time.Millisecond), left.Sub(killed).Round(10*time.Millisecond),
		survivor.name, time.Since(killed).Round(10*time.Millisecond))

	// The node comes back: its worker's claim is still allocated there, so the controller lists it again.
	back := time.Now()
	if err := failing.env.StartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	startCDAgent(ctx, t, c, failing)
	err = cdWait(ctx, failing.name+" back in the domain, Ready", func() (bool, error) {
		if last, err = get(); err != nil {
			return false, err
		}
		entries := harness.DomainStatusNodes(last)
		st, _, _ := unstructured.NestedString(last.Object, "status", "status")
		return len(entries) == 2 && entries[failing.name]["status"] == "Ready" && entries[survivor.name]["status"] == "Ready" && st == "Ready", nil
	})
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, last.Object["status"])
	}
	// The lowest index of the clique that the survivor does not hold.
	lowest := "0"
	if fmt.Sprint(survivorIndex) == "0" {
		lowest = "1"
	}
	entries := harness.DomainStatusNodes(last)
	if fmt.Sprint(entries[survivor.name]["index"]) != fmt.Sprint(survivorIndex) || fmt.Sprint(entries[failing.name]["index"]) != lowest {
		t.Errorf("indices after %s came back: %v, want %s's kept (%v) and %s at %s, the lowest free", failing.name, entries, survivor.name, survivorIndex, failing.name, lowest)
	}
	if pid, err := imexDaemonPID(failing, domainUID); err != nil || !harness.ProcessAlive(pid) || pid == failingPID {
		t.Errorf("%s's IMEX daemon after it came back: pid %d (%v), want a new one running", failing.name, pid, err)
	}
	t.Logf("MEASURED node %s back (kubelet and gpu-agent started) -> rejoined, domain Ready: %s", failing.name, time.Since(back).Round(10*time.Millisecond))
}

// nvbandwidthWorkers is the worker half of NVIDIA's nvbandwidth-test-job as an Indexed Job (no MPI operator
// runs here, so no MPIJob and no launcher): two ranks, each with gpus GPUs (NVIDIA's asks for a tray's 4) and a
// claim from the domain's template, on two different nodes of clique. Each rank checks that it has its GPUs
// (NVIDIA_VISIBLE_DEVICES, from the device plugin), exactly one IMEX channel, a character device, and its rank
// in its environment; prints them, the channel's device numbers and its environment; and waits, as an MPI
// worker waits for its launcher.
func nvbandwidthWorkers(name, template, clique string, gpus int) *batchv1.Job {
	labels := map[string]string{"app": name}
	script := `set -eu
gpus=$(echo "${NVIDIA_VISIBLE_DEVICES:-}" | tr , '\n' | grep -c ^GPU- || true)
if [ "$gpus" != ` + strconv.Itoa(gpus) + ` ]; then echo "rank $JOB_COMPLETION_INDEX: want ` + strconv.Itoa(gpus) + ` GPUs, have NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES:-}" >&2; exit 1; fi
chans=$(ls ` + cdChannelDir + `)
if [ "$(echo $chans | wc -w)" != 1 ]; then echo "rank $JOB_COMPLETION_INDEX: want one IMEX channel in ` + cdChannelDir + `, have: $chans" >&2; exit 1; fi
if [ ! -c "` + cdChannelDir + `/$chans" ]; then echo "rank $JOB_COMPLETION_INDEX: $chans is not a character device" >&2; exit 1; fi
echo "E2E_CHANNEL=$chans"
echo "E2E_CHANNEL_DEVNO=$(stat -c %t:%T ` + cdChannelDir + `/$chans)"
env
echo ` + harness.ReadyMarker + `
exec sleep 86400`
	grace := int64(1)
	resources := corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "compute-domain-channel"}}}
	if gpus > 0 {
		resources.Limits = corev1.ResourceList{gpuResource: *apiresource.NewQuantity(int64(gpus), apiresource.DecimalSI)}
	}
	return &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cdWorkNS},
		Spec: batchv1.JobSpec{
			CompletionMode: ptr.To(batchv1.IndexedCompletion),
			Completions:    ptr.To[int32](2),
			Parallelism:    ptr.To[int32](2),
			BackoffLimit:   ptr.To[int32](0),
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					// The nodes have no CNI (see harness.StartCluster).
					HostNetwork:                   true,
					RestartPolicy:                 corev1.RestartPolicyNever,
					TerminationGracePeriodSeconds: &grace,
					Affinity: &corev1.Affinity{
						NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
							NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
								Key: cdCliqueLabel, Operator: corev1.NodeSelectorOpIn, Values: []string{clique},
							}}}},
						}},
						PodAntiAffinity: &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{
							LabelSelector: &metav1.LabelSelector{MatchLabels: labels}, TopologyKey: corev1.LabelHostname,
						}}},
					},
					Containers: []corev1.Container{{
						Name: "worker", Image: "docker.io/" + harness.BusyboxImage, ImagePullPolicy: corev1.PullNever,
						Command:   []string{"sh", "-c", script},
						Resources: resources,
					}},
					ResourceClaims: []corev1.PodResourceClaim{{Name: "compute-domain-channel", ResourceClaimTemplateName: ptr.To(template)}},
				},
			},
		},
	}
}

// applyComputeDomainManifests applies the CRD and NVIDIA's two DeviceClasses from deploy/manifests/computedomains,
// as shipped.
func applyComputeDomainManifests(ctx context.Context, t *testing.T, c *harness.Cluster) {
	t.Helper()
	var objs []*unstructured.Unstructured
	for _, f := range []string{"crd.yaml", "deviceclasses.yaml"} {
		o, err := harness.ReadObjects(filepath.Join(repoRoot(), "deploy", "manifests", "computedomains", f))
		if err != nil {
			t.Fatal(err)
		}
		objs = append(objs, o...)
	}
	if err := c.Apply(ctx, objs); err != nil {
		t.Fatal(err)
	}
}

// startCDAgent runs `gpu-agent run --dra` for n as a host process with the DaemonSet's flags, each path the
// node's: its kubelet's directories, its containerd's CDI directory, and a simulated GB200 tray of n's clique
// whose driver files (the IMEX channels) are under the agent's own directory. The sim's state file outlives the
// process, as real GPUs outlive the agent.
func startCDAgent(ctx context.Context, t *testing.T, c *harness.Cluster, n *cdNode) {
	t.Helper()
	d := n.env.NodeDirs()
	for _, dir := range []string{n.stateDir(), filepath.Join(n.agentDir(), "mps"), n.simRoot(), filepath.Join(d.KubeletPlugins, "gpu.nvidia.com")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := l.Addr().String()
	l.Close()
	n.agentN++
	p, err := harness.StartProcess("gpu-agent "+n.name, filepath.Join(d.Logs, fmt.Sprintf("gpu-agent-%d.log", n.agentN)), nil,
		inputs.agent, "run", "--dra",
		"--kubeconfig", c.AdminKubeconfig(),
		"--node-name", n.name,
		"--backend", fmt.Sprintf("sim:gb200-tray,clique=%d,root=%s,state=%s", n.clique, n.simRoot(), filepath.Join(n.agentDir(), "sim-state.json")),
		"--device-plugin-dir", d.DevicePlugins,
		"--pod-resources-socket", d.PodResourcesSocket,
		"--state-dir", n.stateDir(),
		"--mps-root", filepath.Join(n.agentDir(), "mps"),
		"--cdi-spec-dir", d.CDISpecs,
		"--nvidia-dev-root", d.DevRoot,
		"--dra-plugin-dir", filepath.Join(d.KubeletPlugins, "gpu.nvidia.com"),
		"--kubelet-registry-dir", d.PluginsRegistry,
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
	if err := cdWait(ctx, "gpu-agent of "+n.name+" ready", func() (bool, error) {
		if done, err := p.Exited(); done {
			return false, cdFatal(fmt.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, p.LogPath))
		}
		return harness.HTTPOK(ctx, "http://"+listen+"/readyz") == nil, nil
	}); err != nil {
		t.Fatal(err)
	}
}

// waitCDAgentPublished waits until n's agent has published its compute-domain.nvidia.com slices (channels and
// the daemon device), labelled its Node with its clique, which it returns, and the kubelet offers the tray's
// GPUs through the agent's device plugin.
func waitCDAgentPublished(ctx context.Context, t *testing.T, c *harness.Cluster, n *cdNode) string {
	t.Helper()
	var why, clique string
	err := cdWait(ctx, "the agent of "+n.name+" published", func() (bool, error) {
		if done, err := n.agent.Exited(); done {
			return false, cdFatal(fmt.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, n.agent.LogPath))
		}
		l, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + n.name})
		if err != nil {
			return false, err
		}
		var channels, daemons int
		for _, s := range l.Items {
			for _, d := range s.Spec.Devices {
				switch {
				case s.Spec.Driver == cdDriver && strings.HasPrefix(d.Name, "channel-"):
					channels++
				case s.Spec.Driver == cdDriver && strings.HasPrefix(d.Name, "daemon-"):
					daemons++
				}
			}
		}
		why = fmt.Sprintf("%d channels, %d daemon devices", channels, daemons)
		if channels == 0 || daemons != 1 {
			return false, nil
		}
		node, err := c.Client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		why, clique = "no label "+cdCliqueLabel, node.Labels[cdCliqueLabel]
		if clique == "" {
			return false, nil
		}
		// The device plugin's GPUs, through this kubelet's own device plugin directory.
		q := node.Status.Allocatable[gpuResource]
		why = fmt.Sprintf("allocatable %s %s, want %d", gpuResource, q.String(), trayGPUs)
		return q.Value() == trayGPUs, nil
	})
	if err != nil {
		t.Fatalf("%v (last: %s; see %s)", err, why, n.agent.LogPath)
	}
	return clique
}

// imexDaemonPID reads the pid file n's agent keeps for its IMEX daemon of domain.
func imexDaemonPID(n *cdNode, domain string) (int, error) {
	return harness.IMEXDaemonPID(n.stateDir(), domain)
}

// killIMEXDaemons ends IMEX daemons a failed run left on nodes.
func killIMEXDaemons(t *testing.T, nodes []*cdNode) {
	for _, n := range nodes {
		harness.KillIMEXDaemons(t, n.name, n.stateDir())
	}
}

func nodeIsReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func unixMajor(dev uint64) uint64 { return (dev >> 8) & 0xfff }
func unixMinor(dev uint64) uint64 { return (dev & 0xff) | ((dev >> 12) & 0xfff00) }

// cdFatal ends a cdWait at once; other errors of a condition (an API call that failed) are retried.
func cdFatal(err error) error { return harness.Fatal(err) }

// cdWait polls cond every 100ms until it is true, fails fatally, or cdStep (or ctx) ends.
func cdWait(ctx context.Context, what string, cond func() (bool, error)) error {
	return harness.WaitFor(ctx, what, cdStep, cond)
}
