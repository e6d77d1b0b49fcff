//go:build e2e

// The cluster scenarios: a real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
// built from the same k8s.io/kubernetes as the kubelet) with the kubelet registered as its one Node, and
// gpu-agent installed the way users install it: deploy/manifests through kustomize, or the Helm chart, its
// image assembled from the Dockerfile's recipe and imported into containerd. Workloads are Deployments that
// the real scheduler places.
package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// gpuNodeLabels are the labels NVIDIA GPU feature discovery puts on a GPU node; the DaemonSet selects them.
var gpuNodeLabels = map[string]string{"nvidia.com/gpu.present": "true"}

// clusterStepTimeout bounds one cluster step (an install coming up, a Deployment's pods running) on a busy
// 2-core machine; the kubelet reports allocatable on its 10 s node status sync.
const clusterStepTimeout = 3 * time.Minute

type clusterSuite struct {
	apiserver, controllerManager, scheduler, etcd string
	agentImage                                    harness.ImageSpec
}

var (
	clusterOnce sync.Once
	clusterIn   clusterSuite
	clusterErr  error
)

// repoRoot is the gpu-agent repository (this file is test/e2e/cluster_test.go).
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// clusterInputs reads the control plane binaries run.sh built, and assembles the gpu-agent image once.
func clusterInputs(t *testing.T) clusterSuite {
	t.Helper()
	clusterOnce.Do(func() {
		for _, v := range []struct {
			dst *string
			env string
		}{
			{&clusterIn.apiserver, "E2E_KUBE_APISERVER"},
			{&clusterIn.controllerManager, "E2E_KUBE_CONTROLLER_MANAGER"},
			{&clusterIn.scheduler, "E2E_KUBE_SCHEDULER"},
			{&clusterIn.etcd, "E2E_ETCD"},
		} {
			*v.dst = os.Getenv(v.env)
			if *v.dst == "" {
				clusterErr = fmt.Errorf("%s is not set; run ./run.sh (make e2e)", v.env)
				return
			}
			if _, err := os.Stat(*v.dst); err != nil {
				clusterErr = fmt.Errorf("%s: %w", v.env, err)
				return
			}
		}
		clusterIn.agentImage, clusterErr = harness.AgentImage(filepath.Join(repoRoot(), "Dockerfile"), inputs.agent)
	})
	if clusterErr != nil {
		t.Fatalf("e2e cluster: cannot run: %v", clusterErr)
	}
	return clusterIn
}

func startCluster(t *testing.T) *harness.Cluster {
	t.Helper()
	return startClusterOn(t, "")
}

// startClusterOn starts the cluster with its node on the containerd 2.x build in containerd2 ("": Debian's 1.6).
func startClusterOn(t *testing.T, containerd2 string) *harness.Cluster {
	t.Helper()
	return startClusterWith(t, containerd2, "")
}

// startClusterWith is startClusterOn with the API server's --feature-gates set to gates ("": its defaults).
func startClusterWith(t *testing.T, containerd2, gates string) *harness.Cluster {
	t.Helper()
	in := clusterInputs(t)
	return harness.StartCluster(t, harness.ClusterConfig{
		Kubelet:               inputs.kubelet,
		APIServer:             in.apiserver,
		ControllerManager:     in.controllerManager,
		Scheduler:             in.scheduler,
		Etcd:                  in.etcd,
		Images:                inputs.images,
		NodeName:              nodeName,
		NodeLabels:            gpuNodeLabels,
		LedgerPath:            inputs.ledger,
		Containerd2:           containerd2,
		APIServerFeatureGates: gates,
	})
}

func clusterCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterStepTimeout)
	t.Cleanup(cancel)
	return ctx
}

// installAgent imports the gpu-agent image under the name the install's DaemonSet uses, applies objs, and
// waits until the DaemonSet's pod is ready and the Node offers the simulated node's GPUs; it logs how long
// each step took from the pod's creation.
func installAgent(t *testing.T, c *harness.Cluster, layer harness.NodeLayer, objs []*unstructured.Unstructured) {
	t.Helper()
	ds, err := harness.AgentDaemonSet(objs)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range ds.Spec.Template.Spec.NodeSelector {
		if gpuNodeLabels[k] != v {
			t.Fatalf("DaemonSet %s selects nodes by %s=%s, which the e2e node (labels %v) lacks", ds.Name, k, v, gpuNodeLabels)
		}
	}
	ctr := ds.Spec.Template.Spec.Containers[0]
	if ctr.ImagePullPolicy == corev1.PullAlways {
		t.Fatalf("DaemonSet %s: imagePullPolicy Always; the e2e node has no registry to pull %s from", ds.Name, ctr.Image)
	}
	spec := clusterInputs(t).agentImage
	spec.Ref = ctr.Image
	tarball := filepath.Join(c.RunDir(), "gpu-agent-image.tar")
	if err := harness.WriteDockerArchive(tarball, spec); err != nil {
		t.Fatal(err)
	}
	ctx := clusterCtx(t)
	if err := c.ImportImage(ctx, tarball); err != nil {
		t.Fatal(err)
	}
	t.Logf("image %s imported: the Dockerfile's last stage (entrypoint %v, cmd %v, user %q) with %d files",
		spec.Ref, spec.Entrypoint, spec.Cmd, spec.User, len(spec.Files))

	watch, stopWatch := context.WithCancel(context.Background())
	t.Cleanup(stopWatch)
	start := c.WatchAgentStart(watch, ds.Namespace, labels.SelectorFromSet(ds.Spec.Selector.MatchLabels).String(),
		gpuResource, nodeGPUs)
	applied := time.Now()
	if err := c.Apply(ctx, objs); err != nil {
		t.Fatal(err)
	}
	t.Logf("applied %d objects in %s", len(objs), time.Since(applied).Round(time.Millisecond))
	for _, m := range []string{harness.PodCreated, harness.PodScheduled, harness.ContainerRunning} {
		if err := start.Wait(ctx, m); err != nil {
			dumpPods(t, c, ds.Namespace)
			t.Fatal(err)
		}
	}
	// Between the two: the kubelet's device manager has the devices (pod-resources) before its next node
	// status sync (every 10 s) reports them in the Node's allocatable.
	if _, err := c.WaitAllocatable(ctx, gpuResource, nodeGPUs); err != nil {
		t.Fatal(err)
	}
	kubeletOffers := time.Now()
	for _, m := range []string{harness.PodReady, harness.NodeAllocatable} {
		if err := start.Wait(ctx, m); err != nil {
			dumpPods(t, c, ds.Namespace)
			t.Fatal(err)
		}
	}
	created, _ := start.At(harness.PodCreated)
	d, _ := start.Since(harness.NodeAllocatable)
	t.Logf("agent start: %s; kubelet offers the devices (pod-resources) +%s", start, kubeletOffers.Sub(created).Round(10*time.Millisecond))
	t.Logf("MEASURED agent pod created -> node allocatable %s=%d: %s", gpuResource, nodeGPUs, d.Round(10*time.Millisecond))

	// The agent in the pod is the one that serves: its /readyz on the host network, at the layer's port.
	url := fmt.Sprintf("http://127.0.0.1:%d/readyz", layer.MetricsPort)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(url)
	if err != nil {
		t.Fatalf("agent pod: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("agent pod: GET %s: %s: %s", url, resp.Status, body)
	}

	// The DaemonSet controller counts the ready pod on its own schedule, after the pod's status says so.
	var got *appsv1.DaemonSet
	eventually(t, "the DaemonSet counts its pod ready", func() bool {
		got, err = c.Client.AppsV1().DaemonSets(ds.Namespace).Get(ctx, ds.Name, metav1.GetOptions{})
		return err == nil && got.Status.DesiredNumberScheduled == 1 && got.Status.NumberReady == 1
	})
}

// dumpPods logs every pod in namespace with its status, to explain a failed wait.
func dumpPods(t *testing.T, c *harness.Cluster, namespace string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Logf("pods in %s: %v", namespace, err)
		return
	}
	if len(pods.Items) == 0 {
		t.Logf("no pods in %s", namespace)
	}
	for i := range pods.Items {
		t.Logf("pod %s/%s: %s", namespace, pods.Items[i].Name, harness.DescribeAPIPod(&pods.Items[i]))
	}
	events, err := c.Client.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{})
	if err == nil {
		for _, ev := range events.Items {
			t.Logf("event %s %s/%s: %s %s", ev.Type, ev.InvolvedObject.Kind, ev.InvolvedObject.Name, ev.Reason, ev.Message)
		}
	}
}

// checkNodeGPUs checks that the Node's capacity and allocatable both show the simulated node's GPUs.
func checkNodeGPUs(t *testing.T, c *harness.Cluster) {
	t.Helper()
	ctx := clusterCtx(t)
	if err := c.WaitNodeAllocatable(ctx, gpuResource, nodeGPUs); err != nil {
		t.Fatal(err)
	}
	node, err := c.Node(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if q := node.Status.Capacity[gpuResource]; q.Value() != nodeGPUs {
		t.Fatalf("node %s: capacity %s = %s, want %d", node.Name, gpuResource, q.String(), nodeGPUs)
	}
}

// gpuDeployment is a Deployment of busybox pods that each request gpus GPUs (see harness.GPUPodTemplate).
func gpuDeployment(name string, replicas int32, gpus int64) *appsv1.Deployment {
	l := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: l},
			Template: harness.GPUPodTemplate(l, gpuResource, gpus),
		},
	}
}

// podGPUs checks that the scheduler placed pod on the node and returns the sorted GPU UUIDs its container
// got in NVIDIA_VISIBLE_DEVICES, after checking that they are want distinct GPUs of the node, and that
// pod-resources List agrees.
func podGPUs(t *testing.T, c *harness.Cluster, p *corev1.Pod, want int, uuids []string) []string {
	t.Helper()
	if p.Spec.NodeName != c.NodeName() || p.Spec.SchedulerName != corev1.DefaultSchedulerName {
		t.Fatalf("pod %s: node %q by scheduler %q; want %q by %q", p.Name, p.Spec.NodeName, p.Spec.SchedulerName,
			c.NodeName(), corev1.DefaultSchedulerName)
	}
	ctx := clusterCtx(t)
	env, err := c.PodContainerEnv(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	v, ok := env["NVIDIA_VISIBLE_DEVICES"]
	if !ok {
		t.Fatalf("pod %s: container has no NVIDIA_VISIBLE_DEVICES; env: %v", p.Name, env)
	}
	got := strings.Split(v, ",")
	slices.Sort(got)
	if len(slices.Compact(slices.Clone(got))) != want || len(got) != want || !subset(got, uuids) {
		t.Fatalf("pod %s: NVIDIA_VISIBLE_DEVICES=%s, want %d distinct GPUs of %v", p.Name, v, want, uuids)
	}
	listed, err := c.PodDevicesOf(ctx, p, gpuResource)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, listed) {
		t.Fatalf("pod %s: container got %v, pod-resources List says %v", p.Name, got, listed)
	}
	t.Logf("pod %s (scheduled to %s): NVIDIA_VISIBLE_DEVICES=%s", p.Name, p.Spec.NodeName, v)
	return got
}

// TestClusterDaemonSetServesGPUs installs deploy/manifests (kustomize, with the sim overlay and the node
// layer), checks that the Node offers 8 GPUs, and that Deployment pods the scheduler places get disjoint GPUs.
func TestClusterDaemonSetServesGPUs(t *testing.T) {
	uuids := nodeUUIDs(t)
	c := startCluster(t)
	layer, err := c.NodeLayer()
	if err != nil {
		t.Fatal(err)
	}
	objs, err := c.BuildManifests(filepath.Join("testdata", "sim-overlay"), layer)
	if err != nil {
		t.Fatal(err)
	}
	// The sim overlay adds the opt-in servicemonitor component; a stand-in CRD lets it apply unchanged.
	crd, err := harness.ReadObjects(filepath.Join("testdata", "servicemonitor-crd.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	installAgent(t, c, layer, append(crd, objs...))
	checkNodeGPUs(t, c)

	ctx := clusterCtx(t)
	deps := c.Client.AppsV1().Deployments("default")
	created := time.Now()
	if _, err := deps.Create(ctx, gpuDeployment("two-gpus", 1, 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=two-gpus", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	t.Logf("MEASURED Deployment created -> its pod running: %s", time.Since(created).Round(10*time.Millisecond))
	firstPod := pods[0]
	first := podGPUs(t, c, &firstPod, 2, uuids)

	// A second replica: the scheduler places it by the Node's remaining allocatable GPUs, the kubelet gives
	// it two others.
	if _, err := deps.UpdateScale(ctx, "two-gpus", &autoscalingv1.Scale{
		ObjectMeta: metav1.ObjectMeta{Name: "two-gpus", Namespace: "default"},
		Spec:       autoscalingv1.ScaleSpec{Replicas: 2},
	}, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err = c.WaitPodsRunning(ctx, "default", "app=two-gpus", 2)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	i := slices.IndexFunc(pods, func(p corev1.Pod) bool { return p.UID != firstPod.UID })
	if i < 0 || pods[1-i].UID != firstPod.UID {
		t.Fatalf("after scaling to 2, pods %s and %s; want %s (uid %s) and a new one", pods[0].Name, pods[1].Name, firstPod.Name, firstPod.UID)
	}
	second := podGPUs(t, c, &pods[i], 2, uuids)
	if both := overlap(first, second); len(both) > 0 {
		t.Fatalf("the two pods got %v and %v, sharing %v", first, second, both)
	}

	// Four GPUs are left: the scheduler keeps a pod that asks for five pending, for that reason.
	if _, err := deps.Create(ctx, gpuDeployment("five-gpus", 1, 5), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	last, err := c.WaitPodMatching(ctx, "default", "app=five-gpus", "unschedulable", func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
				return strings.Contains(cond.Message, "Insufficient "+gpuResource)
			}
		}
		return false
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod %s pending: %s", last.Name, harness.DescribeAPIPod(last))
}

// TestClusterHelmChart installs the Helm chart (rendered by helm's engine, the sim backend chosen by values,
// the node layer as a post-renderer), checks that the Node offers 8 GPUs and that a scheduled pod gets two.
func TestClusterHelmChart(t *testing.T) {
	uuids := nodeUUIDs(t)
	c := startCluster(t)
	layer, err := c.NodeLayer()
	if err != nil {
		t.Fatal(err)
	}
	objs, err := c.RenderChart(clusterCtx(t), filepath.Join(repoRoot(), "deploy", "helm", "gpu-agent"), "gpu-agent", "gpu-agent",
		layer, filepath.Join("testdata", "helm-values-sim.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	installAgent(t, c, layer, objs)
	checkNodeGPUs(t, c)

	ctx := clusterCtx(t)
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("chart-two-gpus", 1, 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=chart-two-gpus", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	podGPUs(t, c, &pods[0], 2, uuids)
}
