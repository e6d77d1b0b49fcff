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
// kube-apiserver, kube-scheduler, kube-controller-manager) with no kubelet: three fake Ready Nodes, two in
// NVLink clique 1 and one in clique 2, each served by a real `gpu-agent run --dra` on a simulated GB200 tray,
// and `gpu-agent controller`. A ComputeDomain of two nodes gets two pods pinned to the clique-1 nodes; the
// real scheduler allocates their channel claims and waits on the binding condition, the controller lists the
// nodes in status.nodes, the agents start their IMEX stand-ins and report Ready, and the pods bind. The test
// then plays the kubelet: Prepare over each agent's DRA socket (the CDI spec names the domain's channel under
// the sim root), Unprepare, and deletion of the pods and the domain (the finalizer, templates, daemons).
//
// The agents and the controller use the admin kubeconfig: their RBAC and the status admission policy are
// tested in test/deploy, not here. What no kubelet means: nothing runs the pods, so no container sees its
// channel, and the pods are force-deleted (the kubelet would confirm their deletion).
func TestComputeDomainControlPlane(t *testing.T) {
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

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
		// pods. Node lifecycle is off: these Nodes have no kubelet to heartbeat.
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
	cs := cp.Client
	applyComputeDomainAPI(ctx, t, cp)
	for _, ns := range []string{controllerNS, workNS} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("namespace %s: %v", ns, err)
		}
	}

	nodes := []*simNode{
		{name: "rack1-tray1", clique: 1, ip: "127.0.1.1"},
		{name: "rack1-tray2", clique: 1, ip: "127.0.1.2"},
		{name: "rack2-tray1", clique: 2, ip: "127.0.1.3"},
	}
	for i, n := range nodes {
		n.dir = filepath.Join(dir, "n"+strconv.Itoa(i))
		if err := createNode(ctx, cs, n); err != nil {
			t.Fatal(err)
		}
		startAgent(t, bins.agent, cp.AdminKubeconfig(), n)
	}
	t.Cleanup(func() { killDaemons(t, nodes) })
	ctrl, err := harness.StartProcess("gpu-agent-controller", filepath.Join(dir, "logs", "controller.log"), nil,
		bins.agent, "controller", "--kubeconfig", cp.AdminKubeconfig(), "--namespace", controllerNS,
		"--leader-elect=false", "--listen", "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ctrl.Stop(10 * time.Second); err != nil {
			t.Logf("controller stop: %v", err)
		}
	})

	// Each agent publishes both drivers' slices, the channels with the binding condition, and labels its
	// Node with its clique.
	for _, n := range nodes {
		waitAgentPublished(ctx, t, cs, n)
	}
	cliques := map[string]string{}
	for _, n := range nodes {
		node, err := cs.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cliques[n.name] = node.Labels[cliqueLabel]
	}
	if cliques[nodes[0].name] != cliques[nodes[1].name] || cliques[nodes[0].name] == cliques[nodes[2].name] {
		t.Fatalf("clique labels %v: want the first two equal and the third different", cliques)
	}
	if err := waitFor(ctx, "the default ServiceAccount of "+workNS, func() (bool, error) {
		_, err := cs.CoreV1().ServiceAccounts(workNS).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, ignoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}

	// The domain, as a user writes it.
	const domainName, templateName = "job-domain", "job-channel"
	domain := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": domainName, "namespace": workNS},
		"spec": map[string]any{
			"numNodes": int64(2),
			"channel":  map[string]any{"resourceClaimTemplate": map[string]any{"name": templateName}},
		},
	}}
	domainCreated := time.Now()
	domain, err = cp.Dynamic.Resource(cdGVR).Namespace(workNS).Create(ctx, domain, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create ComputeDomain: %v", err)
	}
	domainUID := string(domain.GetUID())
	if err := waitFor(ctx, "the workload template "+templateName, func() (bool, error) {
		_, err := cs.ResourceV1().ResourceClaimTemplates(workNS).Get(ctx, templateName, metav1.GetOptions{})
		return err == nil, ignoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
	templateSeen := time.Since(domainCreated)

	// Two pods of the job, one per clique-1 node, each with a claim from the domain's template.
	workers := nodes[:2]
	podCreated := map[string]time.Time{}
	for i, n := range workers {
		pod := workerPod(fmt.Sprintf("worker-%d", i), n.name, templateName)
		if _, err := cs.CoreV1().Pods(workNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create pod %s: %v", pod.Name, err)
		}
		podCreated[pod.Name] = time.Now()
	}

	// Watch the chain, pods before the domain in each round: a pod seen bound while its node's entry is
	// read NotReady afterwards was bound before its daemon was ready.
	type progress struct {
		claimSeen, allocated, entryReady, conditioned, bound time.Time
		claim                                                *resourceapi.ResourceClaim
	}
	prog := map[string]*progress{} // by node
	for _, n := range workers {
		prog[n.name] = &progress{}
	}
	var allReady time.Time
	var lastDomain *unstructured.Unstructured
	err = waitFor(ctx, "both entries Ready and both pods bound", func() (bool, error) {
		pods, err := cs.CoreV1().Pods(workNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		claims, err := cs.ResourceV1().ResourceClaims(workNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		lastDomain, err = cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, domainName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		now := time.Now()
		entries := statusNodes(lastDomain)
		for _, pod := range pods.Items {
			want := pod.Spec.NodeSelector[corev1.LabelHostname]
			p := prog[want]
			if p == nil {
				return false, fatal(fmt.Errorf("pod %s: unexpected node selector %q", pod.Name, want))
			}
			if pod.Spec.NodeName != "" && p.bound.IsZero() {
				p.bound = now
				if e := entries[want]; e["status"] != "Ready" {
					return false, fatal(fmt.Errorf("pod %s bound to %s while the node's entry is %v", pod.Name, pod.Spec.NodeName, e))
				}
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
				if p.conditioned.IsZero() && slices.ContainsFunc(c.Status.Devices, func(d resourceapi.AllocatedDeviceStatus) bool {
					return meta(d.Conditions, daemonReadyCond)
				}) {
					p.conditioned = now
				}
				p.claim = c.DeepCopy()
			}
		}
		for name, p := range prog {
			if e := entries[name]; e["status"] == "Ready" && p.entryReady.IsZero() {
				p.entryReady = now
			}
		}
		done := true
		for _, p := range prog {
			done = done && !p.entryReady.IsZero() && !p.bound.IsZero()
			if !p.entryReady.IsZero() && allReady.Before(p.entryReady) {
				allReady = p.entryReady
			}
		}
		return done, nil
	})
	if err != nil {
		t.Fatalf("%v\nlast domain status: %v", err, lastDomain.Object["status"])
	}

	// What the domain says: the two clique-1 nodes, at their addresses and clique, and Ready.
	if st, _, _ := unstructured.NestedString(lastDomain.Object, "status", "status"); st != "Ready" {
		t.Errorf("status.status %q, want Ready", st)
	}
	entries := statusNodes(lastDomain)
	if len(entries) != 2 {
		t.Errorf("status.nodes %v: want the two clique-1 nodes", entries)
	}
	for _, n := range workers {
		e := entries[n.name]
		if e["ipAddress"] != n.ip || e["cliqueID"] != cliques[n.name] {
			t.Errorf("entry of %s: %v, want ipAddress %s and cliqueID %s", n.name, e, n.ip, cliques[n.name])
		}
	}
	// Each claim: allocated a channel of its pod's node, with the binding condition set by the controller.
	for _, n := range workers {
		c := prog[n.name].claim
		checkClaim(t, c, n.name)
	}

	// The daemons run where the domain is, not on the clique-2 node.
	pids := map[string]int{}
	for _, n := range workers {
		pid, err := daemonPID(n, domainUID)
		if err != nil {
			t.Fatalf("IMEX daemon of %s: %v", n.name, err)
		}
		if !alive(pid) {
			t.Fatalf("IMEX daemon of %s: pid %d not running", n.name, pid)
		}
		pids[n.name] = pid
	}
	if _, err := os.Stat(filepath.Join(nodes[2].stateDir(), "imex", domainUID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s (clique 2) has a folder for the domain's daemon: %v", nodes[2].name, err)
	}

	// The kubelet's part: Prepare on each node, as the kubelet calls it (namespace, name, UID).
	channels := map[string]string{}
	for _, n := range workers {
		c := prog[n.name].claim
		channels[n.name] = prepare(ctx, t, n, c)
	}
	if channels[workers[0].name] != channels[workers[1].name] {
		t.Errorf("the domain's channel differs between its nodes: %v", channels)
	}

	t.Logf("figures (polled every 100ms, two busy cores): ComputeDomain created → workload template %s; → both entries Ready (daemons READY) %s",
		templateSeen.Round(time.Millisecond), allReady.Sub(domainCreated).Round(time.Millisecond))
	for _, n := range workers {
		p := prog[n.name]
		since := func(at time.Time) time.Duration { return at.Sub(podCreated[podOf(p.claim)]).Round(time.Millisecond) }
		t.Logf("figures: %s: pod created → claim seen %s → allocated %s → entry Ready %s → %s set %s → pod bound %s (claim → bound %s)", n.name,
			since(p.claimSeen), since(p.allocated), since(p.entryReady), daemonReadyCond, since(p.conditioned), since(p.bound),
			p.bound.Sub(p.claimSeen).Round(time.Millisecond))
	}

	// Teardown as the kubelet and the user do it: Unprepare, the pods go, then the domain.
	for _, n := range workers {
		unprepare(ctx, t, n, prog[n.name].claim)
	}
	for _, n := range workers {
		name := podOf(prog[n.name].claim)
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
	if err := cp.Dynamic.Resource(cdGVR).Namespace(workNS).Delete(ctx, domainName, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete ComputeDomain: %v", err)
	}
	if err := waitFor(ctx, "the domain and its templates gone", func() (bool, error) {
		_, err := cp.Dynamic.Resource(cdGVR).Namespace(workNS).Get(ctx, domainName, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return false, err
		}
		sel := metav1.ListOptions{LabelSelector: domainLabel + "=" + domainUID}
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
	if err := waitFor(ctx, "the domain's daemons stopped", func() (bool, error) {
		for _, n := range workers {
			if alive(pids[n.name]) {
				return false, nil
			}
			if _, err := os.Stat(filepath.Join(n.stateDir(), "imex", domainUID)); !errors.Is(err, os.ErrNotExist) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if done, err := n.agent.Exited(); done {
			t.Errorf("gpu-agent of %s exited: %v (see %s)", n.name, err, n.agent.LogPath)
		}
	}
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
		return err == nil, ignoreNotFound(err)
	}); err != nil {
		t.Fatal(err)
	}
}

// createNode makes a Ready Node with no kubelet behind it, at its own loopback address, with no taint.
func createNode(ctx context.Context, cs kubernetes.Interface, n *simNode) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: map[string]string{
		corev1.LabelHostname: n.name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
	}}}
	node, err := cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create Node %s: %w", n.name, err)
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU: apiresource.MustParse("144"), corev1.ResourceMemory: apiresource.MustParse("1Ti"),
		corev1.ResourcePods: apiresource.MustParse("110"),
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

// workerPod is one rank of the job: pinned to node, with one claim from the domain's template.
func workerPod(name, node, template string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: workNS},
		Spec: corev1.PodSpec{
			NodeSelector:  map[string]string{corev1.LabelHostname: node},
			RestartPolicy: corev1.RestartPolicyNever,
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

// statusNodes is status.nodes by name.
func statusNodes(cd *unstructured.Unstructured) map[string]map[string]any {
	out := map[string]map[string]any{}
	list, _, _ := unstructured.NestedSlice(cd.Object, "status", "nodes")
	for _, e := range list {
		if m, ok := e.(map[string]any); ok {
			name, _ := m["name"].(string)
			out[name] = m
		}
	}
	return out
}

// daemonPID reads the pid file the agent keeps for its daemon of domain.
func daemonPID(n *simNode, domain string) (int, error) {
	b, err := os.ReadFile(filepath.Join(n.stateDir(), "imex", domain, "pid"))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// alive: pid is a process that has not exited (a zombie has).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] != 'Z'
}

// killDaemons ends IMEX daemons a failed run left: they run in sessions of their own and outlive the agent
// by design.
func killDaemons(t *testing.T, nodes []*simNode) {
	for _, n := range nodes {
		pidFiles, _ := filepath.Glob(filepath.Join(n.stateDir(), "imex", "*", "pid"))
		for _, f := range pidFiles {
			b, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && alive(pid) {
				t.Logf("%s: killing IMEX daemon %d left running (%s)", n.name, pid, f)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
}

// fatalError ends a wait at once; other errors of a condition (an API call that failed) are retried.
type fatalError struct{ error }

func fatal(err error) error { return fatalError{err} }

// waitFor polls cond every 100ms until it is true, fails fatally, or stepLimit (or ctx) ends.
func waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, stepLimit)
	defer cancel()
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if f := (fatalError{}); errors.As(err, &f) {
			return fmt.Errorf("%s: %w", what, f.error)
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not within %s (last error: %v)", what, stepLimit, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func ignoreNotFound(err error) error {
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}
