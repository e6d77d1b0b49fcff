// Package harness runs a standalone kubelet with a private containerd and gpu-agent for the e2e suite, and
// reads what the kubelet and the containers really got. Every Env starts from empty state and ends only the
// processes it started, by PID.
package harness

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// DevicePluginDir is where the kubelet's device manager listens and looks for plugin sockets. The kubelet
// hard-codes it (it does not follow --root-dir), so only one Env may run on a machine at a time.
const DevicePluginDir = "/var/lib/kubelet/device-plugins"

// DRAPluginsDir holds DRA drivers' sockets: the kubelet dials the path a driver registers, which is the
// one inside the driver's container, so an installed DaemonSet's pod keeps the real directory.
const DRAPluginsDir = "/var/lib/kubelet/plugins"

// Config is what an Env needs from outside: binaries, images, and the agent's settings.
type Config struct {
	Kubelet    string   // kubelet binary built from k8s.io/kubernetes
	Agent      string   // gpu-agent binary
	Images     []string // docker-archive tarballs to import (see BuildImages)
	Backend    string   // gpu-agent --backend, e.g. sim:dgx-a100
	NodeName   string   // --hostname-override and gpu-agent --node-name
	LedgerPath string   // where the run records its PIDs; see ledger
	// AgentConfig is the initial content of the agent's config file; empty runs the agent with its default.
	AgentConfig string
	// AgentArgs are added after the DaemonSet's own args (later flags win).
	AgentArgs []string
	// Containerd2 is the directory of a containerd 2.x build (containerd, containerd-shim-runc-v2, ctr) to run
	// instead of Debian's containerd 1.6, with CDI on: the agent then writes its CDI spec where containerd
	// reads specs, and the node's device nodes are stand-ins under DevRoot (see CDIDevRoot).
	Containerd2 string
}

type dirs struct {
	run, logs                                  string
	containerdRoot, containerdState, cniDir    string
	containerdSock                             string
	kubeletRoot, certs, manifests, podLogs     string
	volumePlugins, kubeletConfig, podResources string
	agentState, agentMPS, agentConfigDir       string
	cdiSpecs, devRoot                          string
	// devicePlugins is where this node's kubelet keeps its device plugin sockets, as the host sees it:
	// DevicePluginDir, or for a Cluster's further node (AddNode) a directory of its own that its mount
	// namespace shows at DevicePluginDir.
	devicePlugins string
}

func newDirs(run string) dirs {
	return dirs{
		run:             run,
		logs:            filepath.Join(run, "logs"),
		containerdRoot:  filepath.Join(run, "containerd", "root"),
		containerdState: filepath.Join(run, "containerd", "state"),
		cniDir:          filepath.Join(run, "containerd", "cni"),
		containerdSock:  filepath.Join(run, "containerd", "containerd.sock"),
		kubeletRoot:     filepath.Join(run, "kubelet"),
		certs:           filepath.Join(run, "kubelet-pki"),
		manifests:       filepath.Join(run, "manifests"),
		podLogs:         filepath.Join(run, "pod-logs"),
		volumePlugins:   filepath.Join(run, "volume-plugins"),
		kubeletConfig:   filepath.Join(run, "kubelet-config.yaml"),
		podResources:    filepath.Join(run, "kubelet", "pod-resources", "kubelet.sock"),
		agentState:      filepath.Join(run, "agent", "state"),
		agentMPS:        filepath.Join(run, "agent", "mps"),
		agentConfigDir:  filepath.Join(run, "agent", "config"),
		cdiSpecs:        filepath.Join(run, "cdi"),
		devRoot:         filepath.Join(run, "devroot"),
		devicePlugins:   DevicePluginDir,
	}
}

// Env is one kubelet + containerd + gpu-agent, all started by this process from empty state.
type Env struct {
	t           testing.TB
	cfg         Config
	d           dirs
	ledger      *ledger
	kubeletPort int
	healthzPort int
	agentAddr   string

	containerd *Process
	kubelet    *Process
	agent      *Process
	kubeletN   int // kubelet starts, to name their log files
	agentN     int
	// extraBackend is appended to the next agent's --backend (SetBackendOptions).
	extraBackend string
	// kubeletArgs are added to every kubelet start (a Cluster's --kubeconfig and --node-labels).
	kubeletArgs []string
	// controlPlane are a Cluster's etcd and control plane components, in start order; the teardown stops
	// them last, in reverse.
	controlPlane []*Process
	// mpsHost is the `gpu-agent mps-host` process (StartMPSHost); mpsHostN counts its starts.
	mpsHost  *Process
	mpsHostN int
	// further is set on a Cluster's further node (AddNode): its containerd and kubelet share a mount
	// namespace of their own, and its teardown leaves the Cluster's ledger and control plane alone.
	further *furtherNode
	// podNet is the node's own pod network (ClusterConfig.PodNetwork); nil: pods must use the host network.
	podNet *podNetwork
}

// Start brings up containerd (with the images imported), the kubelet, and gpu-agent, and registers the
// teardown with t.Cleanup. It fails t on error.
func Start(t testing.TB, cfg Config) *Env {
	t.Helper()
	e, err := newEnv(t, cfg)
	if err != nil {
		t.Fatalf("e2e env: %v", err)
	}
	t.Cleanup(e.teardown)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := e.startContainerd(ctx); err != nil {
		t.Fatalf("e2e env: %v", err)
	}
	e.logContainerd(ctx)
	if err := e.StartKubelet(ctx); err != nil {
		t.Fatalf("e2e env: %v", err)
	}
	if err := e.StartAgent(ctx); err != nil {
		t.Fatalf("e2e env: %v", err)
	}
	return e
}

func newEnv(t testing.TB, cfg Config) (*Env, error) {
	if err := recoverLedger(cfg.LedgerPath, t.Logf); err != nil {
		return nil, err
	}
	// The kubelet's device manager state lives outside --root-dir; a checkpoint from an earlier run would
	// hand this run's pods devices the kubelet thinks are still taken.
	if err := os.RemoveAll(DevicePluginDir); err != nil {
		return nil, fmt.Errorf("wipe %s: %w", DevicePluginDir, err)
	}
	if err := os.MkdirAll(DevicePluginDir, 0o755); err != nil {
		return nil, err
	}
	// A DRA driver's socket from an earlier run, in the real plugins directory (see NodeLayer).
	if err := os.RemoveAll(filepath.Join(DRAPluginsDir, "gpu.nvidia.com")); err != nil {
		return nil, fmt.Errorf("wipe the DRA driver's directory: %w", err)
	}
	// A short path: unix socket paths are limited to 108 bytes, and containerd nests its own below this.
	run, err := os.MkdirTemp("", "gpu-agent-e2e-")
	if err != nil {
		return nil, err
	}
	d := newDirs(run)
	l, err := newLedger(cfg.LedgerPath, run)
	if err != nil {
		return nil, err
	}
	for _, p := range []string{d.logs, d.containerdRoot, d.containerdState, d.cniDir, d.kubeletRoot, d.certs,
		d.manifests, d.podLogs, d.volumePlugins, d.agentState, d.agentMPS} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return nil, err
		}
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	e := &Env{t: t, cfg: cfg, d: d, ledger: l, kubeletPort: ports[0], healthzPort: ports[1],
		agentAddr: fmt.Sprintf("127.0.0.1:%d", ports[2])}
	if err := os.WriteFile(d.kubeletConfig, []byte(kubeletConfig(d, e.kubeletPort, e.healthzPort)), 0o644); err != nil {
		return nil, err
	}
	if cfg.AgentConfig != "" {
		if err := writeConfigMap(d.agentConfigDir, "config.yaml", cfg.AgentConfig, time.Now()); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// freePorts asks the kernel for n distinct free TCP ports on 127.0.0.1, none of them in avoid: ports given out
// earlier whose owner has not bound them yet (the kubelet's, when the control plane's are picked), which the
// kernel, seeing them free, may hand out again.
func freePorts(n int, avoid ...int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for len(ports) < n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l) // held until the end, so it is not returned twice
		if p := l.Addr().(*net.TCPAddr).Port; !slices.Contains(avoid, p) {
			ports = append(ports, p)
		}
	}
	return ports, nil
}

func (e *Env) startContainerd(ctx context.Context) error {
	cfgPath := filepath.Join(e.d.run, "containerd.toml")
	cfg, bin := containerdConfig(e.d), "containerd"
	if dir := e.cfg.Containerd2; dir != "" {
		cfg, bin = containerd2Config(e.d, filepath.Join(dir, "containerd-shim-runc-v2")), filepath.Join(dir, "containerd")
		if err := makeDevRoot(e.d.devRoot, 16); err != nil {
			return err
		}
	}
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	argv := []string{bin, "--config", cfgPath}
	if e.further != nil {
		argv = e.further.containerdArgv(e.d, argv)
	}
	p, err := startProcess("containerd", filepath.Join(e.d.logs, "containerd.log"), e.ledger, argv...)
	if err != nil {
		return err
	}
	e.containerd = p
	err = poll(ctx, 100*time.Millisecond, func() error {
		if done, werr := p.Exited(); done {
			return stop(fmt.Errorf("containerd exited: %v (see %s)", werr, p.LogPath))
		}
		_, err := e.ctr(ctx, "version")
		return err
	})
	if err != nil {
		return fmt.Errorf("containerd: not serving: %w", err)
	}
	for _, img := range e.cfg.Images {
		if out, err := e.ctr(ctx, "images", "import", "--snapshotter", "overlayfs", img); err != nil {
			return fmt.Errorf("containerd: import %s: %w: %s", img, err, out)
		}
	}
	return nil
}

// logContainerd says in the test's log which containerd the scenario runs on.
func (e *Env) logContainerd(ctx context.Context) {
	v, err := e.ContainerdVersion(ctx)
	if err != nil {
		e.t.Logf("containerd: version unknown: %v", err)
		return
	}
	e.t.Logf("containerd %s", v)
}

// ContainerdVersion is the version the running containerd reports ("1.6.20~ds1", "2.4.2").
func (e *Env) ContainerdVersion(ctx context.Context) (string, error) {
	out, err := e.ctr(ctx, "version")
	if err != nil {
		return "", fmt.Errorf("ctr version: %w: %s", err, out)
	}
	// Client: ... Server:\n  Version: X
	_, server, ok := strings.Cut(out, "Server:")
	if !ok {
		return "", fmt.Errorf("ctr version: no server section in %q", out)
	}
	for _, line := range strings.Split(server, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Version:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("ctr version: no server version in %q", out)
}

// AgentStateDir is the agent's --state-dir on this node (the DaemonSet's hostPath, mapped).
func (e *Env) AgentStateDir() string { return e.d.agentState }

// CDISpecDir is where this Env's containerd 2.x reads CDI specs (and the agent must write them).
func (e *Env) CDISpecDir() string { return e.d.cdiSpecs }

// CDIDevRoot is the stand-in driver root: dev/nvidia<N>, the control nodes and every MIG capability node,
// each a character device with /dev/null's numbers, so a container given one can open it.
func (e *Env) CDIDevRoot() string { return e.d.devRoot }

// makeDevRoot creates the stand-in device nodes of up to gpus GPUs under root.
func makeDevRoot(root string, gpus int) error {
	caps := filepath.Join(root, "dev", "nvidia-caps")
	if err := os.MkdirAll(caps, 0o755); err != nil {
		return err
	}
	nodes := []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}
	for i := range gpus {
		nodes = append(nodes, fmt.Sprintf("nvidia%d", i))
	}
	// The driver numbers MIG capabilities 3 + gpu*135 + gi*9 + (ci+1): see the agent's cdi.DriverNumbering.
	for i := 1; i < 3+gpus*135; i++ {
		nodes = append(nodes, fmt.Sprintf("nvidia-caps/nvidia-cap%d", i))
	}
	const devNull = 1<<8 | 3 // major 1, minor 3
	for _, n := range nodes {
		p := filepath.Join(root, "dev", n)
		if err := syscall.Mknod(p, syscall.S_IFCHR|0o666, devNull); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("stand-in device node %s: %w", p, err)
		}
	}
	return nil
}

// ctr runs containerd's own client against this Env's containerd, in the CRI's namespace.
func (e *Env) ctr(ctx context.Context, args ...string) (string, error) {
	argv := append([]string{"--address", e.d.containerdSock, "--namespace", "k8s.io"}, args...)
	bin := "ctr"
	if e.cfg.Containerd2 != "" {
		bin = filepath.Join(e.cfg.Containerd2, "ctr")
	}
	// stdout only: ctr 2.x warns on it (cgroup v1 deprecation) otherwise mixed into listings.
	var stderr strings.Builder
	cmd := exec.CommandContext(ctx, bin, argv...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		err = fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return string(out), err
}

// RunningTasks returns the IDs of containerd tasks (sandboxes and containers) that are running.
func (e *Env) RunningTasks(ctx context.Context) (map[string]bool, error) {
	out, err := e.ctr(ctx, "tasks", "ls")
	if err != nil {
		return nil, fmt.Errorf("ctr tasks ls: %w: %s", err, out)
	}
	return parseTaskList(out), nil
}

// parseTaskList reads `ctr tasks ls` (TASK PID STATUS) into the set of RUNNING task IDs.
func parseTaskList(out string) map[string]bool {
	running := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[2] == "RUNNING" {
			running[f[0]] = true
		}
	}
	return running
}

// StartKubelet starts the kubelet on this Env's state (a restart keeps it) and waits for its healthz and for
// its device manager's kubelet.sock.
func (e *Env) StartKubelet(ctx context.Context) error {
	if e.kubelet != nil {
		if done, _ := e.kubelet.Exited(); !done {
			return errors.New("kubelet: already running")
		}
	}
	// A stopped kubelet leaves its sockets behind; remove them so that their presence below means this
	// kubelet is serving. (The new kubelet would remove kubelet.sock itself, and gpu-agent must then act on
	// its re-creation either way.)
	for _, sock := range []string{filepath.Join(e.d.devicePlugins, "kubelet.sock"), e.d.podResources} {
		if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("kubelet: remove stale %s: %w", sock, err)
		}
	}
	e.kubeletN++
	argv := append([]string{e.cfg.Kubelet,
		"--config", e.d.kubeletConfig,
		"--root-dir", e.d.kubeletRoot,
		"--cert-dir", e.d.certs,
		"--hostname-override", e.cfg.NodeName,
		"--v", "2"}, e.kubeletArgs...)
	if e.further != nil {
		var err error
		if argv, err = e.further.kubeletArgv(e.containerd, argv); err != nil {
			return err
		}
	}
	p, err := startProcess("kubelet", filepath.Join(e.d.logs, fmt.Sprintf("kubelet-%d.log", e.kubeletN)), e.ledger, argv...)
	if err != nil {
		return err
	}
	e.kubelet = p
	healthz := fmt.Sprintf("http://127.0.0.1:%d/healthz", e.healthzPort)
	err = poll(ctx, 200*time.Millisecond, func() error {
		if done, werr := p.Exited(); done {
			return stop(fmt.Errorf("kubelet exited: %v (see %s)", werr, p.LogPath))
		}
		if err := HTTPOK(ctx, healthz); err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(e.d.devicePlugins, "kubelet.sock")); err != nil {
			return err
		}
		_, err := os.Stat(e.d.podResources)
		return err
	})
	if err != nil {
		return fmt.Errorf("kubelet: not ready: %w", err)
	}
	return nil
}

// StopKubelet ends the kubelet with SIGTERM; containers keep running, as on a real node.
func (e *Env) StopKubelet() error {
	if e.kubelet == nil {
		return nil
	}
	return e.kubelet.Stop(10 * time.Second)
}

// Kubelet is the running kubelet process (nil before StartKubelet).
func (e *Env) Kubelet() *Process { return e.kubelet }

// StartAgent starts gpu-agent and waits for its /readyz. Callers then wait with WaitAllocatable until the
// kubelet lists the devices before adding pods: registration alone is not enough, a pod admitted before the
// first ListAndWatch reply is rejected, and one admitted before registration silently gets no device.
func (e *Env) StartAgent(ctx context.Context) error {
	if e.agent != nil {
		if done, _ := e.agent.Exited(); !done {
			return errors.New("gpu-agent: already running")
		}
	}
	for attempt := 1; ; attempt++ {
		p, err := e.spawnAgent()
		if err != nil {
			return err
		}
		err = poll(ctx, 200*time.Millisecond, func() error {
			if done, werr := p.Exited(); done {
				return stop(fmt.Errorf("gpu-agent exited: %v (see %s)", werr, p.LogPath))
			}
			return HTTPOK(ctx, "http://"+e.agentAddr+"/readyz")
		})
		if err == nil {
			return nil
		}
		// freePorts' port can be taken by another process between its check and the agent's bind: take
		// another one rather than fail the scenario.
		if log, _ := os.ReadFile(p.LogPath); attempt < 3 && strings.Contains(string(log), "bind: address already in use") {
			ports, perr := freePorts(1)
			if perr != nil {
				return perr
			}
			e.t.Logf("gpu-agent: %s was taken, listening on 127.0.0.1:%d instead", e.agentAddr, ports[0])
			e.agentAddr = fmt.Sprintf("127.0.0.1:%d", ports[0])
			continue
		}
		return fmt.Errorf("gpu-agent: not ready: %w", err)
	}
}

// backend is the agent's --backend: a simulated node keeps its GPU state in
// the Env's run directory, so it outlives each gpu-agent process as real GPUs
// do and an agent restart meets the GPUs the last agent left.
func (e *Env) backend() string {
	be := e.cfg.Backend
	if strings.HasPrefix(be, "sim:") && !strings.Contains(be, ",state=") {
		be += ",state=" + e.SimStateFile()
	}
	return be + e.extraBackend
}

// SimStateFile is where the simulated node keeps its GPU state.
func (e *Env) SimStateFile() string { return filepath.Join(e.d.run, "sim-state.json") }

// SetBackendOptions adds options to the simulated backend of the next
// StartAgent (e.g. ",crash-after=3"); "" removes them.
func (e *Env) SetBackendOptions(opts string) { e.extraBackend = opts }

// spawnAgent starts a gpu-agent process with the DaemonSet's args.
func (e *Env) spawnAgent() (*Process, error) {
	e.agentN++
	argv, env, err := daemonSetArgs(e)
	if err != nil {
		return nil, fmt.Errorf("gpu-agent: %w", err)
	}
	argv = append([]string{e.cfg.Agent}, argv...)
	argv = append(argv, "--backend", e.backend())
	if e.cfg.Containerd2 != "" {
		argv = append(argv, "--nvidia-dev-root", e.d.devRoot) // the spec dir is the DaemonSet's, mapped
	}
	argv = append(argv, e.cfg.AgentArgs...)
	p, err := startProcessEnv("gpu-agent", filepath.Join(e.d.logs, fmt.Sprintf("gpu-agent-%d.log", e.agentN)), e.ledger, env, argv...)
	if err != nil {
		return nil, err
	}
	e.agent = p
	return p, nil
}

// StartAgentExpectingCrash starts gpu-agent and waits for it to be killed
// (a simulated node's crash-after option kills it mid-change). Readiness says
// nothing here: the agent serves long before a repartition is done, so the
// crash point can come after /readyz answers. It fails if the agent exits any
// other way, or if /status shows every GPU's MIG plan applied, which means the
// changes the crash was to interrupt are over and the crash will not come.
func (e *Env) StartAgentExpectingCrash(ctx context.Context) error {
	p, err := e.spawnAgent()
	if err != nil {
		return err
	}
	return poll(ctx, 100*time.Millisecond, func() error {
		done, werr := p.Exited()
		if !done {
			if st, err := e.AgentStatus(ctx); err == nil && migSettled(st) {
				return stop(fmt.Errorf("gpu-agent applied every GPU's MIG plan instead of crashing (see %s)", p.LogPath))
			}
			return errors.New("still running")
		}
		var ee *exec.ExitError
		if errors.As(werr, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
				return nil
			}
		}
		return stop(fmt.Errorf("gpu-agent exited with %v, want killed by SIGKILL (see %s)", werr, p.LogPath))
	})
}

// migSettled says whether /status lists MIG plans and every one is applied.
func migSettled(st *AgentStatus) bool {
	if len(st.MIG) == 0 {
		return false
	}
	for _, m := range st.MIG {
		if m.Phase != "applied" {
			return false
		}
	}
	return true
}

// StopAgent ends gpu-agent with SIGTERM.
func (e *Env) StopAgent() error {
	if e.agent == nil {
		return nil
	}
	return e.agent.Stop(10 * time.Second)
}

// Agent is the running gpu-agent process (nil before StartAgent).
func (e *Env) Agent() *Process { return e.agent }

// AgentAddr is gpu-agent's --listen address (host:port).
func (e *Env) AgentAddr() string { return e.agentAddr }

// UpdateAgentConfig replaces the agent's config file the way the kubelet updates a ConfigMap volume.
func (e *Env) UpdateAgentConfig(content string) error {
	if e.cfg.AgentConfig == "" {
		return errors.New("agent config: the Env was started without one, so gpu-agent does not watch a file")
	}
	return writeConfigMap(e.d.agentConfigDir, "config.yaml", content, time.Now())
}

// RunDir is the Env's private directory (logs under RunDir/logs).
func (e *Env) RunDir() string { return e.d.run }

// HTTPOK GETs url and wants 200 within 2 s; an error names the status and the start of the body.
func HTTPOK(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// teardown stops everything this Env started, removes its containers, mounts and directory. On failure it
// first prints the tail of every daemon's log and keeps the run directory for inspection.
func (e *Env) teardown() {
	t := e.t
	t.Helper()
	failed := t.Failed()
	if failed {
		e.dumpLogs()
	}
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if e.agent != nil {
		add(e.agent.Stop(5 * time.Second))
	}
	if e.mpsHost != nil {
		add(e.mpsHost.Stop(5 * time.Second))
	}
	if e.kubelet != nil {
		add(e.kubelet.Stop(10 * time.Second))
	}
	if e.containerd != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		add(e.removeAllTasks(ctx))
		cancel()
		add(e.containerd.Stop(10 * time.Second))
	}
	if e.podNet != nil {
		add(e.podNet.release())
	}
	for i := len(e.controlPlane) - 1; i >= 0; i-- {
		add(e.controlPlane[i].Stop(10 * time.Second))
	}
	killShims(e.d.run, t.Logf)
	killMPSDaemons(e.d.agentMPS, t.Logf)
	add(unmountUnder(e.d.run))
	keep := e.d.run + ".failed"
	if e.further != nil {
		add(e.further.cleanup())
		keep = e.further.keepLogs
	}
	if failed || len(errs) > 0 {
		_ = os.RemoveAll(keep)
		// Keep the logs only; the rest holds container root filesystems and sockets.
		if err := os.Rename(e.d.logs, keep); err == nil {
			t.Logf("e2e logs of node %s kept in %s", e.cfg.NodeName, keep)
		}
	}
	// A further node's directory is inside the Cluster's, which the Cluster's teardown removes, and the
	// ledger is the Cluster's.
	if e.further == nil {
		add(os.RemoveAll(e.d.run))
		add(e.ledger.remove())
	}
	for _, err := range errs {
		t.Errorf("e2e teardown of node %s: %v", e.cfg.NodeName, err)
	}
}

// removeAllTasks kills and deletes every task in the CRI namespace so that the shims exit; otherwise they
// outlive containerd and keep the container mounts busy.
func (e *Env) removeAllTasks(ctx context.Context) error {
	var errs []error
	// containerd's CRI plugin also deletes tasks as they exit, so a delete can race with it and fail ("not
	// found", "ttrpc: closed"); what matters is that no task is left, so list again until none is.
	err := poll(ctx, 200*time.Millisecond, func() error {
		out, err := e.ctr(ctx, "tasks", "ls", "-q")
		if err != nil {
			return fmt.Errorf("ctr tasks ls: %w: %s", err, out)
		}
		ids := strings.Fields(out)
		if len(ids) == 0 {
			return nil
		}
		errs = errs[:0]
		for _, id := range ids {
			if out, err := e.ctr(ctx, "tasks", "delete", "--force", id); err != nil {
				errs = append(errs, fmt.Errorf("ctr tasks delete %s: %w: %s", id, err, strings.TrimSpace(out)))
			}
		}
		return fmt.Errorf("%d tasks were left", len(ids))
	})
	if err != nil {
		return errors.Join(append([]error{err}, errs...)...)
	}
	return nil
}

func (e *Env) dumpLogs() {
	entries, _ := os.ReadDir(e.d.logs)
	for _, ent := range entries {
		p := filepath.Join(e.d.logs, ent.Name())
		e.t.Logf("---- last lines of %s ----\n%s", p, tail(p, 25))
	}
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	// Lines the kubelet and containerd repeat every few seconds; they would push the lines that explain a
	// failure out of the tail.
	logNoise := []string{
		"kubelet_node_status.go", "setters.go", "Recording event message for node",
		`level=info msg="loading plugin`,
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if !slices.ContainsFunc(logNoise, func(s string) bool { return strings.Contains(l, s) }) {
			lines = append(lines, l)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// stopErr marks an error that makes poll give up at once (a daemon exited; waiting longer cannot help).
type stopErr struct{ error }

func stop(err error) error { return stopErr{err} }

// poll calls f every interval until it returns nil, it returns a stop error, or ctx ends; the error then
// says what f last reported, which is what a failing e2e test needs to show.
func poll(ctx context.Context, interval time.Duration, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		var s stopErr
		if errors.As(err, &s) {
			return s.error
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(interval):
		}
	}
}

// Lock takes the machine-wide e2e lock (the kubelet's device plugin directory is global), waiting for it.
// The lock is released when the returned file is closed or the process exits.
func Lock(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return f, nil
}

// AgentStatus is the part of gpu-agent's /status the suite reads.
type AgentStatus struct {
	// LastLoop is the agent loop's last turn (each event batch and resync).
	LastLoop time.Time `json:"lastLoop"`
	Config   struct {
		Name       string `json:"name"`
		Generation int    `json:"generation"`
		Error      string `json:"error"`
	} `json:"config"`
	Registrations []struct {
		Resource     string    `json:"resource"`
		Registered   bool      `json:"registered"`
		RegisteredAt time.Time `json:"registeredAt"`
	} `json:"registrations"`
	// MIG is each GPU's repartitioning state.
	MIG []struct {
		GPU    int    `json:"gpu"`
		UUID   string `json:"uuid"`
		Phase  string `json:"phase"`
		Reason string `json:"reason"`
		// ResetBlockers is what keeps a GPU whose MIG mode change waits for a reset from it.
		ResetBlockers []string `json:"resetBlockers"`
	} `json:"mig"`
	// Conflicts are the other GPU components the agent sees acting on its node, one sentence each.
	Conflicts []string `json:"conflicts"`
	// HealthEvents are the GPUs the agent receives NVML health events for.
	HealthEvents []string `json:"healthEvents"`
	// HealthCauses are the health faults in force, as /status shows them.
	HealthCauses []struct {
		GPU    string `json:"gpu"`
		Reason string `json:"reason"`
	} `json:"healthCauses"`
	// GPUs as the agent believes them: their MIG instances and any GPU
	// instance left without a compute instance.
	GPUs []struct {
		Index     int    `json:"index"`
		UUID      string `json:"uuid"`
		Instances []struct {
			UUID    string `json:"uuid"`
			Profile string `json:"profile"`
		} `json:"instances"`
		GIsWithoutCI []struct {
			GI int `json:"gi"`
		} `json:"gisWithoutCI"`
	} `json:"gpus"`
	// Resources are the devices offered, with health.
	Resources []struct {
		Name    string `json:"name"`
		Devices []struct {
			ID      string `json:"id"`
			Healthy bool   `json:"healthy"`
			Reason  string `json:"reason"`
		} `json:"devices"`
	} `json:"resources"`
}

// RegisteredSince reports whether gpu-agent says it registered resource with the kubelet after t.
func (s *AgentStatus) RegisteredSince(resource string, t time.Time) bool {
	for _, r := range s.Registrations {
		if r.Resource == resource && r.Registered && r.RegisteredAt.After(t) {
			return true
		}
	}
	return false
}

// AgentStatus reads gpu-agent's /status.
func (e *Env) AgentStatus(ctx context.Context) (*AgentStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+e.agentAddr+"/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("gpu-agent /status: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("gpu-agent /status: %s", resp.Status)
	}
	var st AgentStatus
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return nil, fmt.Errorf("gpu-agent /status: %w", err)
	}
	return &st, nil
}

// WaitAgentStatus polls /status until cond holds and returns that status.
func (e *Env) WaitAgentStatus(ctx context.Context, what string, cond func(*AgentStatus) bool) (*AgentStatus, error) {
	var st *AgentStatus
	err := poll(ctx, 200*time.Millisecond, func() error {
		var err error
		if st, err = e.AgentStatus(ctx); err != nil {
			return err
		}
		if !cond(st) {
			return fmt.Errorf("not yet %s: config %+v", what, st.Config)
		}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("gpu-agent status: %w", err)
	}
	return st, nil
}

// StartMPSHost starts `gpu-agent mps-host` on the agent's MPS root (the directory its --mps-root maps to here),
// with args added, and waits until it has written health.json. Like the agent it is a plain process: outside a
// container its daemons outlive it, so the teardown ends them by their pipe directory.
func (e *Env) StartMPSHost(ctx context.Context, args ...string) error {
	if e.mpsHost != nil {
		if done, _ := e.mpsHost.Exited(); !done {
			return errors.New("gpu-agent mps-host: already running")
		}
	}
	e.mpsHostN++
	argv := append([]string{e.cfg.Agent, "mps-host", "--mps-root=" + e.d.agentMPS}, args...)
	p, err := startProcess("gpu-agent mps-host", filepath.Join(e.d.logs, fmt.Sprintf("mps-host-%d.log", e.mpsHostN)), e.ledger, argv...)
	if err != nil {
		return err
	}
	e.mpsHost = p
	health := filepath.Join(e.d.agentMPS, "health.json")
	err = poll(ctx, 100*time.Millisecond, func() error {
		if done, werr := p.Exited(); done {
			return stop(fmt.Errorf("gpu-agent mps-host exited: %v (see %s)", werr, p.LogPath))
		}
		b, err := os.ReadFile(health)
		if err != nil {
			return err
		}
		var h struct {
			PID int `json:"pid"`
		}
		if err := json.Unmarshal(b, &h); err != nil {
			return fmt.Errorf("%s: %w", health, err)
		}
		if h.PID != p.PID() {
			return fmt.Errorf("%s is from pid %d, not this mps-host (%d)", health, h.PID, p.PID())
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("gpu-agent mps-host: no health.json: %w", err)
	}
	return nil
}

// StopMPSHost ends gpu-agent mps-host with SIGTERM.
func (e *Env) StopMPSHost() error {
	if e.mpsHost == nil {
		return nil
	}
	return e.mpsHost.Stop(10 * time.Second)
}

// MPSHost is the last gpu-agent mps-host process started (nil before StartMPSHost); Kill ends it as a crash would.
func (e *Env) MPSHost() *Process { return e.mpsHost }
