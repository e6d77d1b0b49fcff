package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// IgnoreNotFound is err, or nil where err says the object is not there.
func IgnoreNotFound(err error) error {
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// ControlPlaneConfig is what a ControlPlane needs: the binaries and where its files go. Only etcd and the API
// server are required; the controller manager and the scheduler start when their binary is given (the
// scheduler can also start later, StartScheduler), so a program that needs no controller (the fleet
// benchmark, which creates ResourceClaims itself) does not pay for one.
type ControlPlaneConfig struct {
	APIServer, Etcd              string
	ControllerManager, Scheduler string
	// Dir holds the PKI and etcd's data; LogDir each component's log (<name>.log).
	Dir, LogDir string
	// AvoidPorts are ports handed out earlier whose owner has not bound them yet (see freePorts).
	AvoidPorts []int
	// SchedulerClientQPS, when above 0, runs the scheduler from a KubeSchedulerConfiguration file whose
	// client QPS and burst are this (its --kube-api-qps flags are deprecated, and ignored once a config file
	// is given): the default 50 would make a benchmark measure the scheduler's rate limiter.
	SchedulerClientQPS int
	// APIServerFeatureGates is the API server's --feature-gates ("": its defaults), e.g. to turn off a
	// beta check the API server has and older ones lack.
	APIServerFeatureGates string
	// ControllerManagerControllers is kube-controller-manager's --controllers ("": "*", every default
	// controller). A control plane whose Nodes have no kubelet turns the node lifecycle controller off
	// ("*,-node-lifecycle-controller"): with no heartbeat, it would mark them NotReady and taint them.
	ControllerManagerControllers string
	// ControllerManagerArgs are added to kube-controller-manager's flags (later flags win), e.g.
	// --node-monitor-grace-period for a test that waits for a failed node to turn NotReady.
	ControllerManagerArgs []string

	ledger *ledger // the Env's, when a Cluster starts it; nil: PIDs are not recorded
}

// ControlPlane is etcd, kube-apiserver and, as configured, kube-controller-manager and kube-scheduler, each on
// a free loopback port, with a PKI generated for the run (see README, The cluster environment).
type ControlPlane struct {
	// Client and Dynamic act as a cluster admin (group system:masters); RESTConfig is their config, for
	// clients of other settings.
	Client     kubernetes.Interface
	Dynamic    dynamic.Interface
	RESTConfig *rest.Config
	// APIPort is the API server's port on 127.0.0.1.
	APIPort int
	// Etcd, APIServer, ControllerManager and Scheduler are the processes (nil when not started), for their
	// PIDs.
	Etcd, APIServer, ControllerManager, Scheduler *Process

	cfg             ControlPlaneConfig
	pki             *pki
	kubeconfigs     map[string]string // by component identity: admin, kube-controller-manager, kube-scheduler
	schedPort       int
	procs           []*Process // in start order
	adminKubeconfig string
}

// StartControlPlane generates the PKI and starts etcd, kube-apiserver and the components cfg names, waiting
// for each to serve. On error it stops what it started.
func StartControlPlane(ctx context.Context, cfg ControlPlaneConfig) (*ControlPlane, error) {
	cp := &ControlPlane{cfg: cfg}
	if err := cp.start(ctx); err != nil {
		return nil, errors.Join(err, cp.Stop(5*time.Second))
	}
	return cp, nil
}

func (cp *ControlPlane) start(ctx context.Context) error {
	cfg := cp.cfg
	if cfg.APIServer == "" || cfg.Etcd == "" {
		return errors.New("control plane: the kube-apiserver and etcd binaries are required")
	}
	if err := os.MkdirAll(cfg.LogDir, 0o755); err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	ports, err := freePorts(5, cfg.AvoidPorts...)
	if err != nil {
		return err
	}
	etcdClient, etcdPeer, kcmPort := ports[0], ports[1], ports[3]
	cp.APIPort, cp.schedPort = ports[2], ports[4]
	if cp.pki, err = newPKI(filepath.Join(cfg.Dir, "pki"), "gpu-agent-e2e-ca"); err != nil {
		return err
	}
	serving, err := cp.pki.issue("kube-apiserver", "kube-apiserver", nil, true,
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(kubernetesSvcIP)},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
	if err != nil {
		return err
	}
	saKey, err := cp.pki.serviceAccountKey()
	if err != nil {
		return err
	}
	// The aggregation layer's front proxy has a CA of its own, as kubeadm sets it up: the API server publishes
	// it (configmap kube-system/extension-apiserver-authentication), and the controller manager and the
	// scheduler, which authenticate their own HTTPS clients through the API server, read it from there.
	frontProxy, err := newPKI(filepath.Join(cfg.Dir, "pki", "front-proxy"), "gpu-agent-e2e-front-proxy-ca")
	if err != nil {
		return err
	}
	proxyClient, err := frontProxy.issue("front-proxy-client", "front-proxy-client", nil, false, nil, nil)
	if err != nil {
		return err
	}
	// Each component has its own identity; the bootstrap RBAC policy the API server creates grants them what
	// they need (system:kube-controller-manager, system:kube-scheduler).
	cp.kubeconfigs = map[string]string{}
	for _, id := range []struct{ name, cn, group string }{
		{"admin", "e2e-admin", "system:masters"},
		{"kube-controller-manager", "system:kube-controller-manager", ""},
		{"kube-scheduler", "system:kube-scheduler", ""},
	} {
		var groups []string
		if id.group != "" {
			groups = []string{id.group}
		}
		cred, err := cp.pki.issue(id.name, id.cn, groups, false, nil, nil)
		if err != nil {
			return err
		}
		if cp.kubeconfigs[id.name], err = cp.pki.kubeconfig(id.name, cp.apiURL(), cred); err != nil {
			return err
		}
	}
	cp.adminKubeconfig = cp.kubeconfigs["admin"]

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	if cp.Etcd, err = cp.startComponent("etcd", cfg.Etcd,
		"--name", "e2e",
		"--data-dir", filepath.Join(cfg.Dir, "etcd"),
		"--listen-client-urls", etcdURL,
		"--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL,
		"--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "e2e="+peerURL,
		// The data lives only as long as the run; fsync would only make a busy shared disk slower.
		"--unsafe-no-fsync",
		"--log-level", "warn"); err != nil {
		return err
	}
	if err := waitServing(ctx, cp.Etcd, func() error { return HTTPOK(ctx, etcdURL+"/health") }); err != nil {
		return err
	}

	apiserverArgs := []string{
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1",
		"--secure-port", fmt.Sprint(cp.APIPort),
		// The "kubernetes" Service's endpoints would name this address, and an endpoint may not be loopback:
		// the reconciler is off (no kube-proxy here could route the Service anyway; in-cluster clients are
		// pointed at 127.0.0.1 instead, see InstallPatches).
		"--advertise-address", "127.0.0.1",
		"--endpoint-reconciler-type", "none",
		"--tls-cert-file", serving.CertFile,
		"--tls-private-key-file", serving.KeyFile,
		"--client-ca-file", cp.pki.caFile(),
		"--requestheader-client-ca-file", frontProxy.caFile(),
		"--requestheader-allowed-names", "front-proxy-client",
		"--requestheader-username-headers", "X-Remote-User",
		"--requestheader-group-headers", "X-Remote-Group",
		"--requestheader-extra-headers-prefix", "X-Remote-Extra-",
		"--proxy-client-cert-file", proxyClient.CertFile,
		"--proxy-client-key-file", proxyClient.KeyFile,
		"--service-account-issuer", saIssuer,
		"--service-account-key-file", saKey,
		"--service-account-signing-key-file", saKey,
		"--service-cluster-ip-range", serviceCIDR,
		"--authorization-mode", "Node,RBAC",
		"--enable-admission-plugins", "NodeRestriction",
		"--allow-privileged=true",
		"--cert-dir", filepath.Join(cfg.Dir, "pki", "kube-apiserver-generated"),
		"--v", "1",
	}
	if cfg.APIServerFeatureGates != "" {
		apiserverArgs = append(apiserverArgs, "--feature-gates", cfg.APIServerFeatureGates)
	}
	if cp.APIServer, err = cp.startComponent("kube-apiserver", cfg.APIServer, apiserverArgs...); err != nil {
		return err
	}
	cp.RESTConfig = &rest.Config{
		Host: cp.apiURL(),
		TLSClientConfig: rest.TLSClientConfig{
			CAFile:   cp.pki.caFile(),
			CertFile: filepath.Join(cp.pki.dir, "admin.crt"),
			KeyFile:  filepath.Join(cp.pki.dir, "admin.key"),
		},
		QPS: 50, Burst: 100, Timeout: 30 * time.Second,
	}
	if cp.Client, err = kubernetes.NewForConfig(cp.RESTConfig); err != nil {
		return err
	}
	if cp.Dynamic, err = dynamic.NewForConfig(cp.RESTConfig); err != nil {
		return err
	}
	// /readyz turns 200 once the post-start hooks are done: bootstrap RBAC, the system priority classes.
	if err := waitServing(ctx, cp.APIServer, func() error {
		body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return fmt.Errorf("/readyz: %w: %s", err, body)
		}
		return nil
	}); err != nil {
		return err
	}

	// The controller manager and the scheduler start together and are waited for together: each takes a few
	// seconds to serve, on two cores.
	type component struct {
		p    *Process
		port int
	}
	var waits []component
	if cfg.ControllerManager != "" {
		controllers := cfg.ControllerManagerControllers
		if controllers == "" {
			controllers = "*"
		}
		kcmArgs := []string{
			"--kubeconfig", cp.kubeconfigs["kube-controller-manager"],
			"--authentication-kubeconfig", cp.kubeconfigs["kube-controller-manager"],
			"--authorization-kubeconfig", cp.kubeconfigs["kube-controller-manager"],
			"--bind-address", "127.0.0.1",
			"--secure-port", fmt.Sprint(kcmPort),
			"--leader-elect=false",
			// Every controller the default set runs (daemonset, deployment, replicaset, serviceaccount,
			// serviceaccount-token, namespace, garbage collector, node lifecycle, root CA publisher, ...), each
			// with its own service account, as kubeadm sets it up.
			"--controllers", controllers,
			"--use-service-account-credentials=true",
			"--service-account-private-key-file", saKey,
			"--root-ca-file", cp.pki.caFile(),
			"--v", "1",
		}
		if cp.ControllerManager, err = cp.startComponent("kube-controller-manager", cfg.ControllerManager,
			append(kcmArgs, cfg.ControllerManagerArgs...)...); err != nil {
			return err
		}
		waits = append(waits, component{cp.ControllerManager, kcmPort})
	}
	if cfg.Scheduler != "" {
		if err := cp.spawnScheduler(cfg.Scheduler); err != nil {
			return err
		}
		waits = append(waits, component{cp.Scheduler, cp.schedPort})
	}
	for _, s := range waits {
		url := fmt.Sprintf("https://127.0.0.1:%d/healthz", s.port)
		if err := waitServing(ctx, s.p, func() error { return httpsOKInsecure(ctx, url) }); err != nil {
			return err
		}
	}
	return nil
}

// StartScheduler starts kube-scheduler from bin, when the config gave none, and waits until it serves
// /healthz. A benchmark starts it after creating its Nodes and ResourceSlices, so that its informers list
// them at once instead of the scheduler taking each creation as an event.
func (cp *ControlPlane) StartScheduler(ctx context.Context, bin string) error {
	if cp.Scheduler != nil {
		return errors.New("kube-scheduler: already started")
	}
	if err := cp.spawnScheduler(bin); err != nil {
		return err
	}
	url := fmt.Sprintf("https://127.0.0.1:%d/healthz", cp.schedPort)
	return waitServing(ctx, cp.Scheduler, func() error { return httpsOKInsecure(ctx, url) })
}

// WaitSchedulerReady waits until the scheduler's /readyz passes, which includes its informers' event handlers
// having synced (check sched-handler-sync): from then on it schedules against every object the API server
// held when it started. /healthz does not wait for that.
func (cp *ControlPlane) WaitSchedulerReady(ctx context.Context) error {
	if cp.Scheduler == nil {
		return errors.New("kube-scheduler: not started")
	}
	url := fmt.Sprintf("https://127.0.0.1:%d/readyz", cp.schedPort)
	return waitServing(ctx, cp.Scheduler, func() error { return httpsOKInsecure(ctx, url) })
}

// StopScheduler ends the scheduler (SIGTERM, then SIGKILL after grace), so that a later StartScheduler starts
// one with empty caches and a fresh peak RSS.
func (cp *ControlPlane) StopScheduler(grace time.Duration) error {
	if cp.Scheduler == nil {
		return nil
	}
	p := cp.Scheduler
	cp.Scheduler = nil
	cp.procs = slices.DeleteFunc(cp.procs, func(q *Process) bool { return q == p })
	return p.Stop(grace)
}

// SchedulerCPUProfile writes a CPU profile of the running scheduler over the next d to w (its
// /debug/pprof/profile, served since --profiling is on by default).
func (cp *ControlPlane) SchedulerCPUProfile(ctx context.Context, d time.Duration, w io.Writer) error {
	return cp.schedulerPprof(ctx, fmt.Sprintf("profile?seconds=%d", max(int(d.Seconds()), 1)), d+30*time.Second, w)
}

// SchedulerHeapProfile writes a heap profile of the running scheduler to w.
func (cp *ControlPlane) SchedulerHeapProfile(ctx context.Context, w io.Writer) error {
	return cp.schedulerPprof(ctx, "heap", 30*time.Second, w)
}

// SchedulerHeapStats writes the running scheduler's heap profile in text form to w, after a garbage collection
// it is made to run first (pprof's heap?debug=1&gc=1): its runtime.MemStats lines then give the live heap, not
// what the last collection happened to leave.
func (cp *ControlPlane) SchedulerHeapStats(ctx context.Context, w io.Writer) error {
	return cp.schedulerPprof(ctx, "heap?debug=1&gc=1", 30*time.Second, w)
}

func (cp *ControlPlane) schedulerPprof(ctx context.Context, what string, limit time.Duration, w io.Writer) error {
	if cp.Scheduler == nil {
		return errors.New("kube-scheduler: not started")
	}
	url := fmt.Sprintf("https://127.0.0.1:%d/debug/pprof/%s", cp.schedPort, what)
	if err := httpsGetInsecure(ctx, url, limit, w); err != nil {
		return fmt.Errorf("kube-scheduler profile: %w", err)
	}
	return nil
}

// spawnScheduler starts kube-scheduler with its default profile.
func (cp *ControlPlane) spawnScheduler(bin string) error {
	kubeconfig := cp.kubeconfigs["kube-scheduler"]
	args := []string{
		"--authentication-kubeconfig", kubeconfig,
		"--authorization-kubeconfig", kubeconfig,
		"--bind-address", "127.0.0.1",
		"--secure-port", fmt.Sprint(cp.schedPort),
		// pprof without credentials, as the health checks: on loopback, for SchedulerCPUProfile.
		"--authorization-always-allow-paths", "/healthz,/readyz,/livez,/debug/pprof/*",
		"--v", "1",
	}
	if qps := cp.cfg.SchedulerClientQPS; qps > 0 {
		// No profiles: the default one, with every default plugin.
		conf := fmt.Sprintf(`apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %s
  qps: %d
  burst: %d
leaderElection:
  leaderElect: false
`, kubeconfig, qps, qps)
		path := filepath.Join(cp.cfg.Dir, "kube-scheduler-config.yaml")
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			return fmt.Errorf("kube-scheduler: config: %w", err)
		}
		args = append(args, "--config", path)
	} else {
		args = append(args, "--kubeconfig", kubeconfig, "--leader-elect=false")
	}
	p, err := cp.startComponent("kube-scheduler", bin, args...)
	if err != nil {
		return err
	}
	cp.Scheduler = p
	return nil
}

func (cp *ControlPlane) apiURL() string { return fmt.Sprintf("https://127.0.0.1:%d", cp.APIPort) }

// AdminKubeconfig is a kubeconfig for a cluster admin (kubectl --kubeconfig works with it while it runs).
func (cp *ControlPlane) AdminKubeconfig() string { return cp.adminKubeconfig }

// Stop ends every component, the last started first, each with SIGTERM and grace before SIGKILL.
func (cp *ControlPlane) Stop(grace time.Duration) error {
	var errs []error
	for i := len(cp.procs) - 1; i >= 0; i-- {
		if err := cp.procs[i].Stop(grace); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// startComponent starts a control plane process, logging to <LogDir>/<name>.log and recorded in the ledger
// when there is one.
func (cp *ControlPlane) startComponent(name, bin string, args ...string) (*Process, error) {
	p, err := startProcess(name, filepath.Join(cp.cfg.LogDir, name+".log"), cp.cfg.ledger, append([]string{bin}, args...)...)
	if err != nil {
		return nil, err
	}
	cp.procs = append(cp.procs, p)
	return p, nil
}
