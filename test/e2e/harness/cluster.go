package harness

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// ClusterConfig is what a Cluster needs from outside: the binaries (all built from the k8s.io/kubernetes
// version in go.mod, etcd from the etcd server module it requires) and the node.
type ClusterConfig struct {
	Kubelet, APIServer, ControllerManager, Scheduler, Etcd string
	Images                                                 []string // docker-archive tarballs to import (see BuildImages)
	NodeName                                               string
	NodeLabels                                             map[string]string // the kubelet's --node-labels
	// APIServerFeatureGates is the API server's --feature-gates ("": its defaults), e.g. to turn off a
	// beta check the API server has and older ones lack.
	APIServerFeatureGates string
	// Containerd2: see Config.Containerd2. The node layer then points the agent at the stand-in dev root.
	Containerd2 string
	LedgerPath  string
	// NodeIP is the kubelet's --node-ip ("": the kubelet picks the host's), added to lo for the run when no
	// interface has it (see NodeOptions.IP).
	NodeIP string
	// ControllerManagerArgs: see ControlPlaneConfig.
	ControllerManagerArgs []string
	// NodeLeaseDurationSeconds is every kubelet's nodeLeaseDurationSeconds (0: its default, 40), further
	// nodes' too; a kubelet renews its Lease every quarter of it. With kube-controller-manager's
	// --node-monitor-grace-period (ControllerManagerArgs) it sets how soon a node that stops is NotReady.
	NodeLeaseDurationSeconds int
	// PodNetwork gives every node of the Cluster (further ones too) a pod network of its own (see
	// podNetwork), so that pods which do not ask for the host network start: manifests applied as users write
	// them. Only with Containerd2. Without it such a pod fails at sandbox setup.
	PodNetwork bool
}

// Cluster is a one-node Kubernetes cluster started by this process from empty state: etcd, kube-apiserver,
// kube-controller-manager and kube-scheduler on loopback, and the Env's containerd and kubelet registered as
// its Node. gpu-agent is not started: it is installed the way users install it (Apply), and runs as the
// DaemonSet's pod.
type Cluster struct {
	*Env
	// Client and Dynamic act as a cluster admin (group system:masters).
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
	// APIPort is the API server's port on 127.0.0.1.
	APIPort int

	pki             *pki
	adminKubeconfig string
	nodeLease       int // ClusterConfig.NodeLeaseDurationSeconds
	podNetwork      bool
	further         int // further nodes added, to number their pod networks
}

// newPodNetwork is the pod network of the Cluster's node i (0: its first), or nil without PodNetwork.
func (c *Cluster) newPodNetwork(i int) (*podNetwork, error) {
	if !c.podNetwork {
		return nil, nil
	}
	return newPodNetwork(i)
}

// kubeletConfig is the KubeletConfiguration of e, a node of the Cluster.
func (c *Cluster) kubeletConfig(e *Env) string {
	conf := kubeletConfig(e.d, e.kubeletPort, e.healthzPort)
	if c.nodeLease > 0 {
		conf += fmt.Sprintf("nodeLeaseDurationSeconds: %d\n", c.nodeLease)
	}
	if e.further != nil {
		conf += fmt.Sprintf("cgroupRoot: %q\n", e.further.cgroupRoot)
	}
	return conf
}

// The Service range's first address is the "kubernetes" Service's; the serving certificate names it.
const (
	serviceCIDR      = "10.0.0.0/24"
	kubernetesSvcIP  = "10.0.0.1"
	saIssuer         = "https://kubernetes.default.svc.cluster.local"
	clusterStartTime = 4 * time.Minute
)

// StartCluster brings up etcd, the control plane, containerd (with the images imported) and the kubelet, and
// waits until the Node is Ready and the default ServiceAccount exists; the teardown is registered with
// t.Cleanup. It fails t on error.
func StartCluster(t testing.TB, cfg ClusterConfig) *Cluster {
	t.Helper()
	for name, bin := range map[string]string{"kubelet": cfg.Kubelet, "kube-apiserver": cfg.APIServer,
		"kube-controller-manager": cfg.ControllerManager, "kube-scheduler": cfg.Scheduler, "etcd": cfg.Etcd} {
		if bin == "" {
			t.Fatalf("e2e cluster: no %s binary given", name)
		}
	}
	e, err := newEnv(t, Config{Kubelet: cfg.Kubelet, Images: cfg.Images, NodeName: cfg.NodeName, LedgerPath: cfg.LedgerPath,
		Containerd2: cfg.Containerd2})
	if err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	t.Cleanup(e.teardown)
	c := &Cluster{Env: e, nodeLease: cfg.NodeLeaseDurationSeconds, podNetwork: cfg.PodNetwork}
	if e.podNet, err = c.newPodNetwork(0); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	if err := os.WriteFile(e.d.kubeletConfig, []byte(c.kubeletConfig(e)), 0o644); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterStartTime)
	defer cancel()
	start := time.Now()
	if err := c.startControlPlane(ctx, cfg); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	controlPlaneUp := time.Since(start)
	if err := e.setUpNetwork(); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	if cfg.NodeIP != "" {
		release, err := addNodeAddress(cfg.NodeIP)
		if err != nil {
			t.Fatalf("e2e cluster: %v", err)
		}
		t.Cleanup(func() {
			if err := release(); err != nil {
				t.Errorf("e2e cluster: %v", err)
			}
		})
	}
	if err := e.startContainerd(ctx); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	e.logContainerd(ctx)
	if e.kubeletArgs, err = c.kubeletArgs(cfg.NodeName, cfg.NodeIP, cfg.NodeLabels); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	if err := e.StartKubelet(ctx); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	if err := c.waitNodeReady(ctx, e.kubelet, cfg.NodeName); err != nil {
		t.Fatalf("e2e cluster: %v", err)
	}
	// The ServiceAccount admission plugin refuses pods until their namespace's "default" ServiceAccount
	// exists, which the controller manager creates shortly after it starts.
	if err := poll(ctx, 200*time.Millisecond, func() error {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	}); err != nil {
		t.Fatalf("e2e cluster: ServiceAccount default/default: %v", err)
	}
	t.Logf("e2e cluster in %s (kubeconfig %s): control plane up in %s, node %s Ready %s after start",
		e.RunDir(), c.adminKubeconfig, controlPlaneUp.Round(100*time.Millisecond), cfg.NodeName,
		time.Since(start).Round(100*time.Millisecond))
	return c
}

func (c *Cluster) apiURL() string { return fmt.Sprintf("https://127.0.0.1:%d", c.APIPort) }

// TokenClient is a client that authenticates with a bearer token (a service account's) instead of the
// admin's certificate, to act as that identity.
func (c *Cluster) TokenClient(token string) (kubernetes.Interface, error) {
	return kubernetes.NewForConfig(&rest.Config{
		Host:            c.apiURL(),
		TLSClientConfig: rest.TLSClientConfig{CAFile: c.pki.caFile()},
		BearerToken:     token,
		Timeout:         30 * time.Second,
	})
}

// AdminKubeconfig is a kubeconfig for a cluster admin (kubectl --kubeconfig works with it while the test runs).
func (c *Cluster) AdminKubeconfig() string { return c.adminKubeconfig }

// startControlPlane starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler (StartControlPlane)
// in the Env's run directory, its PIDs in the Env's ledger; the Env's teardown stops them last.
func (c *Cluster) startControlPlane(ctx context.Context, cfg ClusterConfig) error {
	e := c.Env
	cp, err := StartControlPlane(ctx, ControlPlaneConfig{
		APIServer: cfg.APIServer, Etcd: cfg.Etcd, ControllerManager: cfg.ControllerManager, Scheduler: cfg.Scheduler,
		Dir: e.d.run, LogDir: e.d.logs, AvoidPorts: []int{e.kubeletPort, e.healthzPort}, ledger: e.ledger,
		APIServerFeatureGates: cfg.APIServerFeatureGates, ControllerManagerArgs: cfg.ControllerManagerArgs,
	})
	if err != nil {
		return err
	}
	e.controlPlane = cp.procs
	c.Client, c.Dynamic, c.APIPort, c.pki, c.adminKubeconfig = cp.Client, cp.Dynamic, cp.APIPort, cp.pki, cp.adminKubeconfig
	return nil
}

// waitServing polls ready until it succeeds, giving up at once if p exits.
func waitServing(ctx context.Context, p *Process, ready func() error) error {
	err := poll(ctx, 200*time.Millisecond, func() error {
		if done, werr := p.Exited(); done {
			return stop(fmt.Errorf("%s exited: %v (see %s)", p.Name, werr, p.LogPath))
		}
		return ready()
	})
	if err != nil {
		return fmt.Errorf("%s: not serving: %w", p.Name, err)
	}
	return nil
}

// httpsOKInsecure GETs url from a component that serves a self-signed certificate on loopback.
func httpsOKInsecure(ctx context.Context, url string) error {
	return httpsGetInsecure(ctx, url, 2*time.Second, io.Discard)
}

// httpsGetInsecure GETs url from a component that serves a self-signed certificate on loopback, within limit,
// and copies the body of a 200 answer to w.
func httpsGetInsecure(ctx context.Context, url string, limit time.Duration, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	_, err = io.Copy(w, resp.Body)
	return err
}

// waitNodeReady waits until the kubelet's Node is Ready and carries no NoSchedule taint (the node lifecycle
// controller lifts node.kubernetes.io/not-ready a moment after Ready).
func (c *Cluster) waitNodeReady(ctx context.Context, kubelet *Process, name string) error {
	err := poll(ctx, 250*time.Millisecond, func() error {
		if done, werr := kubelet.Exited(); done {
			return stop(fmt.Errorf("kubelet exited: %v (see %s)", werr, kubelet.LogPath))
		}
		n, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ready := false
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status != corev1.ConditionTrue {
					return fmt.Errorf("node %s: Ready=%s: %s", n.Name, cond.Status, cond.Message)
				}
				ready = true
			}
		}
		if !ready {
			return fmt.Errorf("node %s: no Ready condition yet", n.Name)
		}
		for _, taint := range n.Spec.Taints {
			if taint.Effect == corev1.TaintEffectNoSchedule {
				return fmt.Errorf("node %s: tainted %s", n.Name, taint.ToString())
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("node %s: %w", name, err)
	}
	return nil
}

// Node returns the cluster's Node.
func (c *Cluster) Node(ctx context.Context) (*corev1.Node, error) {
	return c.Client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{})
}

// NodeName is the kubelet's Node name.
func (c *Cluster) NodeName() string { return c.cfg.NodeName }

// WaitNodeAllocatable waits until the Node's status.allocatable shows n of resource.
func (c *Cluster) WaitNodeAllocatable(ctx context.Context, resource string, n int64) error {
	err := poll(ctx, 200*time.Millisecond, func() error {
		node, err := c.Node(ctx)
		if err != nil {
			return err
		}
		q, ok := node.Status.Allocatable[corev1.ResourceName(resource)]
		if !ok || q.Value() != n {
			return fmt.Errorf("node %s: allocatable %s = %v, want %d", node.Name, resource, q.String(), n)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("allocatable %s: %w", resource, err)
	}
	return nil
}

// WaitPodsRunning waits until exactly n pods in namespace match selector and each one's containers run, and
// returns them sorted by name; a pod that ends or is stuck unscheduled shows in the error.
func (c *Cluster) WaitPodsRunning(ctx context.Context, namespace, selector string, n int) ([]corev1.Pod, error) {
	var pods []corev1.Pod
	err := poll(ctx, 250*time.Millisecond, func() error {
		if done, werr := c.kubelet.Exited(); done {
			return stop(fmt.Errorf("kubelet exited: %v", werr))
		}
		list, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		pods = list.Items
		sort.Slice(pods, func(i, j int) bool { return pods[i].Name < pods[j].Name })
		var notYet []string
		for i := range pods {
			p := &pods[i]
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				return stop(fmt.Errorf("pod %s/%s ended: %s", namespace, p.Name, DescribeAPIPod(p)))
			}
			if !PodRunning(p) {
				notYet = append(notYet, p.Name+": "+DescribeAPIPod(p))
			}
		}
		if len(pods) != n || len(notYet) > 0 {
			return fmt.Errorf("%d pods match %q, want %d running; not running: %v", len(pods), selector, n, notYet)
		}
		return nil
	})
	if err != nil {
		return pods, fmt.Errorf("pods %s in %s: %w", selector, namespace, err)
	}
	return pods, nil
}

// PodRunning reports whether p runs with every container started (false for nil).
func PodRunning(p *corev1.Pod) bool {
	if p == nil || p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != len(p.Spec.Containers) {
		return false
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Running == nil {
			return false
		}
	}
	return true
}

// DescribeAPIPod is DescribePod with the scheduling state the API server knows (node, PodScheduled).
func DescribeAPIPod(p *corev1.Pod) string {
	if p == nil {
		return "<none>"
	}
	s := DescribePod(p)
	if p.Spec.NodeName != "" {
		s += " node=" + p.Spec.NodeName
	}
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodScheduled && cond.Status != corev1.ConditionTrue {
			s += fmt.Sprintf(" unscheduled: %s %q", cond.Reason, cond.Message)
		}
	}
	return s
}

// PodContainerEnv returns the environment that the API pod's container "main" printed into its log (see
// GPUPodTemplate); the pod must run on this Env's node.
func (e *Env) PodContainerEnv(ctx context.Context, p *corev1.Pod) (map[string]string, error) {
	return e.PodContainerEnvOf(ctx, p, "main")
}

// PodContainerEnvOf is PodContainerEnv for the named container, which runs GPUPodTemplate's command too.
func (e *Env) PodContainerEnvOf(ctx context.Context, p *corev1.Pod, container string) (map[string]string, error) {
	env, err := e.containerEnv(ctx, p.Namespace, p.Name, string(p.UID), container)
	if err != nil {
		return nil, fmt.Errorf("pod %s/%s: container %s env: %w", p.Namespace, p.Name, container, err)
	}
	return env, nil
}

// PodDevicesOf returns, from the kubelet's pod-resources List, the device IDs of resource it assigned to the
// API pod.
func (e *Env) PodDevicesOf(ctx context.Context, p *corev1.Pod, resource string) ([]string, error) {
	return e.podDevices(ctx, p.Namespace, p.Name, resource)
}

// GPUPodTemplate is the pod template of a workload whose single container, "main", requests gpus of
// resource, prints its environment, then sleeps (PodContainerEnv reads it). It uses the host network and the
// imported busybox image.
func GPUPodTemplate(labels map[string]string, resource string, gpus int64) corev1.PodTemplateSpec {
	limits := corev1.ResourceList{corev1.ResourceName(resource): *apiresource.NewQuantity(gpus, apiresource.DecimalSI)}
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: labels},
		Spec:       envDumpPodSpec(limits, corev1.RestartPolicyAlways),
	}
}

// ImportImage imports a docker-archive tarball into the node's containerd (the CRI's namespace), so that a
// pod whose imagePullPolicy is IfNotPresent or Never finds it.
func (c *Cluster) ImportImage(ctx context.Context, tarball string) error {
	if out, err := c.ctr(ctx, "images", "import", "--snapshotter", "overlayfs", tarball); err != nil {
		return fmt.Errorf("containerd: import %s: %w: %s", tarball, err, out)
	}
	return nil
}

// WaitPodMatching waits until one pod in namespace matches selector and cond holds for it, and returns it;
// on timeout the error shows the pods' last status.
func (c *Cluster) WaitPodMatching(ctx context.Context, namespace, selector, what string, cond func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var found *corev1.Pod
	err := poll(ctx, 250*time.Millisecond, func() error {
		list, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		if len(list.Items) != 1 {
			return fmt.Errorf("%d pods match %q, want 1", len(list.Items), selector)
		}
		p := &list.Items[0]
		if !cond(p) {
			return fmt.Errorf("pod %s not yet %s: %s", p.Name, what, DescribeAPIPod(p))
		}
		found = p
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("pods %s in %s: %w", selector, namespace, err)
	}
	return found, nil
}
