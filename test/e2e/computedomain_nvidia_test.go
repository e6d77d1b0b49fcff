//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// nvidiaRepoEnv names a checkout of kubernetes-sigs/dra-driver-nvidia-gpu, as for dra/devicemodel's
// TestNVIDIAClaims: NVIDIA's files are read from there and never copied into this repository.
const nvidiaRepoEnv = "NVIDIA_DRA_DRIVER_REPO"

// nvidiaManifest is one of NVIDIA's demo files and what the test checks of it once it is applied.
type nvidiaManifest struct {
	path  string // in NVIDIA's repository
	check func(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured)
}

// TestNVIDIAComputeDomainManifests applies NVIDIA's ComputeDomain demo manifests as they are, read from the
// checkout NVIDIA_DRA_DRIVER_REPO names, on the rack of TestComputeDomainKubelets (three real kubelets on
// simulated GB200 trays, a gpu-agent each, gpu-agent controller), one file after the other: each file's objects
// are created in its order through the dynamic client (in namespace default where they name none, as kubectl
// does), checked against what NVIDIA's README.sh and bats tests expect, deleted in its order (kubectl delete
// -f), and nothing of it may be left.
//
// NVIDIA's pods do not use the host network, so the rack's nodes get a pod network (harness.ClusterConfig
// PodNetwork: the reference CNI bridge plugin). Their image, ubuntu:22.04, cannot be pulled here: the suite
// builds a stand-in under that name from its busybox (harness.WriteUbuntuStandIn), whose `bash` is busybox's
// sh, enough for the pods' `ls -la /dev/nvidia-caps-imex-channels; trap 'exit 0' TERM; sleep 9999 & wait`.
//
// What each file proves, and what cannot run here, is in docs/compute-domains.md ("NVIDIA's manifests").
func TestNVIDIAComputeDomainManifests(t *testing.T) {
	repo := os.Getenv(nvidiaRepoEnv)
	if repo == "" {
		t.Skipf("%s is not set: point it at a checkout of kubernetes-sigs/dra-driver-nvidia-gpu to apply NVIDIA's ComputeDomain demo manifests unchanged", nvidiaRepoEnv)
	}
	files := []nvidiaManifest{
		{"demo/specs/imex/channel-injection.yaml", func(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured) {
			checkChannelInjection(ctx, t, rack, objs, false)
		}},
		{"demo/specs/imex/channel-injection-all.yaml", func(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured) {
			checkChannelInjection(ctx, t, rack, objs, true)
		}},
		{"demo/specs/imex/nvbandwidth-test-job.yaml", checkMPIJobManifest},
		{"demo/specs/imex/nvbandwidth-test-job-1.yaml", checkMPIJobManifest},
		{"demo/specs/imex/nvbandwidth-test-job-2.yaml", checkMPIJobManifest},
		{"demo/specs/imex/nvbandwidth-test-no-compute-domain-job.yaml", checkMPIJobManifest},
		{"demo/specs/quickstart/v1/imex-test1.yaml", checkIMEXTest1},
		{"demo/specs/quickstart/v1beta1/imex-test1.yaml", checkIMEXTest1},
	}
	// Every file is read before anything starts: a checkout without one is a failure, not a skip.
	objects := map[string][]*unstructured.Unstructured{}
	for _, f := range files {
		objs, err := harness.ReadObjects(filepath.Join(repo, f.path))
		if err != nil {
			t.Fatalf("%s: %v", nvidiaRepoEnv, err)
		}
		objects[f.path] = objs
	}
	ubuntu := filepath.Join(t.TempDir(), "ubuntu-standin.tar")
	if err := harness.WriteUbuntuStandIn(ubuntu, os.Getenv("E2E_BUSYBOX")); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	rack := startCDRack(ctx, t, cdRackOptions{PodNetwork: true, Images: []string{ubuntu}})
	// The rack has the compute-domain CRD and DeviceClasses; NVIDIA's files also name gpu.nvidia.com
	// (imex-test1's GPU claims) and an MPIJob.
	var install []*unstructured.Unstructured
	for _, f := range []string{filepath.Join(repoRoot(), "deploy", "manifests", "dra", "deviceclasses.yaml"), filepath.Join("testdata", "mpijob-crd.yaml")} {
		objs, err := harness.ReadObjects(f)
		if err != nil {
			t.Fatal(err)
		}
		install = append(install, objs...)
	}
	if err := rack.c.Apply(ctx, install); err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		t.Run(filepath.Base(filepath.Dir(f.path))+"/"+filepath.Base(f.path), func(t *testing.T) {
			start := time.Now()
			f.check(ctx, t, rack, objects[f.path])
			t.Logf("MEASURED %s: applied, checked, deleted and gone in %s", f.path, time.Since(start).Round(100*time.Millisecond))
		})
	}
	t.Logf("MEASURED TestNVIDIAComputeDomainManifests: %s from start", time.Since(rack.started).Round(time.Second))
}

// nvidiaObjects maps a file's objects to the API server's resources, as kubectl does; a version the API
// server does not serve is reported as such (errNotServed).
type nvidiaObjects struct {
	c      *harness.Cluster
	mapper meta.RESTMapper
}

var errNotServed = errors.New("not served by this API server")

func newNVIDIAObjects(rack *cdRack) *nvidiaObjects {
	return &nvidiaObjects{c: rack.c, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(rack.c.Client.Discovery()))}
}

// resource is o's resource client, namespaced (default when o names none) where its kind is.
func (n *nvidiaObjects) resource(o *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := o.GroupVersionKind()
	m, err := n.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		return nil, fmt.Errorf("%s %s: %s: %w", gvk.GroupVersion(), gvk.Kind, err, errNotServed)
	}
	if err != nil {
		return nil, err
	}
	if m.Scope.Name() != meta.RESTScopeNameNamespace {
		return n.c.Dynamic.Resource(m.Resource), nil
	}
	ns := o.GetNamespace()
	if ns == "" {
		ns = metav1.NamespaceDefault
	}
	return n.c.Dynamic.Resource(m.Resource).Namespace(ns), nil
}

// create creates objs in their order, as `kubectl create -f` does, and returns them as stored. It skips t
// when the API server does not serve one's version (before creating any).
func (n *nvidiaObjects) create(ctx context.Context, t *testing.T, objs []*unstructured.Unstructured) []*unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if _, err := n.resource(o); errors.Is(err, errNotServed) {
			t.Skipf("the file cannot be applied on this cluster: %v (Kubernetes 1.36's API server serves resource.k8s.io/v1beta1 only with --runtime-config; NVIDIA's v1 copy of the file runs instead)", err)
		} else if err != nil {
			t.Fatal(err)
		}
	}
	var out []*unstructured.Unstructured
	for _, o := range objs {
		ri, _ := n.resource(o)
		created, err := ri.Create(ctx, o.DeepCopy(), metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create %s %s: %v", o.GetKind(), o.GetName(), err)
		}
		out = append(out, created)
	}
	return out
}

// delete deletes objs in their order, as `kubectl delete -f` does (background propagation).
func (n *nvidiaObjects) delete(ctx context.Context, t *testing.T, objs []*unstructured.Unstructured) {
	t.Helper()
	bg := metav1.DeletePropagationBackground
	for _, o := range objs {
		ri, err := n.resource(o)
		if err != nil {
			t.Fatal(err)
		}
		if err := ri.Delete(ctx, o.GetName(), metav1.DeleteOptions{PropagationPolicy: &bg}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
}

// waitGone waits until every one of objs is gone.
func (n *nvidiaObjects) waitGone(ctx context.Context, t *testing.T, objs []*unstructured.Unstructured) {
	t.Helper()
	for _, o := range objs {
		ri, err := n.resource(o)
		if err != nil {
			t.Fatal(err)
		}
		if err := cdWait(ctx, o.GetKind()+" "+o.GetName()+" gone", func() (bool, error) {
			_, err := ri.Get(ctx, o.GetName(), metav1.GetOptions{})
			return apierrors.IsNotFound(err), harness.IgnoreNotFound(err)
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// only returns the one object of kind among objs, failing t unless there is exactly one.
func only(t *testing.T, objs []*unstructured.Unstructured, kind string) *unstructured.Unstructured {
	t.Helper()
	var found []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		t.Fatalf("the file has %d %s objects, the test expects 1: has NVIDIA's file changed?", len(found), kind)
	}
	return found[0]
}

func (r *cdRack) node(name string) *cdNode {
	for _, n := range r.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

// checkChannelInjection is NVIDIA's apply_check_delete_workload_imex_chan_inject (bats
// test_cd_imex_chan_inject.bats) for channel-injection.yaml, and its "(all)" test for
// channel-injection-all.yaml: a ComputeDomain of numNodes 1 and a pod with a claim from its template. The pod
// turns Ready and lists /dev/nvidia-caps-imex-channels in its log: for allocationMode Single exactly one
// channel, the one its claim's CDI spec names (NVIDIA's bats wants channel0; gpu-agent gives each domain a
// channel of its own, docs/compute-domains.md "Channel isolation"), for All every channel the node publishes
// (NVIDIA's bats wants channel2047 and channel222 among them), each a character device with the host
// channel's numbers. The domain turns Ready with the pod's node. Deleting the file's objects leaves nothing.
func checkChannelInjection(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured, all bool) {
	c, cs := rack.c, rack.c.Client
	n := newNVIDIAObjects(rack)
	cdObj, podObj := only(t, objs, "ComputeDomain"), only(t, objs, "Pod")
	mode, _, _ := unstructured.NestedString(cdObj.Object, "spec", "channel", "allocationMode")
	if all != (mode == "All") {
		t.Fatalf("%s: allocationMode %q: has NVIDIA's file changed?", cdObj.GetName(), mode)
	}
	created := n.create(ctx, t, objs)
	start := time.Now()
	var uid string
	for _, o := range created {
		if o.GetKind() == "ComputeDomain" {
			uid = string(o.GetUID())
		}
	}
	t.Cleanup(func() { n.delete(context.Background(), t, objs) }) // on an early failure; deleting twice is harmless

	var pod *corev1.Pod
	var domain *unstructured.Unstructured
	var podReady, domainReady time.Time
	err := cdWait(ctx, "pod "+podObj.GetName()+" Ready and ComputeDomain "+cdObj.GetName()+" Ready", func() (bool, error) {
		p, err := cs.CoreV1().Pods(metav1.NamespaceDefault).Get(ctx, podObj.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			return false, cdFatal(fmt.Errorf("pod %s ended: %s", p.Name, harness.DescribeAPIPod(p)))
		}
		if podReady.IsZero() && podConditionTrue(p, corev1.PodReady) {
			podReady = time.Now()
		}
		if domain, err = c.Dynamic.Resource(cdGVR).Namespace(metav1.NamespaceDefault).Get(ctx, cdObj.GetName(), metav1.GetOptions{}); err != nil {
			return false, err
		}
		if st, _, _ := unstructured.NestedString(domain.Object, "status", "status"); domainReady.IsZero() && st == "Ready" {
			domainReady = time.Now()
		}
		return !podReady.IsZero() && !domainReady.IsZero(), nil
	})
	if err != nil {
		var status any
		if domain != nil {
			status = domain.Object["status"]
		}
		t.Fatalf("%v\npod: %s\ndomain status: %v", err, harness.DescribeAPIPod(pod), status)
	}
	t.Logf("MEASURED %s: created -> pod Ready %s, domain Ready %s", cdObj.GetName(),
		podReady.Sub(start).Round(10*time.Millisecond), domainReady.Sub(start).Round(10*time.Millisecond))

	node := rack.node(pod.Spec.NodeName)
	if node == nil {
		t.Fatalf("pod %s on %q, no node of the rack", pod.Name, pod.Spec.NodeName)
	}
	if entries := harness.DomainStatusNodes(domain); len(entries) != 1 || entries[node.name]["status"] != "Ready" {
		t.Errorf("%s: status.nodes %v, want %s alone, Ready", cdObj.GetName(), domain.Object["status"], node.name)
	}
	if len(pod.Status.ResourceClaimStatuses) != 1 || pod.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
		t.Fatalf("pod %s: resource claim statuses %+v, want its one claim", pod.Name, pod.Status.ResourceClaimStatuses)
	}
	claim, err := cs.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Get(ctx, *pod.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a := claim.Status.Allocation; a == nil || len(a.Devices.Results) != 1 || a.Devices.Results[0].Driver != cdDriver ||
		a.Devices.Results[0].Pool != node.name || !strings.HasPrefix(a.Devices.Results[0].Device, "channel-") {
		t.Errorf("claim %s: allocation %+v, want one channel of %s", claim.Name, a, node.name)
	}

	// What Prepare gave the claim (its CDI spec), and what the node publishes.
	specPath := filepath.Join(node.env.NodeDirs().CDISpecs, "compute-domain-claim-"+string(claim.UID)+".json")
	given, err := cdiDeviceNodePaths(specPath)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, p := range given {
		if filepath.Dir(p) != cdChannelDir {
			t.Errorf("claim %s: CDI spec gives %s, not a channel", claim.Name, p)
		}
		want = append(want, filepath.Base(p))
	}
	if all {
		published := publishedChannels(ctx, t, c, node.name)
		if len(want) != published || published == 0 {
			t.Errorf("allocationMode All: the claim's CDI spec gives %d channels, %s publishes %d", len(want), node.name, published)
		}
		for _, ch := range []string{"channel0", "channel222", fmt.Sprintf("channel%d", published-1)} {
			if !slices.Contains(want, ch) {
				t.Errorf("allocationMode All: the claim's CDI spec lacks %s", ch)
			}
		}
	} else if len(want) != 1 {
		t.Errorf("allocationMode Single: the claim's CDI spec gives %v, want one channel", want)
	}

	// The container's own listing, as NVIDIA's bats reads it with kubectl logs.
	var listed map[string]string
	var log string
	if err := cdWait(ctx, "pod "+pod.Name+"'s listing of "+cdChannelDir, func() (bool, error) {
		if log, err = node.env.ContainerLog(pod, "ctr"); err != nil {
			return false, nil
		}
		listed = parseChannelListing(log)
		return len(listed) >= len(want), nil
	}); err != nil {
		t.Fatalf("%v; log so far:\n%s", err, log)
	}
	got := slices.Sorted(maps.Keys(listed))
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("pod %s lists %d channels %s, want the claim's %d %s", pod.Name, len(got), abbreviate(got), len(want), abbreviate(want))
	}
	for _, ch := range []string{want[0], want[len(want)-1]} {
		var st syscall.Stat_t
		host := filepath.Join(node.simRoot(), cdChannelDir, ch)
		if err := syscall.Stat(host, &st); err != nil {
			t.Fatalf("%s on the host: %v", ch, err)
		}
		if w := fmt.Sprintf("%d:%d", unixMajor(st.Rdev), unixMinor(st.Rdev)); listed[ch] != w {
			t.Errorf("pod %s: %s is %q in the container, %s (%s) on the host", pod.Name, ch, listed[ch], w, host)
		}
	}
	t.Logf("%s: pod %s on %s lists %s (%d channels, as its claim's CDI spec gives)", cdObj.GetName(), pod.Name, node.name, abbreviate(got), len(got))

	// kubectl delete -f, then nothing of the domain or the claim is left.
	deleted := time.Now()
	n.delete(ctx, t, objs)
	n.waitGone(ctx, t, objs)
	if err := cdWait(ctx, "claim "+claim.Name+" gone and its CDI spec removed", func() (bool, error) {
		if _, err := cs.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Get(ctx, claim.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return false, harness.IgnoreNotFound(err)
		}
		_, err := os.Stat(specPath)
		return errors.Is(err, os.ErrNotExist), nil
	}); err != nil {
		t.Fatal(err)
	}
	gone := waitDomainGone(ctx, t, c, rack.nodes, metav1.NamespaceDefault, cdObj.GetName(), uid)
	checkDomainLeftNothing(ctx, t, rack, uid)
	t.Logf("MEASURED %s: deleted -> pod, claim, domain, templates and daemon gone: %s (domain %s)", cdObj.GetName(),
		time.Since(deleted).Round(10*time.Millisecond), gone.Round(10*time.Millisecond))
}

// checkMPIJobManifest applies one of NVIDIA's nvbandwidth-test MPIJob files. No MPI operator runs here (the
// suite installs only a stand-in MPIJob CRD, testdata/mpijob-crd.yaml) and NVIDIA's nvbandwidth image (CUDA,
// sshd, mpirun on real NVLink) cannot run on a simulated GPU, so no worker or launcher pod is made: the test
// checks the part of the file that is gpu-agent's. Where the file has a ComputeDomain, the controller makes
// the workload ResourceClaimTemplate the file's workers name, in the file's namespace (one channel request of
// NVIDIA's class compute-domain-default-channel.nvidia.com with the domain's ComputeDomainChannelConfig), and
// the domain stays NotReady with no node, as no pod of it runs. The worker pod template, as the file writes
// it, is accepted by the API server (a dry-run create). The file without a ComputeDomain makes no template and
// no IMEX daemon. Deleting the file's objects leaves nothing.
func checkMPIJobManifest(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured) {
	c, cs := rack.c, rack.c.Client
	n := newNVIDIAObjects(rack)
	job := only(t, objs, "MPIJob")
	var cdObj *unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == "ComputeDomain" {
			cdObj = o
		}
	}
	created := n.create(ctx, t, objs)
	t.Cleanup(func() { n.delete(context.Background(), t, objs) })

	// The worker pod, as the MPI operator would make it from the file's template, is valid.
	tmpl, ok, err := unstructured.NestedMap(job.Object, "spec", "mpiReplicaSpecs", "Worker", "template")
	if err != nil || !ok {
		t.Fatalf("MPIJob %s: no spec.mpiReplicaSpecs.Worker.template (%v): has NVIDIA's file changed?", job.GetName(), err)
	}
	var worker corev1.Pod
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(tmpl, &worker); err != nil {
		t.Fatalf("MPIJob %s: worker template: %v", job.GetName(), err)
	}
	worker.Name = job.GetName() + "-worker-0"
	if _, err := cs.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &worker, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Errorf("MPIJob %s: its worker pod, as its template writes it, is refused (dry run): %v", job.GetName(), err)
	}
	var claimTemplates []string
	for _, rc := range worker.Spec.ResourceClaims {
		if rc.ResourceClaimTemplateName != nil {
			claimTemplates = append(claimTemplates, *rc.ResourceClaimTemplateName)
		}
	}

	if cdObj == nil {
		if len(claimTemplates) != 0 {
			t.Errorf("MPIJob %s without a ComputeDomain: its workers name claim templates %v", job.GetName(), claimTemplates)
		}
		l, err := c.Dynamic.Resource(cdGVR).List(ctx, metav1.ListOptions{})
		if err != nil || len(l.Items) != 0 {
			t.Errorf("ComputeDomains with the file applied: %d (%v), want none", len(l.Items), err)
		}
		tl, err := cs.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil || len(tl.Items) != 0 {
			t.Errorf("ResourceClaimTemplates in default with the file applied: %d (%v), want none", len(tl.Items), err)
		}
		n.delete(ctx, t, objs)
		n.waitGone(ctx, t, objs)
		checkDomainLeftNothing(ctx, t, rack, "")
		return
	}

	var uid string
	for _, o := range created {
		if o.GetKind() == "ComputeDomain" {
			uid = string(o.GetUID())
		}
	}
	name, _, _ := unstructured.NestedString(cdObj.Object, "spec", "channel", "resourceClaimTemplate", "name")
	if !slices.Equal(claimTemplates, []string{name}) {
		t.Errorf("MPIJob %s's workers name claim templates %v, the domain's is %s: has NVIDIA's file changed?", job.GetName(), claimTemplates, name)
	}
	start := time.Now()
	var rct *resourceapi.ResourceClaimTemplate
	var domain *unstructured.Unstructured
	if err := cdWait(ctx, "the workload template "+name+" and "+cdObj.GetName()+"'s status", func() (bool, error) {
		if rct, err = cs.ResourceV1().ResourceClaimTemplates(metav1.NamespaceDefault).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, harness.IgnoreNotFound(err)
		}
		if domain, err = c.Dynamic.Resource(cdGVR).Namespace(metav1.NamespaceDefault).Get(ctx, cdObj.GetName(), metav1.GetOptions{}); err != nil {
			return false, err
		}
		st, _, _ := unstructured.NestedString(domain.Object, "status", "status")
		return st != "", nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("MEASURED %s: created -> workload template %s and status: %s", cdObj.GetName(), name, time.Since(start).Round(10*time.Millisecond))
	if rct.Labels[cdDomainLabel] != uid {
		t.Errorf("template %s: label %s=%q, want the domain's UID %s", name, cdDomainLabel, rct.Labels[cdDomainLabel], uid)
	}
	reqs := rct.Spec.Spec.Devices.Requests
	if len(reqs) != 1 || reqs[0].Exactly == nil || reqs[0].Exactly.DeviceClassName != "compute-domain-default-channel.nvidia.com" {
		t.Errorf("template %s: requests %+v, want one of class compute-domain-default-channel.nvidia.com", name, reqs)
	}
	if cfg := rct.Spec.Spec.Devices.Config; len(cfg) != 1 || cfg[0].Opaque == nil || cfg[0].Opaque.Driver != cdDriver ||
		!strings.Contains(string(cfg[0].Opaque.Parameters.Raw), `"ComputeDomainChannelConfig"`) || !strings.Contains(string(cfg[0].Opaque.Parameters.Raw), uid) {
		t.Errorf("template %s: config %+v, want %s's ComputeDomainChannelConfig naming the domain %s", name, cfg, cdDriver, uid)
	}
	if st, _, _ := unstructured.NestedString(domain.Object, "status", "status"); st != "NotReady" || len(harness.DomainStatusNodes(domain)) != 0 {
		t.Errorf("%s with no pod of it running: status %v, want NotReady and no node", cdObj.GetName(), domain.Object["status"])
	}

	n.delete(ctx, t, objs)
	n.waitGone(ctx, t, objs)
	waitDomainGone(ctx, t, c, rack.nodes, metav1.NamespaceDefault, cdObj.GetName(), uid)
	checkDomainLeftNothing(ctx, t, rack, uid)
}

// checkIMEXTest1 applies the quickstart's imex-test1.yaml: four Deployments of two replicas whose pods share
// a ResourceClaim of DeviceClass imex.nvidia.com each and take a GPU claim each. imex.nvidia.com was the
// class of IMEX channels that NVIDIA's GPU driver published itself, from September 2024 until January 2025,
// before ComputeDomains; no tagged release of NVIDIA's chart has had it, and gpu-agent does not serve it
// (docs/compute-domains.md, "NVIDIA's manifests"). So, as on a cluster running NVIDIA's current driver, the
// file applies and every pod stays Pending, the scheduler naming the missing class, and no claim is
// allocated. Deleting the file (its Namespace first) leaves nothing.
func checkIMEXTest1(ctx context.Context, t *testing.T, rack *cdRack, objs []*unstructured.Unstructured) {
	cs := rack.c.Client
	n := newNVIDIAObjects(rack)
	ns := only(t, objs, "Namespace").GetName()
	replicas := 0
	for _, o := range objs {
		if o.GetKind() != "Deployment" {
			continue
		}
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &d); err != nil || d.Spec.Replicas == nil {
			t.Fatalf("Deployment %s: %v, replicas %v", o.GetName(), err, d.Spec.Replicas)
		}
		replicas += int(*d.Spec.Replicas)
	}
	if replicas == 0 {
		t.Fatal("the file has no Deployment with replicas: has NVIDIA's file changed?")
	}
	n.create(ctx, t, objs)
	t.Cleanup(func() { n.delete(context.Background(), t, objs) })
	const why = "device class imex.nvidia.com does not exist"
	var pods *corev1.PodList
	if err := cdWait(ctx, fmt.Sprintf("%d pods of %s unschedulable: %s", replicas, ns, why), func() (bool, error) {
		var err error
		if pods, err = cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err != nil {
			return false, err
		}
		if len(pods.Items) != replicas {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.Spec.NodeName != "" {
				return false, cdFatal(fmt.Errorf("pod %s was scheduled to %s: %s", p.Name, p.Spec.NodeName, harness.DescribeAPIPod(&p)))
			}
			if !podUnschedulableFor(&p, why) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		var states []string
		if pods != nil {
			for _, p := range pods.Items {
				states = append(states, harness.DescribeAPIPod(&p))
			}
		}
		t.Fatalf("%v\n%s", err, strings.Join(states, "\n"))
	}
	claims, err := cs.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range claims.Items {
		if cl.Status.Allocation != nil {
			t.Errorf("claim %s/%s allocated: %+v", ns, cl.Name, cl.Status.Allocation.Devices.Results)
		}
	}
	t.Logf("%s: %d pods Pending, %q; %d claims, none allocated", ns, len(pods.Items), why, len(claims.Items))
	n.delete(ctx, t, objs)
	n.waitGone(ctx, t, objs)
	checkDomainLeftNothing(ctx, t, rack, "")
}

// cdiDeviceNodePaths reads the container paths of the device nodes a CDI spec file gives (every device's and
// the spec's own edits).
func cdiDeviceNodePaths(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	type edits struct {
		DeviceNodes []struct {
			Path string `json:"path"`
		} `json:"deviceNodes"`
	}
	var spec struct {
		ContainerEdits edits `json:"containerEdits"`
		Devices        []struct {
			ContainerEdits edits `json:"containerEdits"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("CDI spec %s: %w", path, err)
	}
	all := []edits{spec.ContainerEdits}
	for _, d := range spec.Devices {
		all = append(all, d.ContainerEdits)
	}
	var out []string
	for _, e := range all {
		for _, n := range e.DeviceNodes {
			out = append(out, n.Path)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("CDI spec %s gives no device node", path)
	}
	return out, nil
}

// publishedChannels counts the channel devices node's compute-domain.nvidia.com slices publish.
func publishedChannels(ctx context.Context, t *testing.T, c *harness.Cluster, node string) int {
	t.Helper()
	l, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + node})
	if err != nil {
		t.Fatal(err)
	}
	count := 0
	for _, s := range l.Items {
		for _, d := range s.Spec.Devices {
			if s.Spec.Driver == cdDriver && strings.HasPrefix(d.Name, "channel-") {
				count++
			}
		}
	}
	return count
}

// channelLine is a character device named channel<N> in `ls -la` output (busybox's or GNU's):
// "crw-rw-rw-    1 root     root      234,   5 Jan  1 00:00 channel5".
var channelLine = regexp.MustCompile(`^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s(channel\d+)$`)

// parseChannelListing returns the channel character devices an `ls -la` of the channel directory lists, as
// major:minor by name.
func parseChannelListing(log string) map[string]string {
	out := map[string]string{}
	for line := range strings.Lines(log) {
		if m := channelLine.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			out[m[3]] = m[1] + ":" + m[2]
		}
	}
	return out
}

// podConditionTrue: p has condition typ, True.
func podConditionTrue(p *corev1.Pod, typ corev1.PodConditionType) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == typ {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// podUnschedulableFor: the scheduler found p unschedulable, saying why.
func podUnschedulableFor(p *corev1.Pod, why string) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled {
			return c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable && strings.Contains(c.Message, why)
		}
	}
	return false
}

// abbreviate shows a long list of channel names by its ends.
func abbreviate(names []string) string {
	if len(names) <= 4 {
		return strings.Join(names, " ")
	}
	return strings.Join(names[:2], " ") + " … " + strings.Join(names[len(names)-2:], " ") + " (" + strconv.Itoa(len(names)) + ")"
}
